"""Linear layers whose weights are laid out once for oneDNN's matrix products (bf16 on CPUs).

`F.linear` on bf16 CPU tensors hands oneDNN the weights in PyTorch's plain layout, and oneDNN
reorders them into its blocked layout on every call: for a decode step that reorder costs as
much as the product or more (docs/benchmarks/speed.md). This is the path PyTorch's own compiler
takes for frozen bf16 linear layers on the CPU (`mkldnn._reorder_linear_weight`,
`mkldnn._linear_pointwise`); here it is taken without compiling anything. oneDNN does not
promise products bit-for-bit equal to `F.linear`'s, so tests/engine/test_prepack.py asks for
bf16 closeness.

A `PrepackedLinear` keeps the plain weight too (a head tied to the embeddings shares it, and
other code reads it); the oneDNN copy costs as much memory again. Only bf16 weights on a CPU
whose oneDNN build supports bf16 are prepacked; other layers and dtypes are left as they are.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.model.lowbit import BlockLinear
from engine.model.onednn import pack, product, supported
from engine.model.quantize import PackedLinear


class PrepackedLinear(torch.nn.Linear):
    """An `nn.Linear` (same weight and bias parameters) that multiplies with a copy of its
    weight laid out for oneDNN. `packed` is None where it multiplies through `F.linear`."""

    def __init__(self, linear: torch.nn.Linear):
        torch.nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # the same Parameter: tied weights stay tied
        self.bias = linear.bias
        self.packed = pack(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None or x.dtype != torch.bfloat16 or x.device.type != "cpu":
            return F.linear(x, self.weight, self.bias)
        return product(x, self.packed, self.bias)


def install(model: torch.nn.Module) -> int:
    """Replace every plain bf16 `nn.Linear` of `model` with a PrepackedLinear (in place), and
    give quantised and block layers (engine.model.quantize, engine.model.lowbit) a prepacked
    copy of their bf16 weights for the forwards too large for their kernels; returns how many
    layers have one. Layers with
    hooks keep theirs (a new module would drop them)."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) in (PackedLinear, BlockLinear) and supported(child.weight):
                if child.dense_packed is None:
                    child.dense_packed = pack(child.weight)
                count += 1
                continue
            if (type(child) is not torch.nn.Linear or not supported(child.weight)
                    or child._forward_hooks or child._forward_pre_hooks):
                continue
            setattr(parent, name, PrepackedLinear(child))
            count += 1
    return count
