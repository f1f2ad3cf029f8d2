"""Weights in llama.cpp's Q4_1 and Q8_0 blocks (32 input columns of one output row each, fp16
constants), or in 16 bits (bf16, fp16) where fp32 weights are such values: finding them exactly
in fp32 weights, rounding weights to the blocks, and the fp32 weights they hold. The kernels that
multiply by them are engine/kernels/csrc/lowbit_linear.cpp; the layers that use them,
engine.model.lowbit."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

BLOCK = 32  # input columns per block
TILE = 8  # output rows a q4x8 or q8x8 tile holds


@dataclass(frozen=True)
class Blocks:
    """A weight [out, in] in blocks: q (q4: [out, in / 2] uint8, two columns a byte; q8:
    [out, in] int8; bf16 / f16: [out, in] bfloat16 / float16), d and m ([out, in / 32] float16;
    m None for q8, both None for bf16 and f16). q4x8: q4's in tiles of 8 output rows
    (`tile_q4`), the same tensors' shapes; q8x8: q8's so (`tile_q8`), q as uint8."""

    kind: str
    q: torch.Tensor
    d: torch.Tensor | None
    m: torch.Tensor | None

    def dense(self) -> torch.Tensor:
        """The fp32 weights the blocks hold, rounded as the kernel rebuilds them."""
        if self.d is None:
            return self.q.float()
        if self.kind == "q4x8":
            return untile_q4(self).dense()
        if self.kind == "q8x8":
            return untile_q8(self).dense()
        d = self.d.float()[..., None]
        if self.kind == "q8":
            q = self.q.float().view(*self.d.shape, BLOCK)
            return (q * d).flatten(1)
        low, high = (self.q & 0x0F), (self.q >> 4)
        q = torch.cat([low.view(*self.d.shape, BLOCK // 2), high.view(*self.d.shape, BLOCK // 2)],
                      dim=-1).float()
        return (q * d + self.m.float()[..., None]).flatten(1)


def tile_q4(blocks: Blocks) -> Blocks | None:
    """Q4_1 blocks in tiles of 8 output rows, for the kernel that multiplies them by rows
    rounded to 8 bits (csrc/q8_rows.cpp): per tile and block, 4 vectors of 32 bytes, byte
    4k + c of vector h holding row k's column 4h + c in its low nibble and 16 + 4h + c in its
    high one; the 8 rows' scales (and mins) side by side. Tiles take whole rows of the tensors,
    so layers stack and split at multiples of 8. None where the rows are not a multiple of 8."""
    out, cols = blocks.q.shape[0], blocks.q.shape[1] * 2
    if blocks.kind != "q4" or out % TILE:
        return None
    nb = cols // BLOCK
    packed = blocks.q.view(out, nb, BLOCK // 2)
    values = torch.cat([packed & 0x0F, packed >> 4], -1)  # [out, blocks, 32] in column order
    v = _tiled(values)
    q = (v[:, :, :4] | (v[:, :, 4:] << 4)).reshape(out, cols // 2).contiguous()
    return Blocks("q4x8", q, _side_by_side(blocks.d), _side_by_side(blocks.m))


def untile_q4(blocks: Blocks) -> Blocks:
    """`tile_q4`'s blocks back in rows."""
    out, cols = blocks.q.shape[0], blocks.q.shape[1] * 2
    nb = cols // BLOCK
    p = blocks.q.view(out // TILE, nb, 4, TILE, 4)
    v = torch.cat([p & 0x0F, p >> 4], 2)  # [tile, block, group of 4 columns, row, column]
    values = v.permute(0, 3, 1, 2, 4).reshape(out, nb, BLOCK)
    q = (values[..., :BLOCK // 2] | (values[..., BLOCK // 2:] << 4)).reshape(out, cols // 2)
    return Blocks("q4", q.contiguous(), _in_rows(blocks.d), _in_rows(blocks.m))


def tile_q8(blocks: Blocks) -> Blocks | None:
    """Q8_0 blocks in tiles of 8 output rows for the same kernel: per tile and block, 8 vectors
    of 32 bytes, byte 4k + c of vector g holding row k's column 4g + c plus 128 (as uint8, so
    the kernel splits it into two nibbles it multiplies as unsigned bytes); the 8 rows' scales
    side by side. None where the rows are not a multiple of 8."""
    out, cols = blocks.q.shape
    if blocks.kind != "q8" or out % TILE:
        return None
    shifted = (blocks.q.to(torch.int16) + 128).to(torch.uint8)
    q = _tiled(shifted.view(out, cols // BLOCK, BLOCK)).reshape(out, cols)
    return Blocks("q8x8", q.contiguous(), _side_by_side(blocks.d), None)


def untile_q8(blocks: Blocks) -> Blocks:
    """`tile_q8`'s blocks back in rows."""
    out, cols = blocks.q.shape
    nb = cols // BLOCK
    values = blocks.q.view(out // TILE, nb, 8, TILE, 4).permute(0, 3, 1, 2, 4).reshape(out, cols)
    q = (values.to(torch.int16) - 128).to(torch.int8)
    return Blocks("q8", q.contiguous(), _in_rows(blocks.d), None)


def _tiled(values: torch.Tensor) -> torch.Tensor:
    """Per-block values [out, blocks, 32] in column order as [tile, block, group of 4 columns,
    row of the tile, column]: the tiles' byte order."""
    out, nb, _ = values.shape
    return values.view(out // TILE, TILE, nb, 8, 4).permute(0, 2, 3, 1, 4)


def _side_by_side(t: torch.Tensor) -> torch.Tensor:
    """Per-block constants [out, blocks] with each tile's 8 rows side by side per block."""
    out, nb = t.shape
    return t.view(out // TILE, TILE, nb).transpose(1, 2).reshape(out, nb).contiguous()


def _in_rows(t: torch.Tensor) -> torch.Tensor:
    """`_side_by_side`'s constants back in rows."""
    out, nb = t.shape
    return t.view(out // TILE, nb, TILE).transpose(1, 2).reshape(out, nb).contiguous()


def _q4(weight: torch.Tensor, exact: bool) -> Blocks | None:
    w = weight.detach().float()
    rows, cols = w.shape
    g = w.view(rows, cols // BLOCK, BLOCK)
    lo, hi = g.amin(-1), g.amax(-1)
    d, m = ((hi - lo) / 15).half(), lo.half()
    df, mf = d.float()[..., None], m.float()[..., None]
    q = torch.where(df > 0, (g - mf) / df.clamp(min=torch.finfo(torch.float32).tiny),
                    0).round().clamp(0, 15)
    if exact and not torch.equal(q * df + mf, g):
        return None
    q = q.to(torch.uint8)
    packed = (q[..., :BLOCK // 2] | (q[..., BLOCK // 2:] << 4)).reshape(rows, cols // 2)
    return Blocks("q4", packed.contiguous(), d.contiguous(), m.contiguous())


def _q8(weight: torch.Tensor, exact: bool) -> Blocks | None:
    w = weight.detach().float()
    rows, cols = w.shape
    g = w.view(rows, cols // BLOCK, BLOCK)
    d = (g.abs().amax(-1) / 127).half()
    df = d.float()[..., None]
    q = torch.where(df > 0, g / df.clamp(min=torch.finfo(torch.float32).tiny),
                    0).round().clamp(-128, 127)
    if exact and not torch.equal(q * df, g):
        return None
    return Blocks("q8", q.to(torch.int8).reshape(rows, cols).contiguous(), d.contiguous(), None)


def _h16(weight: torch.Tensor, dtype: torch.dtype) -> Blocks | None:
    w = weight.detach()
    half = w.to(dtype)
    if not torch.equal(half.float(), w):
        return None
    return Blocks("bf16" if dtype == torch.bfloat16 else "f16", half.contiguous(), None, None)


def exact_blocks(weight: torch.Tensor) -> Blocks | None:
    """Q4_1 or Q8_0 blocks holding exactly these fp32 weights, else their 16-bit values (bf16,
    then fp16) where they are such values; None where none does."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] % BLOCK:
        return None
    kinds = (functools.partial(_q4, exact=True), functools.partial(_q8, exact=True),
             functools.partial(_h16, dtype=torch.bfloat16),
             functools.partial(_h16, dtype=torch.float16))
    # Each kind is tried on a few rows first: weights that are no kind's (any model not from a
    # GGUF file) are then turned down without four passes over each layer, which took seconds
    # per engine for a 49152-row output head.
    for kind in kinds:
        if kind(weight[:8]) is not None and (blocks := kind(weight)) is not None:
            return blocks
    return None


def blocks_of_bf16(weight: torch.Tensor) -> Blocks | None:
    """Q4_1 or Q8_0 blocks whose fp32 weights round to exactly these bf16 ones; None where none
    do. A GGUF model loaded in bf16 gets its blocks back this way: the fp16 scales recomputed
    from the rounded values snap back to the file's (every layer of the embedded SmolLM2)."""
    if weight.dtype != torch.bfloat16 or weight.dim() != 2 or weight.shape[1] % BLOCK:
        return None
    for kind in ("q4", "q8"):
        blocks = rounded_blocks(weight.float(), kind)
        if blocks is not None and torch.equal(blocks.dense().to(torch.bfloat16), weight):
            return blocks
    return None


def rounded_blocks(weight: torch.Tensor, kind: str) -> Blocks | None:
    """The weights rounded to `kind` blocks; None where they do not fit (columns not a multiple
    of 32, or values beyond float16's range)."""
    if weight.dim() != 2 or weight.shape[1] % BLOCK or not torch.isfinite(weight).all():
        return None
    blocks = _q4(weight, exact=False) if kind == "q4" else _q8(weight, exact=False)
    ok = torch.isfinite(blocks.d).all() and (blocks.m is None or torch.isfinite(blocks.m).all())
    return blocks if ok else None
