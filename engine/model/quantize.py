"""Weight-only quantisation for decoding on the CPU (`option.quantize`).

One row's decode step reads every weight once and does little arithmetic with it, so on a CPU
it is bound by memory bandwidth. PyTorch's own weight-only kernels
(`aten._weight_int4pack_mm_for_cpu`, groups of 32 columns with a scale and a zero each, and
`aten._weight_int8pack_mm`, a scale per output channel) read a quarter or half of bf16's bytes.
They scale badly with rows, though (docs/benchmarks/speed.md), so a `PackedLinear` keeps both:
the packed weights for forwards of at most `max_rows` rows (decode at low concurrency), and the
same weights de-quantised, in the model's dtype, for larger ones (prefill chunks, busy
batches). Both paths compute with the same weight values, so a sequence's
tokens do not depend on which path a step took beyond rounding, as with any change of batch
size.

int4 quantises the decoder's linear layers and keeps the output head in int8: the head turns
each hidden state into 49k logits, and the embedded GGUF itself stores it in 8 bits (Q8_0)
while its layers are 4-bit (Q4_1, groups of 32, which int4 with groups of 32 represents
closely). The kernels are CPU ones: on a GPU the option is ignored (with a warning).

The engine takes this path only where the blocks of engine/model/lowbit.py are not used (no
native library, `--linear-kernel torch`, or no layer fits them): those serve int4 and int8 on
fp32 and bf16 models faster.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import QUANTIZE_MODES as MODES
from engine.model import onednn

GROUP = 32  # int4 columns sharing one scale and zero
MAX_ROWS = 4  # forwards with more rows than this use the de-quantised weights


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit groups of GROUP columns: w ≈ (q - 8) * scale + zero, q in 0..15.

    Returns the packed weights for the CPU kernel, its [columns / GROUP, rows, 2] scales and
    zeros (float32), and the de-quantised weights (float32).
    """
    w = weight.detach().float()
    rows, cols = w.shape
    groups = w.reshape(rows, cols // GROUP, GROUP)
    lo, hi = groups.amin(-1), groups.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=torch.finfo(torch.float32).tiny)
    q = ((groups - lo[..., None]) / scale[..., None]).round().clamp(0, 15)
    zero = lo + 8 * scale
    dequant = ((q - 8) * scale[..., None] + zero[..., None]).reshape(rows, cols)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        q.to(torch.int32).reshape(rows, cols), 2)
    scales_zeros = torch.stack([scale.t(), zero.t()], dim=-1).contiguous()
    return packed, scales_zeros, dequant


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Symmetric 8 bits with one scale per output row: w ≈ q * scale, q in -127..127.

    Returns the int8 weights, the scales and the de-quantised weights (float32)."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    q = (w / scale[:, None]).round().clamp(-127, 127)
    return q.to(torch.int8), scale, q * scale[:, None]


