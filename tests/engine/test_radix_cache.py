"""The radix prefix cache without a model: KV tensors whose entries encode the token they stand
for, so a match can be checked position by position."""

from __future__ import annotations

import random

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.kv.radix_cache import PrefixEntry, RadixPrefixCache, common_prefix

LAYERS, HEADS, DIM = 2, 1, 3


def kv_for(ids: list[int], hidden: bool = False) -> PrefixEntry:
    """KV where position j of every layer holds (token, layer, j): a prefix's KV depends only on
    its own tokens and positions, as a causal model's does."""
    def layer(i: int, sign: float) -> torch.Tensor:
        t = torch.tensor([[float(tok), float(i), float(j)] for j, tok in enumerate(ids)])
        return (sign * t)[None]  # [heads, len, dim]
    return PrefixEntry([layer(i, 1.0) for i in range(LAYERS)],
                       [layer(i, -1.0) for i in range(LAYERS)],
                       torch.tensor(ids, dtype=torch.float32)[:, None] if hidden else None,
                       len(ids))


def assert_entry_is(entry: PrefixEntry, ids: list[int]) -> None:
    want = kv_for(ids)
    assert entry.length == len(ids)
    for got, exp in zip(entry.keys + entry.values, want.keys + want.values):
        assert torch.equal(got, exp)


def test_the_longest_cached_prefix_wins_and_shared_heads_are_shared():
    cache = RadixPrefixCache(1 << 30)
    system = list(range(100, 140))
    turn1 = system + [1, 2, 3, 4]
    cache.insert(turn1, kv_for(turn1))
    other_system = list(range(100, 130)) + [7, 7, 7]  # shares 30 tokens of the head
    cache.insert(other_system, kv_for(other_system))
    turn2 = turn1 + [5, 6, 7, 8, 9]
    entry = cache.match(turn2, limit=len(turn2) - 1)
    assert_entry_is(entry, turn1)  # the whole first turn is reused
    assert_entry_is(cache.match(other_system + [1], limit=34), other_system)
    assert_entry_is(cache.match(list(range(100, 130)) + [8, 8], limit=32), list(range(100, 130)))
    assert cache.match([1, 2, 3], limit=3) is None
    assert (cache.hits, cache.misses, cache.reused_tokens) == (3, 1, len(turn1) + 33 + 30)
    # The shared head is stored once: 30 + (14) + (3) tokens' worth in three nodes.
    per_token = kv_for([0]).nbytes
    assert cache.nbytes == per_token * (len(turn1) + 3) and len(cache) == 3
    cache.check_integrity()


def storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_each_node_holds_its_kv_in_one_block_shared_with_nothing():
    cache = RadixPrefixCache(1 << 30)
    first, second = [1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 9]
    given_kv = kv_for(first)
    cache.insert(first, given_kv)
    cache.insert(second, kv_for(second))  # splits the first node after 3 tokens
    nodes = [cache._root.children[1], *cache._root.children[1].children.values()]
    assert len(nodes) == 3
    blocks = [{storage(t) for t in (*n.kv.keys, *n.kv.values)} for n in nodes]
    assert all(len(b) == 1 for b in blocks)  # every layer's keys and values: one allocation
    assert len(set().union(*blocks)) == 3
    assert storage(given_kv.keys[0]) not in set().union(*blocks)
    # A node's block is exactly its KV: the byte count is what the allocation holds.
    assert all(n.kv.keys[0].untyped_storage().nbytes() == n.nbytes for n in nodes)
    entry = cache.match(first, limit=6)
    assert_entry_is(entry, first)
    assert not {storage(t) for t in entry.keys} & set().union(*blocks)
    cache.check_integrity()


def test_min_tokens_and_limit():
    cache = RadixPrefixCache(1 << 30)
    cache.insert([1, 2, 3, 4], kv_for([1, 2, 3, 4]))
    assert cache.match([1, 2, 3, 4], limit=4, min_tokens=5) is None
    assert_entry_is(cache.match([1, 2, 3, 4], limit=3), [1, 2, 3])  # the last token is left


def test_hidden_states_are_matched_only_where_stored_and_filled_later():
    cache = RadixPrefixCache(1 << 30)
    cache.insert([1, 2, 3], kv_for([1, 2, 3]))
    assert cache.match([1, 2, 3, 4], limit=3, need_hidden=True) is None
    cache.insert([1, 2, 3, 4], kv_for([1, 2, 3, 4], hidden=True))
    entry = cache.match([1, 2, 3, 4, 5], limit=4, need_hidden=True)
    assert entry.length == 4 and entry.hidden[:, 0].tolist() == [1, 2, 3, 4]
    cache.check_integrity()


def test_least_recently_used_leaves_go_first_within_the_budget():
    per_token = kv_for([0]).nbytes
    cache = RadixPrefixCache(per_token * 9)
    cache.insert([1, 2, 3, 4], kv_for([1, 2, 3, 4]))
    cache.insert([1, 2, 5, 6], kv_for([1, 2, 5, 6]))  # splits: [1,2] → [3,4], [5,6]
    cache.match([1, 2, 3, 4, 0], limit=4)  # [3,4] is now newer than [5,6]
    cache.insert([9, 9, 9, 9], kv_for([9, 9, 9, 9]))  # 10 tokens > 9: [5,6] must go
    assert cache.evictions == 1 and cache.nbytes == per_token * 8
    assert cache.match([1, 2, 5, 6, 0], limit=4).length == 2
    assert cache.match([1, 2, 3, 4, 0], limit=4).length == 4
    cache.check_integrity()
    cache.insert(list(range(20, 29)), kv_for(list(range(20, 29))))  # fills it alone
    assert cache.match(list(range(20, 29)), limit=9).length == 9
    assert cache.nbytes <= per_token * 9
    cache.insert(list(range(40, 60)), kv_for(list(range(40, 60))))  # can never fit: skipped
    assert cache.match(list(range(40, 60)), limit=19) is None
    cache.check_integrity()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=12), min_size=1, max_size=12),
       st.integers(4, 40), st.integers(0, 2**16))
def test_matches_agree_with_brute_force(prompts, capacity_tokens, seed):
    """Whatever is inserted and evicted, a match is a prefix that some inserted prompt had, with
    exactly that prefix's KV, and the counts stay consistent."""
    cache = RadixPrefixCache(kv_for([0]).nbytes * capacity_tokens)
    rng = random.Random(seed)
    seen: list[list[int]] = []
    for p in prompts:
        if rng.random() < 0.5:
            cache.insert(p, kv_for(p))
            seen.append(p)
        entry = cache.match(p, limit=len(p))
        if entry is not None:
            assert any(s[: entry.length] == p[: entry.length] for s in seen)
            assert_entry_is(entry, p[: entry.length])
        cache.check_integrity()


@given(st.lists(st.integers(0, 3), max_size=12), st.lists(st.integers(0, 3), max_size=12),
       st.one_of(st.none(), st.integers(0, 14)))
def test_common_prefix_counts_the_shared_head(a, b, limit):
    want = 0
    while want < min(len(a), len(b)) and a[want] == b[want]:
        want += 1
    if limit is not None:
        want = min(want, limit)
    assert common_prefix(tuple(a), b, limit) == want
