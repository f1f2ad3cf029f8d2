"""PrefixCache: an LRU bounded in bytes."""

from __future__ import annotations

import torch

from engine.prefix_cache import PrefixCache, PrefixEntry


def entry(length: int, layers: int = 2) -> PrefixEntry:
    kv = [torch.zeros(2, length, 4) for _ in range(layers)]
    return PrefixEntry(kv, [t.clone() for t in kv], None, length)


def test_lru_evicts_least_recent_within_byte_budget():
    one = entry(10).nbytes
    cache = PrefixCache(capacity_bytes=3 * one)
    keys = [tuple(range(i, i + 10)) for i in range(4)]
    for k in keys[:3]:
        assert cache.insert(k, entry(10))
    assert cache.lookup(keys[0]) is not None  # keys[0] is now the most recent
    cache.insert(keys[3], entry(10))
    assert cache.lookup(keys[1]) is None  # the least recently used went
    assert cache.lookup(keys[0]) is not None and cache.lookup(keys[3]) is not None
    assert cache.nbytes == 3 * one and cache.evictions == 1
    cache.check_integrity()


def test_entry_larger_than_capacity_is_not_stored():
    cache = PrefixCache(capacity_bytes=100)
    assert not cache.insert(tuple(range(10)), entry(10))
    assert len(cache) == 0 and cache.nbytes == 0


def test_lookup_needing_hidden_states_misses_without_them():
    cache = PrefixCache(capacity_bytes=10**6)
    key = tuple(range(10))
    cache.insert(key, entry(10))
    assert cache.lookup(key, need_hidden=True) is None
    assert cache.lookup(key) is not None
    assert (cache.hits, cache.misses) == (1, 1)
