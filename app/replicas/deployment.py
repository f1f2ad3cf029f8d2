"""EngineReplica: one engine (its own model copy, engine thread and prefix cache) as a Ray Serve
replica.

The gateway calls `generate(prompt_ids, params, grammar)` through a streaming deployment handle.
Its first item is `Admitted` (the replica's id) or the refusal (QueueFull, EngineStopped, and
KvBudgetExceeded: the KV budget is the replica's own), then the job's `JobDelta`s; anything
else raised reaches the gateway as Ray's task error (a 500).
The gateway has checked the job against the same limits (`validate_job`) before sending it.
When the gateway cancels the call (its client went away, its deadline passed), Ray cancels this
generator and the job is aborted here, on the replica that runs it. Grammars travel as their
`Grammar` (a compiled matcher does not pickle) and are compiled again here, from the replica's
own cache.

`record_routing_stats` is what the router and the gateway's /health and /metrics know of the
replica; Ray calls it every `request_routing_stats_period_s`. At shutdown Ray waits for open
calls (up to `graceful_shutdown_timeout_s`, the drain timeout), then the engine drains.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from ray import serve

from engine import (
    Engine,
    EngineConfig,
    EngineStopped,
    KvBudgetExceeded,
    QueueFull,
    SamplingParams,
)
from engine.kv.host_memory import freeze_startup_objects
from engine.sample.grammar import Grammar

log = logging.getLogger("seqgate.replicas")


@dataclass(frozen=True)
class Admitted:
    """The first item of a job's stream: the replica queued it."""

    replica: str


@dataclass(frozen=True)
class ModelInfo:
    """What the gateway needs of the model to prepare requests (tokenize, validate, compile
    grammars) without loading its weights."""

    name: str
    tokenizer: Any
    max_model_len: int
    vocab_size: int
    eos_ids: list[int]
    device: str
    dtype: str


class EngineReplica:
    """A Ray Serve replica owning one started engine."""

    def __init__(self, config: EngineConfig, drain_timeout: float):
        self.engine = Engine(config)
        self.engine.start()
        # The grammar compiler's view of the tokenizer is built now (0.3 s holding the GIL for
        # SmolLM2), before Ray marks the replica ready, not on its first constrained request.
        self.engine.grammars.compile(Grammar.json_object())
        freeze_startup_objects()  # full collections would otherwise walk the model's objects
        self.drain_timeout = drain_timeout
        self.replica = serve.get_replica_context().replica_id.unique_id
        self._load: dict[str, int] = {}  # open job id -> tokens it may still compute
        log.info("replica %s serving %s", self.replica, self.engine.model_name)

    def describe(self) -> ModelInfo:
        e = self.engine
        return ModelInfo(e.model_name, e.tokenizer, e.max_model_len, e.runner.vocab_size,
                         list(e.eos_ids), str(e.loaded.device),
                         str(e.loaded.dtype).removeprefix("torch."))

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       grammar: Grammar | None = None) -> AsyncIterator[Any]:
        if grammar is not None:
            compiled = await asyncio.to_thread(self.engine.grammars.compile, grammar)
            params = dataclasses.replace(params, grammar=compiled)
        try:
            handle = self.engine.submit(prompt_ids, params)
        # Refusals: the gateway answers 429, 503, or 400 for a job its KV budget cannot hold.
        except (QueueFull, EngineStopped, KvBudgetExceeded) as exc:
            yield exc
            return
        job = handle.job_id
        self._load[job] = len(prompt_ids) + params.max_new_tokens * params.n
        done = False
        try:
            yield Admitted(self.replica)
            async for delta in handle:
                self._load[job] = max(self._load[job] - len(delta.token_ids), 0)
                yield delta
            done = True
        finally:
            self._load.pop(job, None)
            if not done:  # cancelled by the gateway (client gone, deadline), or failed
                self.engine.abort(job)

    def record_routing_stats(self) -> dict[str, Any]:
        s = self.engine.stats()
        return {
            "status": "draining" if self.engine.draining else "ok",
            "queued": s.queued, "running": s.running,
            "queue_full": s.queued >= self.engine.config.job_queue_size,
            "load_tokens": sum(self._load.values()),
            "prompt_tokens": s.prompt_tokens, "generated_tokens": s.generated_tokens,
            "cached_tokens": s.cached_tokens, "cache_hits": s.cache_hits,
            "cache_misses": s.cache_misses, "steps": s.steps,
            "kv_budget_bytes": s.kv_budget_bytes,
            "out_of_memory_steps": s.out_of_memory_steps, "preemptions": s.preemptions,
            "spec_proposed_tokens": s.spec_proposed_tokens,
            "spec_accepted_tokens": s.spec_accepted_tokens,
            "prefix_cache_capacity_bytes": s.prefix_cache_capacity_bytes,
            "finished": {str(k): v for k, v in s.finished_by_reason.items()},
        }

    def check_health(self) -> None:
        if not self.engine.alive:
            raise RuntimeError(f"replica {self.replica}: the engine thread is not running")

    def __del__(self) -> None:
        # Ray has waited for the open calls; what is left (none, normally) ends with "abort".
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.stop(drain=True, timeout=self.drain_timeout)
