"""Linear layers over weights in 4- and 8-bit blocks (or 16-bit values), multiplied by our own
CPU kernels in forwards of few rows (engine/kernels/csrc/lowbit_linear.cpp), by PyTorch on fp32
weights in larger ones.

A decode step at low concurrency reads every weight once and is bound by memory bandwidth: on
an AVX2 CPU without native bf16 the engine runs fp32, and SmolLM2-135M's linear layers read
about 540 MB a token. The blocks are llama.cpp's Q4_1 (per 32 input columns a 4-bit q, w = q *
d + m, d and m fp16) and Q8_0 (8-bit q, w = q * d): about a fifth and a quarter of fp32's bytes.

A layer gets blocks in one of two ways:
- exactly, with nothing asked for: a model de-quantised from GGUF's Q4_1 or Q8_0 (the embedded
  SmolLM2 is Q4_1 with a Q8_0 embedding) holds fp32 weights that those blocks represent
  without loss, and `exact_blocks` finds them (or says a layer has none). The kernel rebuilds
  each weight in fp32 as the de-quantiser did, so the products use the fp32 model's very
  weights; only the order of each dot product's additions differs, as between any two matrix
  product implementations.
  A model published in bf16 or fp16 and loaded in fp32 holds weights that are such values:
  they are kept in those 16 bits (half fp32's bytes) and widened exactly in the kernel.
- by rounding (`quantize=int4` or `int8`, fp32 or bf16 models): the layers' weights are rounded
  to Q4_1 (the output head to Q8_0, as llama.cpp's files keep it) or to Q8_0. Larger forwards
  multiply the rounded weights in the model's dtype; the kernel also rounds each row to 8 bits
  per block of 32 columns and sums the products in integers (csrc/q8_rows.cpp), as llama.cpp
  does for these formats: about half the instructions per weight of rebuilding it in fp32, an
  approximation judged, as the rounding of the weights is, by the next-token distance from fp32
  (bench/studies/quality.py).

Which forwards go to the kernel is measured on the host (`choose_max_rows`): the kernel reads
fewer bytes but does more work per weight than a BLAS product, so past some row count the dense
product on the de-quantised weights (PyTorch's fp32 one, oneDNN's bf16 one) is faster. The
choice is cached per machine, kernel build, model shape and thread count.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.model import onednn
from engine.model.blocks import (
    Blocks,
    blocks_of_bf16,
    exact_blocks,
    rounded_blocks,
    tile_q4,
    tile_q8,
)
from engine.model.host_timing import best_of, cached, largest_win, torch_threads

log = logging.getLogger("seqgate.engine")

# Row counts the kernel is timed at against the dense product: decode rows and drafts, and
# prompt chunks up to a step's default token budget (256) and beyond.
CANDIDATE_ROWS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
# The row limit where the kernel won at the largest count timed: past a few dozen rows both
# products cost the same per row (the kernel takes the rows 64 at a time), so it serves every
# forward, a prompt of more than 512 tokens in one step too.
UNBOUNDED = 2**31 - 1


def beyond_timed(max_rows: int) -> int:
    """A timed row limit, UNBOUNDED where it is the largest candidate."""
    return UNBOUNDED if max_rows >= CANDIDATE_ROWS[-1] else max_rows


class BlockLinear(torch.nn.Module):
    """A linear layer whose fp32 or bf16 `weight` is also held in blocks: forwards of at most
    `max_rows` rows multiply through the kernel (in fp32), larger ones through `F.linear`, or
    oneDNN's product on `dense_packed` (bf16, engine.model.prepack)."""

    def __init__(self, linear: torch.nn.Linear, blocks: Blocks, ops, max_rows: int,
                 weight: torch.nn.Parameter | None = None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # Exact blocks share the layer's Parameter (a head tied to the embeddings stays tied);
        # rounded ones bring their own.
        self.weight = linear.weight if weight is None else weight
        self.bias = linear.bias
        self.kind = blocks.kind
        # Not in the state dict: the blocks are derived from `weight`, and the model's saved
        # state stays transformers' own.
        self.register_buffer("q", blocks.q, persistent=False)
        self.register_buffer("d", blocks.d, persistent=False)
        self.register_buffer("m", blocks.m, persistent=False)
        self.ops = ops
        self.max_rows = max_rows
        self.rounded = False  # True where `install` rounded the weights (quantize)
        # Rows rounded to 8 bits in the kernel (csrc/q8_rows.cpp), llama.cpp's arithmetic: only
        # for weights that were rounded already (`install` sets it with them).
        self.int8_rows = False
        self.dense_packed: torch.Tensor | None = None

    @classmethod
    def stacked(cls, parts: list[BlockLinear]) -> BlockLinear | None:
        """One layer computing `parts` side by side; the parts then read views of its weights
        and blocks (a block never spans two output rows, so rows stack exactly)."""
        first = parts[0]
        if any(p.kind != first.kind or p.in_features != first.in_features
               or p.int8_rows != first.int8_rows
               or (p.bias is None) != (first.bias is None) for p in parts):
            return None
        plain = torch.nn.Linear(first.in_features, sum(p.out_features for p in parts),
                                bias=first.bias is not None, device="meta")
        plain.weight = torch.nn.Parameter(torch.cat([p.weight for p in parts]),
                                          requires_grad=False)
        if first.bias is not None:
            plain.bias = torch.nn.Parameter(torch.cat([p.bias for p in parts]),
                                            requires_grad=False)
        def cat(name: str) -> torch.Tensor | None:
            return None if getattr(first, name) is None else torch.cat([getattr(p, name)
                                                                         for p in parts])

        blocks = Blocks(first.kind, cat("q"), cat("d"), cat("m"))
        layer = cls(plain, blocks, first.ops, first.max_rows)
        layer.rounded, layer.int8_rows = first.rounded, first.int8_rows
        sizes = [p.out_features for p in parts]

        def split(t: torch.Tensor | None) -> list:
            return [None] * len(parts) if t is None else t.split(sizes)

        for p, w, q, d, m in zip(parts, plain.weight.split(sizes), blocks.q.split(sizes),
                                 split(blocks.d), split(blocks.m)):
            p.weight = torch.nn.Parameter(w, requires_grad=False)
            p.q, p.d, p.m = q, d, m
        if first.dense_packed is not None:  # the stacked layer's copy serves; theirs would idle
            layer.dense_packed = onednn.pack(layer.weight)
            for p in parts:
                p.dense_packed = None
        return layer

    def kernel_product(self, flat: torch.Tensor) -> torch.Tensor:
        """`flat` [rows, in_features] (fp32 or bf16, rows contiguous) times the weights, no
        bias, computed in fp32 (the result in `flat`'s dtype)."""
        if self.kind == "q4x8":
            return self.ops.q4x8_q8_linear(flat, self.q, self.d, self.m)
        if self.kind == "q8x8":
            return self.ops.q8x8_q8_linear(flat, self.q, self.d)
        if self.int8_rows:
            return self.ops.q8_q8_linear(flat, self.q, self.d)
        if self.kind == "q4":
            return self.ops.q4_linear(flat, self.q, self.d, self.m)
        if self.kind == "q8":
            return self.ops.q8_linear(flat, self.q, self.d)
        return self.ops.h16_linear(flat, self.q)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.shape[0] > self.max_rows or x.dtype != self.weight.dtype or x.device.type != "cpu":
            return self.dense_product(x)
        out = self.kernel_product(flat.contiguous())  # bf16 rows: widened and rounded there
        out = out.view(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    def dense_product(self, x: torch.Tensor) -> torch.Tensor:
        return onednn.linear(x, self.weight, self.dense_packed, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"kind={self.kind}, max_rows={self.max_rows}")


@dataclass(frozen=True)
class LowbitReport:
    """What `install` did: layers per block kind, how they got their blocks, the blocks' bytes,
    and the row count the kernel serves up to (with the timings it was chosen by)."""

    q4_layers: int = 0
    q8_layers: int = 0
    mode: str = "off"  # off | exact | int4 | int8
    block_bytes: int = 0
    max_rows: int = 0
    timings: dict | None = None
    h16_layers: int = 0  # bf16 or fp16 values
    int8_rows: bool = False  # rows rounded to 8 bits in the kernel (int4 / int8)


def install(model: torch.nn.Module, ops, quantize: str, cache: Path | None,
            code_key: str = "", threads: int | None = None) -> LowbitReport:
    """Give the fp32 or bf16 CPU linear layers of `model` blocks (in place): exact ones where
    `quantize` is none, rounded ones for int4 (layers Q4_1, the output head Q8_0) and int8
    (all Q8_0). bf16 layers get exact blocks where their values are blocks' rounded to bf16
    (`blocks_of_bf16`), and a copy packed for oneDNN for larger forwards.
    Layers with hooks, or whose shape or values do not fit, stay as they are.
    The row limit is timed with `threads` torch threads (the engine thread's; None: this
    thread's)."""
    head = model.get_output_embeddings()
    made: list[tuple[torch.nn.Module, str, BlockLinear]] = []
    kept: list[BlockLinear] = []  # an earlier engine's over the same model
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is BlockLinear:
                kept.append(child)
                continue
            if type(child) is not torch.nn.Linear:
                continue
            bf16 = child.weight.dtype == torch.bfloat16
            if (not (child.weight.dtype == torch.float32 or bf16)
                    or child.weight.device.type != "cpu"
                    or child._forward_hooks or child._forward_pre_hooks):
                continue
            if quantize == "none":
                blocks = blocks_of_bf16(child.weight) if bf16 else exact_blocks(child.weight)
                weight = None
            else:
                kind = "q4" if quantize == "int4" and child is not head else "q8"
                blocks = rounded_blocks(child.weight.float(), kind)
                # A bf16 model's larger forwards multiply the rounded weights in bf16, as its
                # default path multiplies its own.
                weight = None if blocks is None else torch.nn.Parameter(
                    blocks.dense().to(child.weight.dtype), requires_grad=False)
                # Q4_1 and Q8_0 in tiles for the 8-bit rows' kernel; a layer whose rows do
                # not make whole tiles keeps the per-row kernels on its rounded weights.
                tiles = blocks is not None and (tile_q4 if kind == "q4" else tile_q8)(blocks)
                blocks = tiles or blocks
            if blocks is not None:
                layer = BlockLinear(child, blocks, ops, 0, weight)
                layer.rounded = weight is not None
                layer.int8_rows = layer.rounded and layer.kind != "q4"
                if bf16 and onednn.supported(layer.weight):  # timed against what serves
                    layer.dense_packed = onednn.pack(layer.weight)
                made.append((parent, name, layer))
    for parent, name, layer in made:
        setattr(parent, name, layer)
    layers = [*kept, *(layer for _, _, layer in made)]
    if not layers:
        return LowbitReport()
    with torch_threads(threads):
        max_rows, timings = _max_rows(layers, cache, code_key)
    for layer in layers:
        layer.ops, layer.max_rows = ops, max_rows
    return LowbitReport(
        sum(b.kind in ("q4", "q4x8") for b in layers),
        sum(b.kind in ("q8", "q8x8") for b in layers),
        quantize if any(b.rounded for b in layers) else "exact",
        sum(t.numel() * t.element_size() for b in layers for t in (b.q, b.d, b.m)
            if t is not None), max_rows, timings, sum(b.kind in ("bf16", "f16") for b in layers),
        any(b.int8_rows for b in layers))


def _signature(layers: list[BlockLinear], code_key: str) -> str:
    # int8_rows: the same blocks times rows in 8 bits run another kernel, timed on its own.
    shapes = sorted({(b.kind, b.out_features, b.in_features, str(b.weight.dtype), b.int8_rows)
                     for b in layers})
    return json.dumps([code_key, torch.get_num_threads(), len(layers), shapes, CANDIDATE_ROWS])


def timings_path(cache: Path | None) -> Path | None:
    """Where the row limits timed on this host are kept (None: nowhere)."""
    return None if cache is None else Path(cache) / "kernels" / "lowbit-rows.json"


def _max_rows(layers: list[BlockLinear], cache: Path | None,
              code_key: str) -> tuple[int, dict | None]:
    """The measured row count (from the cache where this machine measured it before)."""
    path = timings_path(cache)

    def measure() -> dict:
        max_rows, timings = choose_max_rows(layers)
        return {"max_rows": max_rows, "timings": timings}

    entry = cached(path, _signature(layers, code_key), measure)
    return beyond_timed(entry["max_rows"]), entry["timings"]


def choose_max_rows(layers: list[BlockLinear], rows: tuple[int, ...] = CANDIDATE_ROWS
                    ) -> tuple[int, dict]:
    """The largest row count at which one pass over every layer is faster through the kernel
    than through the product that serves larger forwards (PyTorch's fp32 one, or oneDNN's bf16
    one), and the timings (ms, best of two) it was chosen by.
    Every layer of the model takes part, so the weights come from memory as in a decode step;
    it stops after two row counts in a row where PyTorch wins."""
    inputs: dict[int, torch.Tensor] = {}

    def timed(n: int) -> tuple[float, float]:
        for layer in layers:
            if layer.in_features not in inputs or inputs[layer.in_features].shape[0] != n:
                inputs[layer.in_features] = torch.randn(n, layer.in_features,
                                                        dtype=layer.weight.dtype)
        return (best_of(2, lambda: [b.kernel_product(inputs[b.in_features]) for b in layers]),
                best_of(2, lambda: [b.dense_product(inputs[b.in_features]) for b in layers]))

    with torch.no_grad():
        return largest_win(rows, timed)


@contextmanager
def dense_products(model: torch.nn.Module) -> Iterator[int]:
    """Within the block every BlockLinear multiplies through its dense product (fp32 or bf16)
    (tests compare the engine against transformers on the model's own products); yields how
    many layers were switched."""
    saved = {m: m.max_rows for m in model.modules() if isinstance(m, BlockLinear)}
    for m in saved:
        m.max_rows = 0
    try:
        yield len(saved)
    finally:
        for m, rows in saved.items():
            m.max_rows = rows
