"""oneDNN's prepacked matrix product: a weight laid out once for oneDNN, then multiplied without
the per-call reorder that `F.linear` on bf16 CPU tensors pays (engine.model.prepack uses it)."""

from __future__ import annotations

import torch


def supported(weight: torch.Tensor) -> bool:
    """Whether weights of this dtype and device can be prepacked here."""
    return (weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
            and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] laid out for oneDNN (an opaque tensor for `product`)."""
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None,
           bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, through `product` where `packed` holds the weight's copy
    and `x` is bf16."""
    if packed is not None and x.dtype == torch.bfloat16:
        return product(x, packed, bias)
    return torch.nn.functional.linear(x, weight, bias)


def product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` with `packed = pack(weight)` (x bf16 on the CPU)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
