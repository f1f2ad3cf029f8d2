"""The rolling batch's KV storage: sub-batches of left-padded rows, regrouped when membership
changes.

Every row's real tokens are the rightmost `length` columns of its sub-batch (left padding): after a
prefill a row occupies [width - length, width), and every decode step appends one column for all
rows at once. So a row's mask and position follow from its length alone, and a row can be cut out
of one sub-batch and written into another without knowing anything but its length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import Cache, DynamicLayer

if TYPE_CHECKING:
    from engine.job import Sequence

# Columns allocated beyond the current width, so decode steps write in place instead of
# reallocating (DynamicCache's torch.cat copies the whole cache every step).
GROWTH_COLUMNS = 64


def new_slabs(like: torch.Tensor, shapes: list[tuple[tuple[int, ...], tuple[int, ...]]]
              ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Uninitialised (keys, values) buffers of the given per-layer shapes.

    One allocation for the whole sub-batch where every layer has the same shapes (the usual
    case): a sub-batch's slabs are created and freed together, and as one block of hundreds of
    MiB they are mapped and unmapped by the allocator instead of being carved out of its heap.
    Carved out of the heap, each regroup's slabs (a new size almost every time) left fragments
    behind that short-lived tensors could not fill, and resident memory crept up under load
    (docs/reliability.md).
    """
    kshape, vshape = shapes[0]
    if any(s != shapes[0] for s in shapes) or kshape != vshape:
        return [(like.new_empty(k), like.new_empty(v)) for k, v in shapes]
    block = like.new_empty((len(shapes), 2, *kshape))
    return [(block[i, 0], block[i, 1]) for i in range(len(shapes))]


class SlabLayer(DynamicLayer):
    """One layer's KV for a sub-batch: a preallocated [b, heads, capacity, dim] buffer, filled up
    to `length`.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int):
        super().__init__()
        self.kbuf, self.vbuf, self.length = keys, values, length
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True
        self._views()

    def _views(self) -> None:
        self.keys = self.kbuf[:, :, : self.length]
        self.values = self.vbuf[:, :, : self.length]

    @property
    def capacity(self) -> int:
        return self.kbuf.shape[-2]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        n = key_states.shape[-2]
        if self.length + n > self.capacity:
            raise RuntimeError(f"slab full ({self.length} + {n} > {self.capacity} columns): "
                               "SubBatch.reserve must run before the forward")
        self.kbuf[:, :, self.length : self.length + n] = key_states
        self.vbuf[:, :, self.length : self.length + n] = value_states
        self.length += n
        self._views()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length


class SlabCache(Cache):
    """A transformers Cache over SlabLayers, one per model layer."""

    def __init__(self, layers: list[SlabLayer]):
        super().__init__(layers=layers)


@dataclass
class RowKV:
    """A row's real KV, per layer: lists of [heads, length, dim] tensors (views, not copies)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    length: int


