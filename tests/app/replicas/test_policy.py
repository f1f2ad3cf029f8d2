"""The routing policy on its own: block hashes, the prefix index, the ranking."""

from __future__ import annotations

import pytest

from app.replicas.policy import (
    BLOCK_TOKENS,
    PrefixIndex,
    ReplicaView,
    block_hashes,
    job_cost,
    rank_replicas,
)


def test_a_block_hash_covers_the_whole_prefix_before_it():
    a = list(range(64))
    b = [999] + list(range(1, 64))  # differs in the first token only
    assert len(block_hashes(a)) == 64 // BLOCK_TOKENS
    assert block_hashes(a)[:2] == block_hashes(a + [1, 2, 3])[:2]
    assert not set(block_hashes(a)) & set(block_hashes(b))
    assert block_hashes(list(range(BLOCK_TOKENS - 1))) == []


def test_the_index_matches_the_leading_blocks_routed_to_a_replica():
    index = PrefixIndex()
    system = list(range(100, 100 + 4 * BLOCK_TOKENS))
    index.insert("r1", block_hashes(system + [1] * BLOCK_TOKENS))
    assert index.matched_tokens("r1", block_hashes(system + [2] * BLOCK_TOKENS)) == 4 * BLOCK_TOKENS
    assert index.matched_tokens("r2", block_hashes(system)) == 0
    index.forget("r1")
    assert index.matched_tokens("r1", block_hashes(system)) == 0


def test_the_index_drops_the_least_recently_used_blocks_beyond_its_bound():
    index = PrefixIndex(max_blocks=4)
    old, new = list(range(4 * BLOCK_TOKENS)), list(range(1000, 1000 + 4 * BLOCK_TOKENS))
    index.insert("r", block_hashes(old))
    index.insert("r", block_hashes(new))
    assert index.matched_tokens("r", block_hashes(old)) == 0
    assert index.matched_tokens("r", block_hashes(new)) == 4 * BLOCK_TOKENS


def ranks(views, policy="prefix_affinity", imbalance=1000, turn=0) -> list[str]:
    return [r[0] for r in rank_replicas(views, policy, imbalance, turn)]


def test_affinity_prefers_the_replica_holding_the_prompt_head():
    views = [ReplicaView("a", load_tokens=500), ReplicaView("b", 900, matched_tokens=400)]
    assert ranks(views) == ["b", "a"]


def test_affinity_gives_way_when_the_cached_replica_is_clearly_busier():
    views = [ReplicaView("a", load_tokens=0), ReplicaView("b", 1001, matched_tokens=400)]
    assert ranks(views) == ["a", "b"]


def test_a_full_queue_goes_last_even_with_the_prompt_cached():
    views = [ReplicaView("a", 5000), ReplicaView("b", 0, matched_tokens=400, queue_full=True)]
    assert ranks(views, imbalance=10_000) == ["a", "b"]
    assert ranks(views, "least_loaded") == ["a", "b"]


def test_least_loaded_orders_by_tokens_and_breaks_ties_in_turn():
    views = [ReplicaView("a", 300), ReplicaView("b", 100), ReplicaView("c", 200)]
    assert ranks(views, "least_loaded") == ["b", "c", "a"]
    idle = [ReplicaView("a", 0), ReplicaView("b", 0)]
    assert {ranks(idle, "least_loaded", turn=t)[0] for t in range(2)} == {"a", "b"}


def test_round_robin_ignores_load_and_cache():
    views = [ReplicaView("a", 0, matched_tokens=400), ReplicaView("b", 10_000)]
    assert [ranks(views, "round_robin", turn=t)[0] for t in range(4)] == ["a", "b", "a", "b"]


def test_an_unknown_policy_is_refused_by_name():
    with pytest.raises(ValueError, match="'nearest'.*prefix_affinity, least_loaded, round_robin"):
        rank_replicas([], "nearest")


def test_a_job_costs_what_the_replica_has_not_cached_plus_its_new_tokens():
    assert job_cost(420, 400, 16) == 36
    assert job_cost(420, 0, 16) == 436
