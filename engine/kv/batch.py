"""The rolling batch's KV storage: sub-batches of left-padded rows, regrouped when membership
changes.

A sub-batch's slab has a window of columns in use, [start, end): every row's real tokens are the
rightmost ones of the window, and every decode step appends one column for all rows at once. So a
row's mask and position follow from its length alone, and a row moves between sub-batches knowing
only its length. A row that leaves is replaced by the slab's last row and the window narrows to
the longest row left; a newly prefilled row joins in place when the slab has a spare row and room
for its length. Only the rest is rebuilt into a fresh slab.
"""

from __future__ import annotations

import torch

from engine.kv.host_memory import pages_on_write
from engine.kv.slab_sizing import GROWTH_COLUMNS, RowOwner, claim_columns, reserved_slabs
from engine.kv.slabs import RowKV, SlabCache, SlabLayer, store_kv


class SubBatch:
    """Rows padded to one width that run one forward call per step."""

    def __init__(self, seqs: list[RowOwner], cache: SlabCache, width: int):
        self.seqs = seqs
        self.cache = cache
        self.width = width  # columns in use (at least the longest row's length)

    @property
    def size(self) -> int:
        return len(self.seqs)

    @property
    def row_capacity(self) -> int:
        return self.cache.layers[0].kbuf.shape[0]

    @property
    def end(self) -> int:
        """The slab column after the window (where the next decode step writes)."""
        return self.cache.layers[0].end

    def lengths(self) -> list[int]:
        return [s.kv_len for s in self.seqs]

    def padded_tokens(self) -> int:
        return sum(self.width - s.kv_len for s in self.seqs)

    def feeds(self) -> int:
        """Columns the next decode step writes: the most any row feeds."""
        return max((s.feeds for s in self.seqs), default=1)

    @property
    def cell_bytes(self) -> int:
        """Bytes of one row's KV at one column, over every layer."""
        return sum(la.kbuf[0, :, 0].nbytes + la.vbuf[0, :, 0].nbytes for la in self.cache.layers)

    def allocated_bytes(self) -> int:
        """Bytes of the slab's whole block: spare rows and reserved columns included."""
        return sum(layer.kbuf.nbytes + layer.vbuf.nbytes for layer in self.cache.layers)

    def claim_bytes(self) -> int:
        """Bytes its rows may come to need (`claim_columns`), without spare rows."""
        return self.size * claim_columns(self.seqs, self.width) * self.cell_bytes

    def row(self, i: int) -> RowKV:
        length = self.seqs[i].kv_len
        keys = [layer.kbuf[i, :, layer.end - length : layer.end] for layer in self.cache.layers]
        values = [layer.vbuf[i, :, layer.end - length : layer.end] for layer in self.cache.layers]
        return RowKV(keys, values, length)

    def kv_bytes(self) -> int:
        """Bytes the slab holds. On the CPU, those of its rows in use up to the window's end:
        columns reserved past it and spare rows take no memory until written (`headroom`).
        Elsewhere the whole allocation."""
        layers = self.cache.layers
        if not pages_on_write(layers[0].kbuf.device):
            return self.allocated_bytes()
        # Shapes multiplied out: two sliced views per layer every step cost more.
        return sum(layer.rows * buf.shape[1] * layer.end * buf.shape[3] * buf.element_size()
                   for layer in layers for buf in (layer.kbuf, layer.vbuf))

    def _lengths(self) -> torch.Tensor:
        return torch.tensor(self.lengths(), device=self.cache.layers[0].device)

    def decode_mask(self, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """[rows, width + 1] bool: the columns each row attends to when its pending token is fed
        (its real tokens are the rightmost ones, then the new column)."""
        lengths = self._lengths() if lengths is None else lengths
        cols = torch.arange(self.width + 1, device=lengths.device)
        return cols[None, :] >= (self.width - lengths)[:, None]

    def advance(self, fed: int = 1) -> None:
        """After a decode forward that wrote `fed` columns: every row gained one column, the first
        of them. The others (contrastive candidates' K/V) stay in the buffer past the window
        until `keep_slots` copies each row's chosen one into place."""
        self.width += 1
        if fed > 1:
            for layer in self.cache.layers:
                layer.end -= fed - 1
                layer._views()

    def keep_drafted(self, kept: int) -> None:
        """After `advance` of a speculative step: the rows also keep the first `kept` draft
        tokens' columns, which the forward wrote right after the first (every row alike, so
        the window stays right-aligned)."""
        if not kept:
            return
        self.width += kept
        for layer in self.cache.layers:
            layer.end += kept
            layer._views()
        for s in self.seqs:
            s.kv_len += kept

    def keep_slots(self, slots: list[int]) -> None:
        """Make each row's newest column hold the K/V of the `slots[i]`-th token it fed (its
        chosen contrastive candidate; 0 keeps what is there). Right after `advance`."""
        rows = [i for i, slot in enumerate(slots) if slot]
        if not rows:
            return
        device = self.cache.layers[0].device
        at = torch.tensor(rows, device=device)
        offset = torch.tensor([slots[i] for i in rows], device=device)
        for layer in self.cache.layers:
            col = layer.end - 1
            layer.kbuf[at, :, col] = layer.kbuf[at, :, col + offset]
            layer.vbuf[at, :, col] = layer.vbuf[at, :, col + offset]

    def commit(self, slots: list[int]) -> None:
        """End a decode step: keep each row's chosen fed token (`keep_slots`) and count the
        column it wrote in the row's length."""
        self.keep_slots(slots)
        for s in self.seqs:
            s.kv_len += 1

    def fits(self, columns: int) -> bool:
        """Whether a window of `columns` columns fits the block in place.

        The columns left of the window are dead (rows longer than any left have gone) and
        stay resident, so the window also moves once they outnumber its columns: a slab that
        reserves for every token to come would otherwise keep them for its whole life."""
        first = self.cache.layers[0]
        return first.start + columns <= first.capacity and \
            first.start <= max(columns, GROWTH_COLUMNS)

    def reserve(self, columns: int, most: int | None = None) -> None:
        """Make room for a window of `columns` columns in every layer, moving the slabs to a
        larger block (the window at its left edge, `headroom` to spare) when they do not fit
        (`fits`). Called before each decode forward. `most`: the bytes the new block may take
        (the KV budget's room; its spare rows go first where its rows' claim would not fit)."""
        if self.fits(columns):
            return
        first = self.cache.layers[0]
        rows = self.row_capacity
        if most is not None and \
                rows * claim_columns(self.seqs, self.width) * self.cell_bytes > most:
            rows = self.size
        self._move(rows, columns, first.capacity - first.start, most)

    def compact(self) -> None:
        """Move to a block of its rows alone and the columns they may come to need
        (`claim_bytes`), giving back spare rows and columns to the KV budget."""
        self._move(self.size, claim_columns(self.seqs, self.width), 0, self.claim_bytes())

    def _move(self, rows: int, columns: int, capacity: int, most: int | None) -> None:
        """Copy the rows in use and their window to a new block of `rows` rows and at least
        `columns` columns (`reserved_slabs`), within `most` bytes where that is not less."""
        layers = self.cache.layers

        def shapes(capacity: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
            return [((rows, la.kbuf.shape[1], capacity, la.kbuf.shape[-1]),
                     (rows, la.vbuf.shape[1], capacity, la.vbuf.shape[-1])) for la in layers]

        most_columns = None if most is None else max(columns, most // (rows * self.cell_bytes))
        slabs = reserved_slabs(layers[0].kbuf, self.seqs, columns, shapes, capacity,
                               most_columns)
        for layer, (k, v) in zip(layers, slabs):
            n, used = layer.rows, layer.end - layer.start
            k[:n, :, :used] = layer.kbuf[:n, :, layer.start : layer.end]
            v[:n, :, :used] = layer.vbuf[:n, :, layer.start : layer.end]
            layer.kbuf, layer.vbuf, layer.start, layer.end = k, v, 0, used
            layer._views()

    # -- membership changes in place ---------------------------------------------------------
    def can_take(self, staying: list[RowOwner], joining: list[RowKV]) -> bool:
        """Whether the rows `staying` plus `joining` fit this slab without moving it."""
        longest = max([s.kv_len for s in staying] + [r.length for r in joining])
        return len(staying) + len(joining) <= self.row_capacity and longest <= self.end

    def drop(self, leaving: set[RowOwner]) -> None:
        """Remove rows: each hole takes the slab's last row (one row copied), then the window
        narrows to the longest row left."""
        layers = self.cache.layers
        for i in sorted((i for i, s in enumerate(self.seqs) if s in leaving), reverse=True):
            last = len(self.seqs) - 1
            if i != last:
                for layer in layers:
                    layer.kbuf[i, :, layer.start : layer.end] = \
                        layer.kbuf[last, :, layer.start : layer.end]
                    layer.vbuf[i, :, layer.start : layer.end] = \
                        layer.vbuf[last, :, layer.start : layer.end]
                self.seqs[i] = self.seqs[last]
            self.seqs.pop()
        self.width = max((s.kv_len for s in self.seqs), default=0)
        for layer in layers:
            layer.rows, layer.start = len(self.seqs), layer.end - self.width
            layer._views()

    def add(self, seq: RowOwner, row: RowKV) -> None:
        """Write a new row into the next spare row (`can_take` must hold), widening the window
        to its length when it is longer than every row (the newly used padding is zeroed)."""
        layers = self.cache.layers
        i, end = len(self.seqs), self.end
        if row.length > self.width:
            for layer in layers:
                new_start = end - row.length
                layer.kbuf[:i, :, new_start : layer.start].zero_()
                layer.vbuf[:i, :, new_start : layer.start].zero_()
            self.width = row.length
        start = end - self.width
        for li, layer in enumerate(layers):
            layer.kbuf[i, :, start : end - row.length].zero_()
            layer.vbuf[i, :, start : end - row.length].zero_()
            store_kv(layer.kbuf[i, :, end - row.length : end], row.keys[li])
            store_kv(layer.vbuf[i, :, end - row.length : end], row.values[li])
            layer.rows, layer.start = i + 1, start
            layer._views()
        self.seqs.append(seq)


def build_sub_batch(seqs: list[RowOwner], sources: list[tuple[SubBatch, int] | RowKV],
                    most: int | None = None) -> SubBatch:
    """Write rows into a fresh left-padded slab, `headroom` wide beyond the longest row,
    with a quarter more rows (rounded down) for rows that join later. `most`: the bytes the
    slab may take (the KV budget's room): the spare rows only where the rows' claim
    (`claim_columns`) fits beside them, and no more columns than fit.

    A source is a row of an existing sub-batch, `(sub_batch, index)`, or a newly prefilled RowKV.
    Rows taken from one sub-batch move with one gather per layer: their real tokens all lie in
    that sub-batch's rightmost `width` columns, and its padding columns are zeros.
    """
    width = max(s.kv_len for s in seqs)
    moved: dict[SubBatch, tuple[list[int], list[int]]] = {}
    fresh: list[tuple[int, RowKV]] = []
    for dst, src in enumerate(sources):
        if isinstance(src, RowKV):
            fresh.append((dst, src))
        else:
            dsts, rows = moved.setdefault(src[0], ([], []))
            dsts.append(dst)
            rows.append(src[1])
    proto = fresh[0][1] if fresh else None
    rows = len(seqs) + len(seqs) // 4
    like = proto.keys[0] if proto is not None else next(iter(moved)).cache.layers[0].kbuf
    dims = []
    for li in range(_layer_count(sources)):
        if proto is not None:
            ref_k, ref_v = proto.keys[li], proto.values[li]
            heads, kdim, vdim = ref_k.shape[0], ref_k.shape[-1], ref_v.shape[-1]
        else:
            old = next(iter(moved)).cache.layers[li]
            ref_k = old.kbuf
            heads, kdim, vdim = ref_k.shape[1], ref_k.shape[-1], old.vbuf.shape[-1]
        dims.append((heads, kdim, vdim))

    def shapes(capacity: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        return [((rows, h, capacity, kd), (rows, h, capacity, vd)) for h, kd, vd in dims]

    most_columns = None
    if most is not None:
        cell = sum(h * (kd + vd) for h, kd, vd in dims) * like.element_size()
        if rows * claim_columns(seqs) * cell > most:
            rows = len(seqs)
        most_columns = max(width + max(s.feeds for s in seqs), most // (rows * cell))
    layers = []
    for li, (kbuf, vbuf) in enumerate(reserved_slabs(like, seqs, width, shapes,
                                                      most=most_columns)):
        # Padding must hold finite values (masked scores still multiply V): each row's columns
        # before what is copied into it are zeroed (not the whole window: a second pass over
        # hundreds of MiB when long rows regroup).
        for sb, (dsts, picked) in moved.items():
            w = min(sb.width, width)
            src = sb.cache.layers[li]
            idx = torch.tensor(picked, device=kbuf.device)
            at = torch.tensor(dsts, device=kbuf.device)
            kbuf[at, :, : width - w] = 0
            vbuf[at, :, : width - w] = 0
            kbuf[at, :, width - w : width] = src.kbuf[idx, :, src.end - w : src.end]
            vbuf[at, :, width - w : width] = src.vbuf[idx, :, src.end - w : src.end]
        for dst, row in fresh:
            kbuf[dst, :, : width - row.length].zero_()
            vbuf[dst, :, : width - row.length].zero_()
            store_kv(kbuf[dst, :, width - row.length : width], row.keys[li])
            store_kv(vbuf[dst, :, width - row.length : width], row.values[li])
        layers.append(SlabLayer(kbuf, vbuf, width, rows=len(seqs)))
    return SubBatch(list(seqs), SlabCache(layers), width)


def _layer_count(sources: list[tuple[SubBatch, int] | RowKV]) -> int:
    src = sources[0]
    return len(src.keys) if isinstance(src, RowKV) else len(src[0].cache.layers)