class SubBatch:
    """Rows padded to one width that run one forward call per step."""

    def __init__(self, seqs: list[Sequence], cache: SlabCache, width: int):
        self.seqs = seqs
        self.cache = cache
        self.width = width  # columns in use (the longest row's length)

    @property
    def size(self) -> int:
        return len(self.seqs)

    def lengths(self) -> list[int]:
        return [s.kv_len for s in self.seqs]

    def padded_tokens(self) -> int:
        return sum(self.width - s.kv_len for s in self.seqs)

    def row(self, i: int) -> RowKV:
        length = self.seqs[i].kv_len
        start = self.width - length
        keys = [layer.kbuf[i, :, start : self.width] for layer in self.cache.layers]
        values = [layer.vbuf[i, :, start : self.width] for layer in self.cache.layers]
        return RowKV(keys, values, length)

    def kv_bytes(self) -> int:
        return sum(layer.kbuf.nbytes + layer.vbuf.nbytes for layer in self.cache.layers)

    def _lengths(self) -> torch.Tensor:
        return torch.tensor(self.lengths(), device=self.cache.layers[0].device)

    def decode_mask(self, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """[rows, width + 1] bool: the columns each row attends to when its pending token is fed
        (its real tokens are the rightmost ones, then the new column)."""
        lengths = self._lengths() if lengths is None else lengths
        cols = torch.arange(self.width + 1, device=lengths.device)
        return cols[None, :] >= (self.width - lengths)[:, None]

    def decode_inputs(self) -> dict[str, torch.Tensor]:
        """input_ids, attention_mask and position_ids for feeding each row's pending token."""
        lengths = self._lengths()
        ids = torch.tensor([[s.pending_token] for s in self.seqs], device=lengths.device)
        return {"input_ids": ids, "attention_mask": self.decode_mask(lengths).long(),
                "position_ids": lengths[:, None]}

    def advance(self) -> None:
        """After a decode forward: every row gained one column."""
        self.width += 1

    def reserve(self, columns: int) -> None:
        """Make room for `columns` columns in every layer, moving the slabs to a larger block
        (with `GROWTH_COLUMNS` to spare) when they are full. Called before each decode forward."""
        layers = self.cache.layers
        if columns <= min(layer.capacity for layer in layers):
            return
        capacity = columns + GROWTH_COLUMNS
        shapes = [((*layer.kbuf.shape[:2], capacity, layer.kbuf.shape[-1]),
                   (*layer.vbuf.shape[:2], capacity, layer.vbuf.shape[-1])) for layer in layers]
        for layer, (k, v) in zip(layers, new_slabs(layers[0].kbuf, shapes)):
            k[:, :, : layer.length] = layer.kbuf[:, :, : layer.length]
            v[:, :, : layer.length] = layer.vbuf[:, :, : layer.length]
            layer.kbuf, layer.vbuf = k, v
            layer._views()


def build_sub_batch(seqs: list[Sequence], sources: list[tuple[SubBatch, int] | RowKV]) -> SubBatch:
    """Write rows into a fresh left-padded slab, `GROWTH_COLUMNS` wide beyond the longest row.

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
    shapes = []
    for li in range(_layer_count(sources)):
        if proto is not None:
            ref_k, ref_v = proto.keys[li], proto.values[li]
            heads, kdim, vdim = ref_k.shape[0], ref_k.shape[-1], ref_v.shape[-1]
        else:
            old = next(iter(moved)).cache.layers[li]
            ref_k = old.kbuf
            heads, kdim, vdim = ref_k.shape[1], ref_k.shape[-1], old.vbuf.shape[-1]
        shapes.append(((len(seqs), heads, width + GROWTH_COLUMNS, kdim),
                       (len(seqs), heads, width + GROWTH_COLUMNS, vdim)))
    like = proto.keys[0] if proto is not None else next(iter(moved)).cache.layers[0].kbuf
    layers = []
    for li, (kbuf, vbuf) in enumerate(new_slabs(like, shapes)):
        # Padding must hold finite values (masked scores still multiply V); zero the used window.
        kbuf[:, :, :width].zero_()
        vbuf[:, :, :width].zero_()
        for sb, (dsts, rows) in moved.items():
            w = min(sb.width, width)
            src = sb.cache.layers[li]
            idx = torch.tensor(rows, device=kbuf.device)
            at = torch.tensor(dsts, device=kbuf.device)
            kbuf[at, :, width - w : width] = src.kbuf[idx, :, sb.width - w : sb.width]
            vbuf[at, :, width - w : width] = src.vbuf[idx, :, sb.width - w : sb.width]
        for dst, row in fresh:
            kbuf[dst, :, width - row.length : width] = row.keys[li]
            vbuf[dst, :, width - row.length : width] = row.values[li]
        layers.append(SlabLayer(kbuf, vbuf, width))
    return SubBatch(list(seqs), SlabCache(layers), width)


def _layer_count(sources: list[tuple[SubBatch, int] | RowKV]) -> int:
    src = sources[0]
    return len(src.keys) if isinstance(src, RowKV) else len(src[0].cache.layers)


def row_from_cache(cache: Cache, index: int = 0, length: int | None = None) -> RowKV:
    """A row of a (prefill) DynamicCache as RowKV views; `length` keeps only the first columns."""
    keys, values = [], []
    for layer in cache.layers:
        k, v = layer.keys[index], layer.values[index]
        if length is not None:
            k, v = k[:, :length], v[:, :length]
        keys.append(k)
        values.append(v)
    return RowKV(keys, values, keys[0].shape[-2])


class RollingBatch:
    """The running rows' KV, as sub-batches. Regrouped to a new partition when membership changes.
    """

    def __init__(self) -> None:
        self.sub_batches: list[SubBatch] = []

    def kv_bytes(self) -> int:
        return sum(sb.kv_bytes() for sb in self.sub_batches)

    def padded_tokens(self) -> int:
        return sum(sb.padded_tokens() for sb in self.sub_batches)

    def regroup(self, groups: list[list[Sequence]], new_rows: dict[Sequence, RowKV]) -> None:
        """Lay the rows out as `groups`, reusing a sub-batch whose rows are exactly a group.

        Rows come from their current sub-batch or, for newly prefilled ones, from `new_rows`.
        Rows in no group are dropped.
        """
        where: dict[Sequence, tuple[SubBatch, int]] = {}
        by_members: dict[frozenset, SubBatch] = {}
        for sb in self.sub_batches:
            by_members[frozenset(sb.seqs)] = sb
            for i, s in enumerate(sb.seqs):
                where[s] = (sb, i)
        result = []
        for group in groups:
            kept = by_members.get(frozenset(group))
            if kept is not None:
                result.append(kept)
                continue
            rows = [new_rows[s] if s in new_rows else where[s] for s in group]
            result.append(build_sub_batch(group, rows))
        self.sub_batches = result