class PackedLinear(torch.nn.Module):
    """A linear layer with weight-only quantised weights: the packed copy for forwards of at
    most `max_rows` rows, the de-quantised `weight` (model dtype) for larger ones."""

    def __init__(self, linear: torch.nn.Linear, bits: int, max_rows: int = MAX_ROWS):
        super().__init__()
        dtype = linear.weight.dtype
        self.bits = bits
        self.max_rows = max_rows
        self.in_features, self.out_features = linear.in_features, linear.out_features
        if bits == 4:
            packed, scales, dequant = quantize_int4(linear.weight)
        else:
            packed, scales, dequant = quantize_int8(linear.weight)
        self.register_buffer("packed", packed)
        self.register_buffer("scales", scales.to(dtype))
        self.weight = torch.nn.Parameter(dequant.to(dtype), requires_grad=False)
        self.bias = linear.bias
        self.dense_packed: torch.Tensor | None = None  # `weight` for oneDNN (engine.model.onednn)

    @classmethod
    def stacked(cls, parts: list[PackedLinear]) -> PackedLinear | None:
        """One layer computing `parts` side by side (their outputs concatenated), from their
        already quantised weights, or None where that cannot be done exactly.

        A row's groups are quantised on their own, so the stacked rows of the parts' packed
        weights, scales and de-quantised weights are those of the stacked layer, as long as the
        kernel's packed layout keeps rows apart (the CPU int4 layout interleaves rows in blocks
        of 64: parts of 32 rows do not stack). That is checked, not assumed: the stacked
        kernel must reproduce every part's weights exactly on an identity input. The parts
        then read views of the stacked weights (no second copy); the scales, a few KiB, stay
        theirs (the kernel wants them contiguous)."""
        first = parts[0]
        biases = [p.bias for p in parts]
        if (any(p.bits != first.bits or p.max_rows != first.max_rows
                or p.in_features != first.in_features or p.weight.dtype != first.weight.dtype
                for p in parts) or len({b is None for b in biases}) != 1):
            return None
        layer = cls.__new__(cls)
        torch.nn.Module.__init__(layer)
        layer.bits, layer.max_rows = first.bits, first.max_rows
        layer.in_features = first.in_features
        layer.out_features = sum(p.out_features for p in parts)
        layer.register_buffer("packed", torch.cat([p.packed for p in parts]))
        # int4 scales are [column groups, rows, 2], int8 ones [rows]
        layer.register_buffer("scales", torch.cat([p.scales for p in parts],
                                                  dim=1 if first.bits == 4 else 0))
        layer.weight = torch.nn.Parameter(torch.cat([p.weight for p in parts]),
                                          requires_grad=False)
        layer.bias = None if biases[0] is None else torch.cat(biases)
        layer.dense_packed = None
        probe = torch.eye(layer.in_features, dtype=first.weight.dtype,
                          device=first.weight.device)
        if not torch.equal(layer.packed_product(probe),
                           torch.cat([p.packed_product(probe) for p in parts], dim=-1)):
            return None
        sizes = [p.out_features for p in parts]
        for p, packed, rows in zip(parts, layer.packed.split(sizes), layer.weight.split(sizes)):
            p.packed = packed
            p.weight = torch.nn.Parameter(rows, requires_grad=False)
        if first.dense_packed is not None:  # the stacked layer's copy serves; theirs would idle
            layer.dense_packed = onednn.pack(layer.weight)
            for p in parts:
                p.dense_packed = None
        return layer

    def packed_product(self, flat: torch.Tensor) -> torch.Tensor:
        """`flat` [rows, in_features] times the packed weights (no bias), whatever the rows."""
        if self.bits == 4:
            return torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, GROUP,
                                                              self.scales)
        return torch.ops.aten._weight_int8pack_mm(flat, self.packed, self.scales)

    @staticmethod
    def fits(linear: torch.nn.Linear, bits: int) -> bool:
        """Whether the kernel takes this layer's shape (int4 packs columns by GROUP, rows by 8)."""
        return bits == 8 or (linear.in_features % GROUP == 0 and linear.out_features % 8 == 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.shape[0] > self.max_rows or x.dtype != self.weight.dtype:
            return onednn.linear(x, self.weight, self.dense_packed, self.bias)
        out = self.packed_product(flat.contiguous()).reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bits={self.bits}, max_rows={self.max_rows}")


@dataclass(frozen=True)
class QuantizeReport:
    """What `quantize_model` did: layers per bit width and the packed weights' bytes."""

    int4_layers: int
    int8_layers: int
    packed_bytes: int


def quantize_model(model: torch.nn.Module, mode: str,
                   max_rows: int = MAX_ROWS) -> QuantizeReport:
    """Replace the model's linear layers with PackedLinear in place (see the module docstring
    for which get 4 bits and which 8). `mode` is one of MODES."""
    if mode not in MODES:
        raise ValueError(f"quantize={mode!r}: expected one of {MODES}")
    counts = {4: 0, 8: 0}
    packed_bytes = 0
    if mode == "none":
        return QuantizeReport(0, 0, 0)
    head = model.get_output_embeddings()
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not torch.nn.Linear:
                continue
            bits = 4 if mode == "int4" and child is not head else 8
            if not PackedLinear.fits(child, bits):
                bits = 8
            layer = PackedLinear(child, bits, max_rows)
            setattr(parent, name, layer)
            counts[bits] += 1
            packed_bytes += layer.packed.numel() * layer.packed.element_size()
    return QuantizeReport(counts[4], counts[8], packed_bytes)
