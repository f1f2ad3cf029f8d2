"""KV slabs: preallocated per-layer buffers that a sub-batch's rows (or a cached prefix) live in,
as a transformers Cache, and a row's KV as views of them."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, DynamicLayer

from engine.kv.host_memory import mapped_empty


def new_slabs(like: torch.Tensor, shapes: list[tuple[tuple[int, ...], tuple[int, ...]]]
              ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Uninitialised (keys, values) buffers of the given per-layer shapes.

    One allocation for the whole sub-batch where every layer has the same shapes (the usual
    case): a sub-batch's slabs are created and freed together, as one block in a memory mapping
    of its own (engine.kv.host_memory) instead of being carved out of the allocator's heap.
    Carved out of the heap, each regroup's slabs (a new size almost every time) left fragments
    behind that short-lived tensors could not fill, and resident memory crept up under load
    (docs/reliability.md).
    """
    kshape, vshape = shapes[0]
    if any(s != shapes[0] for s in shapes) or kshape != vshape:
        return [(like.new_empty(k), like.new_empty(v)) for k, v in shapes]
    block = mapped_empty((len(shapes), 2, *kshape), like)
    return [(block[i, 0], block[i, 1]) for i in range(len(shapes))]

class SlabLayer(DynamicLayer):
    """One layer's KV for a sub-batch: a preallocated [row capacity, heads, column capacity, dim]
    buffer whose first `rows` rows and columns [start, end) are in use."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, end: int, rows: int | None = None,
                 start: int = 0):
        super().__init__()
        self.kbuf, self.vbuf = keys, values
        self.start, self.end = start, end
        self.rows = keys.shape[0] if rows is None else rows
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True
        self._views()

    def _views(self) -> None:
        self.keys = self.kbuf[: self.rows, :, self.start : self.end]
        self.values = self.vbuf[: self.rows, :, self.start : self.end]

    @property
    def capacity(self) -> int:
        return self.kbuf.shape[-2]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        n = key_states.shape[-2]
        if self.end + n > self.capacity:
            raise RuntimeError(f"slab full ({self.end} + {n} > {self.capacity} columns): "
                               "SubBatch.reserve must run before the forward")
        store_kv(self.kbuf[: self.rows, :, self.end : self.end + n], key_states)
        store_kv(self.vbuf[: self.rows, :, self.end : self.end + n], value_states)
        self.end += n
        self._views()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.end - self.start

_FP16_MAX = torch.finfo(torch.float16).max


def store_kv(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy keys or values into a slab's columns. Into an fp16 slab under a wider model (a
    narrower KV cache, `kv_cache_dtype`) values past fp16's range saturate instead of becoming
    infinities, which would turn the attention over them to NaN."""
    dst.copy_(src)
    if dst.dtype == torch.float16 and src.dtype != torch.float16:
        # Clamped after the copy, in place: only values past fp16's largest finite one became
        # infinities, so this stores what clamping a wider temporary first did, without it.
        dst.clamp_(-_FP16_MAX, _FP16_MAX)


class SlabCache(Cache):
    """A transformers Cache over SlabLayers, one per model layer."""

    def __init__(self, layers: list[SlabLayer]):
        super().__init__(layers=layers)

def rewind(cache: Cache, length: int) -> None:
    """Undo what a failed forward wrote: every layer back to the `length` columns all held
    before it (the layers it reached had taken the step's columns, the others had not)."""
    for layer in cache.layers:
        extra = layer.get_seq_length() - length
        if extra <= 0:
            continue
        if isinstance(layer, SlabLayer):
            layer.end -= extra
            layer._views()
        else:
            layer.crop(-extra)


@dataclass
class RowKV:
    """A row's real KV, per layer: lists of [heads, length, dim] tensors (views, not copies)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    length: int

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
