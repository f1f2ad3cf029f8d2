"""Tests for engine.sched.partition (max-sparsity thresholding)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.sched.partition import (
    Partition,
    min_padding_by_k,
    padding,
    partition_by_sparsity,
    sparsity,
)

SEED_LENGTHS = [38, 33, 24, 22]


@pytest.mark.parametrize(
    ("max_sparsity", "expected_one_based"),
    [
        (0.01, [[1], [2], [3], [4]]),
        (0.025, [[1], [2], [3, 4]]),
        (0.1, [[1, 2], [3, 4]]),
        (0.9, [[1, 2, 3, 4]]),
    ],
)
def test_seed_demonstration(max_sparsity: float, expected_one_based: list[list[int]]) -> None:
    part = partition_by_sparsity(SEED_LENGTHS, max_sparsity=max_sparsity, max_splits=4)
    expected = tuple(tuple(i - 1 for i in group) for group in expected_one_based)
    assert part.groups == expected
    assert part.k == len(expected)
    assert part.sparsity <= max_sparsity
    assert part.padded_tokens == padding(SEED_LENGTHS, part.groups)


def test_seed_sparsity_example() -> None:
    assert padding([300, 50], [[0, 1]]) == 250
    assert sparsity([300, 50], [[0, 1]]) == pytest.approx(250 / 350)
    assert sparsity([300, 50], [[0, 1]]) == pytest.approx(0.714, abs=1e-3)

    part = partition_by_sparsity([300, 50], max_sparsity=0.33, max_splits=3)
    assert part.groups == ((0,), (1,))
    assert part.sparsity == 0.0
    assert part.padded_tokens == 0


def test_unsorted_input_keeps_original_indices() -> None:
    lengths = [22, 38, 24, 33]
    part = partition_by_sparsity(lengths, max_sparsity=0.1, max_splits=4)
    assert part.groups == ((1, 3), (2, 0))
    assert [[lengths[i] for i in g] for g in part.groups] == [[38, 33], [24, 22]]
    assert part.padded_tokens == 7
    assert part.sparsity == pytest.approx(7 / 117)


def test_equal_lengths_keep_input_order() -> None:
    part = partition_by_sparsity([5, 9, 5, 9], max_sparsity=0.0, max_splits=3)
    assert part.groups == ((1, 3), (0, 2))
    assert part.sparsity == 0.0


def test_no_qualifying_k_uses_max_splits() -> None:
    part = partition_by_sparsity([100, 90, 50, 10, 1], max_sparsity=0.0, max_splits=2)
    assert part.k == 2
    assert part.sparsity > 0.0


def test_max_splits_capped_by_n() -> None:
    part = partition_by_sparsity([7, 3], max_sparsity=0.0, max_splits=10)
    assert part.groups == ((0,), (1,))


def test_empty_input() -> None:
    part = partition_by_sparsity([], max_sparsity=0.33, max_splits=3)
    assert part == Partition(groups=(), sparsity=0.0, padded_tokens=0)
    assert part.k == 0
    assert sparsity([], []) == 0.0
    assert min_padding_by_k([], 3) == []


def test_zero_real_tokens() -> None:
    assert sparsity([0, 0], [[0, 1]]) == 0.0
    part = partition_by_sparsity([0, 0], max_sparsity=0.0, max_splits=2)
    assert part.k == 1
    assert part.sparsity == 0.0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_sparsity": 0.3, "max_splits": 0}, r"max_splits must be >= 1, got 0"),
        ({"max_sparsity": 0.3, "max_splits": -2}, r"max_splits must be >= 1, got -2"),
        ({"max_sparsity": -0.1, "max_splits": 3}, r"max_sparsity must be >= 0, got -0.1"),
        ({"max_sparsity": float("nan"), "max_splits": 3}, r"max_sparsity must be >= 0, got nan"),
    ],
)
def test_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        partition_by_sparsity([3, 2, 1], **kwargs)


def test_negative_length_rejected() -> None:
    with pytest.raises(ValueError, match="lengths must be >= 0"):
        partition_by_sparsity([3, -1], max_sparsity=0.3, max_splits=3)


# --- property test against brute force -------------------------------------------------------


def _brute_force_min_padding(sorted_lengths: list[int]) -> dict[int, int]:
    """Least padding for each k over every contiguous partition (all cut-point sets)."""
    n = len(sorted_lengths)
    best: dict[int, int] = {}
    for k in range(1, n + 1):
        for cuts in itertools.combinations(range(1, n), k - 1):
            bounds = (0, *cuts, n)
            pad = sum(
                sorted_lengths[a] * (b - a) - sum(sorted_lengths[a:b])
                for a, b in itertools.pairwise(bounds)
            )
            best[k] = min(best.get(k, pad), pad)
    return best


@settings(max_examples=300, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 200), min_size=1, max_size=8),
    max_splits=st.integers(1, 10),
    data=st.data(),
)
def test_matches_brute_force(lengths: list[int], max_splits: int, data: st.DataObject) -> None:
    n = len(lengths)
    order = sorted(range(n), key=lambda i: -lengths[i])
    sorted_lengths = [lengths[i] for i in order]
    real = sum(lengths)
    best = _brute_force_min_padding(sorted_lengths)

    # (a) the DP's least padding for each k equals the brute force's.
    assert min_padding_by_k(lengths, max_splits) == [
        best[k] for k in range(1, min(max_splits, n) + 1)
    ]

    # Thresholds: arbitrary ones, plus exactly the achievable sparsities (boundary ties).
    achievable = [best[k] / real for k in best]
    max_sparsity = data.draw(
        st.one_of(st.floats(0, 2, allow_nan=False), st.sampled_from(achievable)),
        label="max_sparsity",
    )
    part = partition_by_sparsity(lengths, max_sparsity=max_sparsity, max_splits=max_splits)

    # (b) the chosen k is the smallest qualifying one, else max_splits capped by n.
    max_k = min(max_splits, n)
    qualifying = [k for k in range(1, max_k + 1) if best[k] / real <= max_sparsity]
    assert part.k == (qualifying[0] if qualifying else max_k)
    assert part.padded_tokens == best[part.k]
    assert part.padded_tokens == padding(lengths, part.groups)
    assert part.sparsity == sparsity(lengths, part.groups)
    assert part.sparsity == pytest.approx(best[part.k] / real)

    # (c) every index exactly once; groups non-empty and contiguous in (stable) sorted order.
    assert all(part.groups)
    assert [i for group in part.groups for i in group] == order
    assert sorted(i for group in part.groups for i in group) == list(range(n))
