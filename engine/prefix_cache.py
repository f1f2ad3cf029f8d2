"""System-prompt prefix KV, kept in an LRU bounded in bytes."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass
class PrefixEntry:
    """The KV (and, for contrastive search, last-layer hidden states) of one prompt prefix."""

    keys: list[torch.Tensor]  # per layer [heads, length, dim]
    values: list[torch.Tensor]
    hidden: torch.Tensor | None  # [length, hidden] or None when not computed
    length: int

    @property
    def nbytes(self) -> int:
        n = sum(t.nbytes for t in self.keys) + sum(t.nbytes for t in self.values)
        return n + (self.hidden.nbytes if self.hidden is not None else 0)


class PrefixCache:
    """Maps a prefix's token ids to its KV. Least recently used entries go first when over
    `capacity_bytes`.

    Entries are never mutated after insertion: users copy out of them (the batch writes rows into
    its own slabs), so one entry serves any number of concurrent jobs.
    """

    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[tuple[int, ...], PrefixEntry] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, prefix: tuple[int, ...], need_hidden: bool = False) -> PrefixEntry | None:
        with self._lock:
            entry = self._entries.get(prefix)
            if entry is None or (need_hidden and entry.hidden is None):
                self.misses += 1
                return None
            self._entries.move_to_end(prefix)
            self.hits += 1
            return entry

    def insert(self, prefix: tuple[int, ...], entry: PrefixEntry) -> bool:
        """Store `entry` (replacing one without hidden states); False if it can never fit."""
        size = entry.nbytes
        if size > self.capacity_bytes:
            return False
        with self._lock:
            old = self._entries.pop(prefix, None)
            if old is not None:
                self._bytes -= old.nbytes
            while self._entries and self._bytes + size > self.capacity_bytes:
                _, evicted = self._entries.popitem(last=False)
                self._bytes -= evicted.nbytes
                self.evictions += 1
            self._entries[prefix] = entry
            self._bytes += size
            return True

    def check_integrity(self) -> None:
        """Assert the byte count matches the entries and stays within capacity (run when idle, and
        in tests).
        """
        with self._lock:
            total = sum(e.nbytes for e in self._entries.values())
            assert total == self._bytes, (
                f"prefix cache counts {self._bytes} bytes, entries hold {total}"
            )
            assert self._bytes <= self.capacity_bytes, "prefix cache over capacity"
            for key, e in self._entries.items():
                assert e.length == len(key) and all(k.shape[-2] == e.length for k in e.keys)
