"""Max-sparsity thresholding: split a batch into sub-batches to limit padding.

Sequences are sorted by length (longest first) and cut into contiguous groups; each group is
padded only to its own longest member. The sparsity of a partition is padding tokens divided by
real tokens (the seed's example: lengths [300, 50] in one group give 250 / 350 ≈ 0.7).

`partition_by_sparsity` picks the smallest number of groups k (up to ``max_splits``) whose
least-padding partition has sparsity <= ``max_sparsity``; if none qualifies it uses the largest
allowed k. The least-padding partition for every k comes from one dynamic programme, O(k·n²).

This module is pure Python (no torch) so that the scheduler and its tests can use it anywhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Partition", "min_padding_by_k", "padding", "partition_by_sparsity", "sparsity"]


def padding(lengths: Sequence[int], groups: Sequence[Sequence[int]]) -> int:
    """Padding tokens when each group (indices into ``lengths``) is padded to its longest member."""
    total = 0
    for group in groups:
        if group:
            longest = max(lengths[i] for i in group)
            total += sum(longest - lengths[i] for i in group)
    return total


def sparsity(lengths: Sequence[int], groups: Sequence[Sequence[int]]) -> float:
    """Padding tokens / real tokens of ``groups``; 0.0 when there are no real tokens."""
    real = sum(lengths[i] for group in groups for i in group)
    return padding(lengths, groups) / real if real > 0 else 0.0


@dataclass(frozen=True)
class Partition:
    """A split of a batch into sub-batches.

    ``groups`` holds indices into the caller's list of lengths; each group is ordered by length
    descending (ties by original index) and the groups are ordered longest-first.
    """

    groups: tuple[tuple[int, ...], ...]
    sparsity: float
    padded_tokens: int

    @property
    def k(self) -> int:
        """Number of groups (forward calls per step)."""
        return len(self.groups)


def _solve(sorted_lengths: Sequence[int], max_k: int) -> tuple[list[list[float]], list[list[int]]]:
    """Dynamic programme over lengths sorted descending.

    Returns ``(dp, cut)`` where ``dp[k][i]`` is the least padding of the first ``i`` items in
    exactly ``k`` non-empty contiguous groups (``inf`` if impossible) and ``cut[k][i]`` is where
    the last of those groups starts. Ties go to the smallest cut, i.e. the longest last group.
    """
    n = len(sorted_lengths)
    prefix = [0]
    for length in sorted_lengths:
        prefix.append(prefix[-1] + length)

    def cost(j: int, i: int) -> int:
        # Group sorted_lengths[j:i]; its longest member is the first one (descending order).
        return (i - j) * sorted_lengths[j] - (prefix[i] - prefix[j])

    inf = float("inf")
    dp = [[inf] * (n + 1) for _ in range(max_k + 1)]
    cut = [[0] * (n + 1) for _ in range(max_k + 1)]
    dp[0][0] = 0
    for k in range(1, max_k + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                candidate = dp[k - 1][j] + cost(j, i)
                if candidate < dp[k][i]:
                    dp[k][i], cut[k][i] = candidate, j
    return dp, cut


def _sorted_order(lengths: Sequence[int]) -> list[int]:
    """Indices of ``lengths`` by length descending; stable, so equal lengths keep input order."""
    return sorted(range(len(lengths)), key=lambda i: -lengths[i])


def min_padding_by_k(lengths: Sequence[int], max_k: int) -> list[int]:
    """Least padding over contiguous partitions into exactly k groups, for k = 1 … min(max_k, n).

    ``lengths`` may be in any order; they are sorted descending first. Element ``k - 1`` of the
    result is the optimum for ``k`` groups.
    """
    order = _sorted_order(lengths)
    sorted_lengths = [lengths[i] for i in order]
    n = len(sorted_lengths)
    max_k = min(max_k, n)
    dp, _ = _solve(sorted_lengths, max_k)
    return [int(dp[k][n]) for k in range(1, max_k + 1)]


def partition_by_sparsity(
    lengths: Sequence[int], max_sparsity: float, max_splits: int
) -> Partition:
    """Split ``lengths`` into the fewest groups whose sparsity is at most ``max_sparsity``.

    For k = 1 … min(max_splits, n) the least-padding contiguous partition of the sorted lengths is
    considered; the smallest k with sparsity <= ``max_sparsity`` wins, else k = min(max_splits, n).
    Among partitions with equal padding, the one whose last group starts earliest (recursively,
    backtracking from the end) is chosen. Raises ``ValueError`` on ``max_splits < 1``,
    ``max_sparsity < 0`` or a negative length.
    """
    if max_splits < 1:
        raise ValueError(f"max_splits must be >= 1, got {max_splits}")
    if not max_sparsity >= 0:
        raise ValueError(f"max_sparsity must be >= 0, got {max_sparsity}")
    if any(length < 0 for length in lengths):
        raise ValueError(f"lengths must be >= 0, got {list(lengths)}")
    n = len(lengths)
    if n == 0:
        return Partition(groups=(), sparsity=0.0, padded_tokens=0)

    order = _sorted_order(lengths)
    sorted_lengths = [lengths[i] for i in order]
    real = sum(sorted_lengths)
    max_k = min(max_splits, n)
    dp, cut = _solve(sorted_lengths, max_k)

    def ratio(pad: float) -> float:
        return pad / real if real > 0 else 0.0

    chosen = next((k for k in range(1, max_k + 1) if ratio(dp[k][n]) <= max_sparsity), max_k)

    bounds = []
    i = n
    for k in range(chosen, 0, -1):
        j = cut[k][i]
        bounds.append((j, i))
        i = j
    groups = tuple(tuple(order[j:i]) for j, i in reversed(bounds))
    pad = int(dp[chosen][n])
    return Partition(groups=groups, sparsity=ratio(pad), padded_tokens=pad)
