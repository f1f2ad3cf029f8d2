"""How many columns a KV slab takes: what its rows need now, what they may still generate, and
how the block is charged (the CPU's pages on first write, a device's memory at allocation).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import torch

from engine.kv.host_memory import pages_on_write
from engine.kv.slabs import new_slabs


class RowOwner(Protocol):
    """What the batch reads of a sequence that owns a row (engine.request.job.Sequence)."""

    kv_len: int  # tokens in the row's KV

    @property
    def tokens_left(self) -> int:
        """Tokens it may still generate (each one more column)."""

    @property
    def kv_reserved(self) -> int:
        """Tokens of KV it may come to hold (its job's reservation per row)."""

    @property
    def feeds(self) -> int:
        """Columns it writes at its next decode step (contrastive rows: their candidates)."""

# Columns allocated beyond the current width, so decode steps write in place instead of
# reallocating (DynamicCache's torch.cat copies the whole cache every step).
GROWTH_COLUMNS = 64
# On the CPU a slab also reserves columns for all its rows may still generate (at most this
# many): its block is a mapping whose pages the kernel supplies when first written
# (engine.kv.host_memory), so columns never written cost address space, not memory, and decode
# steps never move the slab (a move is the longest step a running stream sees).
MAX_RESERVED_COLUMNS = 4096
# Where memory is taken at allocation (a device's, or the CPU's under strict overcommit
# accounting) a slab reserves what its rows may still generate only up to this many columns at
# once, and past that doubles when full: a move copies the whole slab while holding both
# copies, and with GROWTH_COLUMNS alone it came every 64 decode steps.
CHARGED_RESERVED_COLUMNS = 1024


def slab_columns(capacity: int, needed: int, left: int, lazy: bool) -> int:
    """The column capacity of a slab (re)allocated for a window of `needed` columns, when the
    window has `capacity` columns in the current block (0 for a new slab), its rows may still
    generate at most `left` tokens (each one more column), and its block takes memory only
    where written (`lazy`, `pages_on_write`: the CPU) or is charged whole (a device).

    Lazy: `needed` plus GROWTH_COLUMNS plus `left` up to MAX_RESERVED_COLUMNS. Charged: the
    same up to CHARGED_RESERVED_COLUMNS, and at least double `capacity` when the window outgrew
    it (so n decode steps move a slab O(log n) times), never past what the rows may still write
    (a row's tokens left are bounded by the context length, checked at submission).
    """
    left = max(left, 0)
    if lazy:
        return needed + GROWTH_COLUMNS + min(left, MAX_RESERVED_COLUMNS)
    reserved = needed + GROWTH_COLUMNS + min(left, CHARGED_RESERVED_COLUMNS)
    doubled = 2 * capacity if needed > capacity else capacity
    return min(max(reserved, doubled), needed + GROWTH_COLUMNS + left)


def tokens_left(seqs: list[RowOwner]) -> int:
    """The most tokens any of `seqs` may still generate."""
    return max((s.tokens_left for s in seqs), default=0)


def headroom(seqs: list[RowOwner], device: torch.device, needed: int, capacity: int = 0) -> int:
    """Columns a slab of `seqs` on `device` allocates beyond the `needed` its window fills, when
    the block fits (`slab_columns`; `capacity`: the window's columns in the current block)."""
    lazy = pages_on_write(device)
    return slab_columns(capacity, needed, tokens_left(seqs), lazy) - needed


def claim_columns(seqs: list[RowOwner], width: int = 0) -> int:
    """Columns a slab of `seqs` may come to need: the longest reservation among them, and at
    least its window (`width`, or the longest row) and the columns the next step writes."""
    window = max(width, max(s.kv_len for s in seqs))
    return max(max(s.kv_reserved for s in seqs), window + max(s.feeds for s in seqs))


def reserved_slabs(like: torch.Tensor, seqs: list[RowOwner], width: int,
                   shapes: Callable[[int], list[tuple[tuple[int, ...], tuple[int, ...]]]],
                   capacity: int = 0, most: int | None = None
                   ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`new_slabs` of `shapes(columns)` for `width` columns and the `headroom` of `seqs`, at
    most `most` columns (what the KV budget leaves; at least `width`). Where that does not fit,
    the reservation of a block charged whole (the CPU under strict overcommit accounting or a
    virtual memory limit), then only GROWTH_COLUMNS beyond (memory running out).
    """
    least = width + GROWTH_COLUMNS if most is None else min(width + GROWTH_COLUMNS, most)
    failed = math.inf
    for columns in (width + headroom(seqs, like.device, width, capacity),
                    slab_columns(capacity, width, tokens_left(seqs), lazy=False)):
        columns = columns if most is None else min(columns, most)
        if least < columns < failed:
            try:
                return new_slabs(like, shapes(columns))
            except (OSError, torch.OutOfMemoryError):
                failed = columns
    return new_slabs(like, shapes(least))
