"""int8 weights times int8 activations for forwards of many rows (`--quantize w8a8`).

A decode step at high concurrency, or a prompt chunk, multiplies many rows by every weight and
is bound by arithmetic, not by memory. An int8 product does about twice the multiply-adds per
instruction of a bf16 one (AVX512-VNNI's `vpdpbusd` against `vdpbf16ps`) and four times those of
fp32 FMA. Weights have one scale per output channel, activations one per token (row).

Two ways of computing it, chosen on the host:
- Where the native library is built: `csrc/int8_linear.cpp` quantises each row with its own
  scale in one pass, sums the products in int32 and scales the sums back in another. The sums
  come from oneDNN (`torch._int_mm`) where the CPU sums int8 products in int32 (VNNI or AMX);
  on other x86 CPUs (AVX2) from the library's own product, which widens both sides to int16
  and sums pairs of products in int32 (`vpmaddwd`), since oneDNN's u8 × s8 pairs in int16 would
  saturate on 8-bit weights. Weights keep all 8 bits; rows may be fp32 or bf16, so it serves
  the bf16 default of AVX512-BF16 CPUs.
- Else FBGEMM's dynamic product (`quantized::linear_dynamic`), fp32 rows only, with 7-bit weights
  (`quantize_weight` says why). FBGEMM quantises its input with one scale for the whole tensor,
  taken from its min and max; a row with large values would then take the resolution of every
  other row in the batch, and a sequence's tokens would depend on what it is batched with. So
  each row is first divided by its own largest magnitude (every row then spans about [-1, 1],
  and the tensor's one scale serves each row alike) and the product multiplied back by it:
  per-token scales through a per-tensor kernel, exact in real arithmetic because the product is
  linear in each row.

Forwards of fewer rows than `min_rows` keep the layer's exact path (the low-bit block kernel or
PyTorch's product), which is faster there and changes nothing: w8a8 is the approximation only
where it buys speed. `min_rows` is measured on the host at start, like the block kernel's row
limit, and cached with it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from engine.model.host_timing import best_of, cached, torch_threads

log = logging.getLogger("seqgate.engine")

# Row counts the int8 path is timed at against the exact path.
CANDIDATE_ROWS = (2, 4, 8, 12, 16, 24, 32, 48, 64)


def available() -> bool:
    """FBGEMM's int8 kernels are in this PyTorch build (x86 CPUs with AVX2 or later)."""
    return "fbgemm" in torch.backends.quantized.supported_engines


class Int8Weights(NamedTuple):
    """A layer's weights for the native product: [in, out] int8 (-127..127), and one fp32
    scale per output channel."""

    weight: torch.Tensor
    scales: torch.Tensor

    @classmethod
    def of(cls, weight: torch.Tensor) -> Int8Weights:
        w = weight.detach().float()
        scales = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
        q = torch.round(w / scales[:, None]).to(torch.int8)
        return cls(q.t().contiguous(), scales.contiguous())


def native_product(ops) -> str | None:
    """The native library's int8 product here ("onednn", "int16" or "aten":
    `int8_product_kind` in csrc/int8_linear.cpp, which tries ATen's product once on values
    where it would saturate), or None where it has none with exact int32 sums."""
    product = ops.int8_product_kind()
    return None if product == "none" else product


