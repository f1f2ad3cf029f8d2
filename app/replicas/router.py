"""SeqgateRouter: Ray Serve's request router for the engine replicas (its extension point:
`request_router_config.request_router_class`).

It runs in the gateway process, inside the deployment handle that RemoteEngine calls. A job's
arguments are `(prompt_ids, params, grammar)`, so the router sees the prompt's token ids; the
decision itself is `policy.rank_replicas`. Load per replica is the larger of two estimates: the
tokens of jobs this router has sent there that have not completed (exact and immediate for
this gateway), and what the replica last reported through `record_routing_stats` (queued +
running tokens, every `request_routing_stats_period_s`; it also counts other gateways' jobs).

What the router learns of each replica goes on `board.REPLICA_BOARD`, which the gateway reads
for /health and /metrics. Ray pickles this module by value when it ships the router class, so
module-level state here would be a copy: the board lives in its own module, reached as
`board.REPLICA_BOARD` (a module reference pickles by name).
"""

from __future__ import annotations

import itertools
import logging
from typing import Any

from ray.serve.request_router import (
    FIFOMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from app.replicas import board
from app.replicas.policy import (
    BLOCK_TOKENS,
    IMBALANCE_TOKENS,
    PrefixIndex,
    ReplicaView,
    block_hashes,
    job_cost,
    rank_replicas,
)

log = logging.getLogger("seqgate.replicas.router")


class SeqgateRouter(FIFOMixin, RequestRouter):
    """Prefix-cache affinity balanced by load (`policy="prefix_affinity"`), least-loaded
    (`"least_loaded"`) or round-robin (`"round_robin"`), over the engine replicas."""

    def initialize_state(self, policy: str = "prefix_affinity",
                         imbalance_tokens: int = IMBALANCE_TOKENS,
                         block_tokens: int = BLOCK_TOKENS, **_: Any) -> None:
        rank_replicas([], policy)  # an unknown policy fails here, at the first request
        self.policy = policy
        self.imbalance_tokens = imbalance_tokens
        self.block_tokens = block_tokens
        self.index = PrefixIndex()
        self._turn = itertools.count()
        # internal request id -> (replica it was sent to, its cost there)
        self._in_flight: dict[str, tuple[str, int]] = {}
        log.info("request router: %s (imbalance %d tokens)", policy, imbalance_tokens)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id.unique_id for r in replicas}
        for rid in self.index.replicas() - live:
            self.index.forget(rid)
        board.REPLICA_BOARD.update({r.replica_id.unique_id: r.routing_stats or {}
                                    for r in replicas})

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.index.forget(replica_id.unique_id)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None,
                              ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        prompt_ids, max_new = _job_of(pending_request)
        hashes = block_hashes(prompt_ids, self.block_tokens) if self.policy == \
            "prefix_affinity" else []
        seen = board.REPLICA_BOARD.snapshot()
        views = []
        for r in candidate_replicas:
            rid = r.replica_id.unique_id
            rec = seen.get(rid) or board.ReplicaRecord()
            stats = r.routing_stats or {}
            views.append(ReplicaView(
                rid,
                load_tokens=max(rec.routed_tokens_in_flight, int(stats.get("load_tokens", 0))),
                matched_tokens=self.index.matched_tokens(rid, hashes, self.block_tokens),
                queue_full=bool(stats.get("queue_full", False))))
        ranks = rank_replicas(views, self.policy, self.imbalance_tokens, next(self._turn))
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        if pending_request is not None and ranks:
            chosen = ranks[0][0]
            matched = next(v.matched_tokens for v in views if v.replica == chosen)
            self._account(pending_request.metadata.internal_request_id, chosen,
                          job_cost(len(prompt_ids), matched, max_new))
            self.index.insert(chosen, hashes)
        return [[by_id[rid] for rid in rank] for rank in ranks]

    def _account(self, request_id: str, replica: str, cost: int) -> None:
        # A retried request is chosen again: its earlier charge moves to the new choice.
        if (earlier := self._in_flight.pop(request_id, None)) is not None:
            board.REPLICA_BOARD.completed(*earlier)
        self._in_flight[request_id] = (replica, cost)
        board.REPLICA_BOARD.routed(replica, cost)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if (charge := self._in_flight.pop(internal_request_id, None)) is not None:
            board.REPLICA_BOARD.completed(*charge)


def _job_of(pending: PendingRequest | None) -> tuple[list[int], int]:
    """The prompt's token ids and max_new_tokens of a call to EngineReplica.generate."""
    if pending is None or len(pending.args) < 2:
        return [], 0
    prompt_ids, params = pending.args[0], pending.args[1]
    return list(prompt_ids), int(getattr(params, "max_new_tokens", 0))
