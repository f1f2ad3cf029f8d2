"""Which replica should take a job: the routing policy, as pure functions over plain data.

The router (router.py) keeps, per replica, an approximate picture of its prefix cache: the
chained hashes of the prompt blocks it has routed there (`PrefixIndex`), and its load: the
tokens of the jobs it has routed there that have not ended, or what the replica itself last
reported (queued + running tokens), whichever is larger. `rank_replicas` turns that into the
order in which Ray Serve should try them.

Prefix affinity works on the prompt's token ids in blocks of `block_tokens` (16, the engine's
smallest reused head), so two prompts share a block only when they share every token before it
(each block's hash covers the whole prefix up to it, as vLLM's block hashes do). A job goes to the
replica holding the longest run of its leading blocks, unless that replica's load exceeds the
least-loaded one's by more than `imbalance_tokens`; then, and for jobs with no cached head, it
goes to the least-loaded replica (SGLang's cache-aware router and SCLS's load balancing take the
same two steps). A job's cost counts only the tokens the chosen replica has not cached.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

POLICIES = ("prefix_affinity", "least_loaded", "round_robin")
BLOCK_TOKENS = 16
IMBALANCE_TOKENS = 4096
MAX_BLOCKS_PER_REPLICA = 200_000  # ~30 MB of hashes: far more than a replica's KV cache holds


def block_hashes(prompt_ids: Sequence[int], block_tokens: int = BLOCK_TOKENS) -> list[bytes]:
    """One hash per whole block of the prompt; each covers every token up to its block's end."""
    out: list[bytes] = []
    h = hashlib.blake2b(digest_size=16)
    for start in range(0, len(prompt_ids) - block_tokens + 1, block_tokens):
        h.update(array("I", prompt_ids[start:start + block_tokens]).tobytes())
        out.append(h.copy().digest())
    return out


class PrefixIndex:
    """The prompt blocks routed to each replica, least recently used dropped beyond a bound.

    It approximates each replica's prefix cache from the router's side: a replica may have
    evicted a block the index still holds (the job then pays a prefill, nothing worse)."""

    def __init__(self, max_blocks: int = MAX_BLOCKS_PER_REPLICA):
        self.max_blocks = max_blocks
        self._blocks: dict[str, OrderedDict[bytes, None]] = {}

    def matched_tokens(self, replica: str, hashes: Sequence[bytes],
                       block_tokens: int = BLOCK_TOKENS) -> int:
        """Tokens of the prompt's head whose blocks were routed to `replica`."""
        held = self._blocks.get(replica)
        if not held:
            return 0
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n * block_tokens

    def insert(self, replica: str, hashes: Sequence[bytes]) -> None:
        held = self._blocks.setdefault(replica, OrderedDict())
        for h in hashes:
            held[h] = None
            held.move_to_end(h)
        while len(held) > self.max_blocks:
            held.popitem(last=False)

    def replicas(self) -> set[str]:
        return set(self._blocks)

    def forget(self, replica: str) -> None:
        """The replica is gone (its cache with it)."""
        self._blocks.pop(replica, None)


@dataclass(frozen=True)
class ReplicaView:
    """What the policy knows of one replica when a job arrives."""

    replica: str
    load_tokens: int  # estimated queued + running tokens
    matched_tokens: int = 0  # the job's leading tokens this replica is believed to hold
    queue_full: bool = False  # its engine's wait queue was full when it last reported


def rank_replicas(views: Sequence[ReplicaView], policy: str,
                  imbalance_tokens: int = IMBALANCE_TOKENS,
                  turn: int = 0) -> list[list[str]]:
    """The order to try replicas in, one replica per rank (Ray Serve takes the first that
    accepts). Replicas whose queue is full come last: when every one is full, the job still goes
    to the least loaded, whose engine refuses it (HTTP 429). `turn` (one per job) rotates the
    round-robin order, which also breaks ties of load."""
    if policy not in POLICIES:
        raise ValueError(f"router policy {policy!r}: expected one of {', '.join(POLICIES)}")
    if not views:
        return []
    # Round-robin order; it also breaks ties of load, so an idle pool spreads its jobs.
    ordered = sorted(views, key=lambda v: v.replica)
    k = turn % len(ordered)
    ordered = ordered[k:] + ordered[:k]
    turn_of = {v.replica: i for i, v in enumerate(ordered)}
    by_load = sorted(views, key=lambda v: (v.queue_full, v.load_tokens, turn_of[v.replica]))
    if policy == "round_robin":
        by_load = ordered
    elif policy == "prefix_affinity":
        best = max(views, key=lambda v: (not v.queue_full, v.matched_tokens, -v.load_tokens))
        lightest = by_load[0]
        if best.matched_tokens > 0 and not best.queue_full and \
                best.load_tokens - lightest.load_tokens <= imbalance_tokens:
            by_load = [best] + [v for v in by_load if v is not best]
    return [[v.replica] for v in by_load]


def job_cost(prompt_tokens: int, matched_tokens: int, max_new_tokens: int) -> int:
    """Tokens a job adds to a replica's load: the prompt it must compute and what it may
    generate."""
    return max(prompt_tokens - matched_tokens, 1) + max_new_tokens