def quantize_weight(weight: torch.Tensor) -> torch.Tensor:
    """Symmetric 7-bit values (-63..63) in int8 with one scale per output channel, packed for
    FBGEMM: AVX2's u8 × s8 instruction sums pairs of products in int16, and 255 × 63 × 2 stays
    under its limit, so activations keep all 8 bits (halving the weights' resolution instead of
    the activations' moved the next-token distributions about a third as far: KL 0.040
    against 0.110 on 20 ShareGPT answers, docs/benchmarks/speed.md)."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 63).clamp(min=torch.finfo(torch.float32).tiny)
    q = torch.quantize_per_channel(w, scale.double(), torch.zeros(w.shape[0], dtype=torch.long),
                                   0, torch.qint8)
    return torch.ops.quantized.linear_prepack(q, None)


def int8_product(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """`x` [rows, in] (fp32) times the packed weights, activations quantised per row."""
    scale = x.abs().amax(dim=1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
    # Full 8-bit activations (reduce_range off): the weights' 7 bits keep the pair sums in int16.
    return torch.ops.quantized.linear_dynamic(x / scale, packed, False).mul_(scale)


class W8A8Linear(torch.nn.Module):
    """A linear layer that multiplies forwards of at least `min_rows` rows in int8 and the
    others through `exact` (the layer it replaced, still in the model's state). `ops`: the
    native library, whose `int8_linear` multiplies (fp32 or bf16 rows); None: FBGEMM (fp32)."""

    def __init__(self, exact: torch.nn.Module, min_rows: int, ops=None):
        super().__init__()
        self.exact = exact
        self.in_features, self.out_features = exact.in_features, exact.out_features
        self.ops = ops
        self.packed: torch.Tensor | Int8Weights | None = (
            quantize_weight(exact.weight) if ops is None else Int8Weights.of(exact.weight))
        self.min_rows = min_rows
        # The dtype its rows must have: FBGEMM's product takes fp32 alone.
        self.dtype = torch.float32 if ops is None else exact.weight.dtype

    @property
    def weight(self) -> torch.nn.Parameter:
        return self.exact.weight

    @property
    def bias(self) -> torch.nn.Parameter | None:
        return self.exact.bias

    def int8_forward(self, flat: torch.Tensor) -> torch.Tensor:
        if self.ops is not None:
            return self.ops.int8_linear(flat, self.packed.weight, self.packed.scales, self.bias)
        out = int8_product(flat, self.packed)
        return out if self.bias is None else out.add_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if (rows < self.min_rows or self.packed is None or x.dtype != self.dtype
                or x.device.type != "cpu"):
            return self.exact(x)
        flat = x.reshape(rows, self.in_features)
        return self.int8_forward(flat).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"min_rows={self.min_rows}"

    @classmethod
    def around(cls, exact: torch.nn.Module, like: W8A8Linear) -> W8A8Linear:
        """A W8A8Linear over `exact` (a stack of layers' exact paths) with `like`'s row limit
        and product."""
        return cls(exact, like.min_rows, like.ops)

    def drop_packed(self) -> None:
        """Free this layer's int8 weights where a stack of it serves them (the lean layers):
        it then computes on its exact path alone."""
        self.packed = None


@dataclass(frozen=True)
class W8A8Report:
    """What `install` did: how many layers, and the row count int8 starts at (with the
    timings it was chosen by)."""

    layers: int = 0
    min_rows: int = 0
    timings: dict | None = None
    product: str = ""  # the native library's (`native_product`) or "fbgemm"


def install(model: torch.nn.Module, cache: Path | None, code_key: str = "",
            threads: int | None = None, ops=None) -> W8A8Report:
    """Give the CPU linear layers of `model`'s decoder an int8 path (in place): fp32 and bf16
    ones through the native library's product where `ops` is given, else fp32 ones through
    FBGEMM. The output head keeps its exact products, since the logits are what sampling and
    log-probabilities read. `threads`: the engine thread's torch threads for timing (None:
    this thread's)."""
    head = model.get_output_embeddings()
    dtypes = (torch.float32,) if ops is None else (torch.float32, torch.bfloat16)
    made = []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            weight = getattr(child, "weight", None)
            if (child is head or isinstance(child, W8A8Linear) or not hasattr(child, "in_features")
                    or not isinstance(weight, torch.Tensor) or weight.dtype not in dtypes
                    or weight.device.type != "cpu" or weight.dim() != 2
                    or child._forward_hooks or child._forward_pre_hooks):
                continue
            made.append((parent, name, W8A8Linear(child, 0, ops)))
    if not made:
        return W8A8Report()
    layers = [layer for _, _, layer in made]
    with torch_threads(threads):
        min_rows, timings = _min_rows(layers, cache, code_key)
    for parent, name, layer in made:
        layer.min_rows = min_rows
        setattr(parent, name, layer)
    return W8A8Report(len(layers), min_rows, timings,
                      "fbgemm" if ops is None else ops.int8_product_kind())


def _min_rows(layers: list[W8A8Linear], cache: Path | None,
              code_key: str) -> tuple[int, dict | None]:
    """The measured row count (from the cache where this machine measured it before)."""
    path = None if cache is None else Path(cache) / "kernels" / "w8a8-rows.json"
    shapes = sorted({(type(b.exact).__name__, b.out_features, b.in_features) for b in layers})
    ops = layers[0].ops  # which product: oneDNN's and the int16 one share a build
    key = json.dumps([code_key, torch.__version__, torch.get_num_threads(), len(layers), shapes,
                      str(layers[0].dtype), ops.int8_product_kind() if ops else "fbgemm",
                      CANDIDATE_ROWS])

    def measure() -> dict:
        min_rows, timings = choose_min_rows(layers)
        return {"min_rows": min_rows, "timings": timings}

    entry = cached(path, key, measure)
    return entry["min_rows"], entry["timings"]


def choose_min_rows(layers: list[W8A8Linear], rows: tuple[int, ...] = CANDIDATE_ROWS
                    ) -> tuple[int, dict]:
    """The smallest candidate row count from which one pass over every layer is faster in int8
    than through the exact path at it and at every larger candidate, and the timings (ms, best
    of two) it was chosen by; past the last candidate int8 is assumed to keep winning (an
    arithmetic-bound product only gains from cheaper arithmetic). None winning: int8 is off
    (min_rows larger than any forward)."""
    timings: dict[str, list[float]] = {}
    wins: list[bool] = []
    with torch.no_grad():
        for n in rows:
            inputs = {b.in_features: torch.randn(n, b.in_features, dtype=b.dtype)
                      for b in layers}
            int8 = best_of(2, lambda x=inputs: [b.int8_forward(x[b.in_features]) for b in layers])
            exact = best_of(2, lambda x=inputs: [b.exact(x[b.in_features]) for b in layers])
            timings[str(n)] = [round(int8 * 1e3, 3), round(exact * 1e3, 3)]
            wins.append(int8 < exact)
    for i, n in enumerate(rows):
        if all(wins[i:]):
            return n, timings
    return NEVER, timings


# min_rows where int8 never pays on this host: larger than any forward.
NEVER = 1 << 62


@contextmanager
def exact_products(model: torch.nn.Module) -> Iterator[int]:
    """Within the block every W8A8Linear multiplies through its exact path (references in
    tests and checks); yields how many layers were switched."""
    saved = {m: m.min_rows for m in model.modules() if isinstance(m, W8A8Linear)}
    for m in saved:
        m.min_rows = NEVER
    try:
        yield len(saved)
    finally:
        for m, rows in saved.items():
            m.min_rows = rows
