"""What the gateway knows of each engine replica: its last report and this gateway's routing.

Written by the request router (router.py), read by /health and /metrics (metrics.py,
RemoteEngine.stats). Its own module because Ray ships the router's module by value.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ReplicaRecord:
    """One replica as the gateway sees it."""

    stats: dict[str, Any] = field(default_factory=dict)  # its last record_routing_stats
    routed: int = 0  # requests routed to it by this gateway
    routed_tokens_in_flight: int = 0  # cost of this gateway's jobs there that have not completed


class ReplicaBoard:
    """The replicas the router currently sees, shared with the gateway's /health and /metrics
    (the router runs on the handle's event loop, the gateway on its own: hence the lock)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._replicas: dict[str, ReplicaRecord] = {}

    def update(self, stats: dict[str, dict[str, Any]]) -> None:
        with self._lock:
            for gone in set(self._replicas) - set(stats):
                del self._replicas[gone]
            for rid, s in stats.items():
                self._replicas.setdefault(rid, ReplicaRecord()).stats = dict(s)

    def routed(self, replica: str, cost: int) -> None:
        with self._lock:
            rec = self._replicas.setdefault(replica, ReplicaRecord())
            rec.routed += 1
            rec.routed_tokens_in_flight += cost

    def completed(self, replica: str, cost: int) -> None:
        with self._lock:
            if (rec := self._replicas.get(replica)) is not None:
                rec.routed_tokens_in_flight = max(rec.routed_tokens_in_flight - cost, 0)

    def snapshot(self) -> dict[str, ReplicaRecord]:
        with self._lock:
            return {rid: ReplicaRecord(dict(r.stats), r.routed, r.routed_tokens_in_flight)
                    for rid, r in self._replicas.items()}


REPLICA_BOARD = ReplicaBoard()
