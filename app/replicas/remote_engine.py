"""RemoteEngine: the gateway's engine when the engines are Ray Serve replicas.

It implements the engine-client contract (`engine.EngineClient`: submit / abort / stats / stop,
the tokenizer, the limits and the grammar compiler) as the local `Engine` does, so the
controllers, adapters and streaming code run unchanged. A job is
checked here against the replicas' limits (`validate_job`: a 400 comes from the gateway), sent
through the deployment handle (our router picks the replica), and its handle yields the replica's
deltas. Aborting a job cancels its call: Ray cancels the generator on the replica that runs it,
which aborts the engine job there.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.serve.exceptions import RequestCancelledError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from app.replicas.board import REPLICA_BOARD
from app.replicas.deployment import Admitted, ModelInfo
from engine import (
    EngineConfig,
    EngineStats,
    EngineStopped,
    EngineUnavailable,
    JobDelta,
    SamplingParams,
)
from engine.request.sampling_params import validate_job
from engine.sample.grammar import GrammarCompiler

log = logging.getLogger("seqgate.replicas")

_REPLICA_GONE = (ActorDiedError, ActorUnavailableError, RayActorError)
# Counters summed over the replicas' reports into the gateway's seqgate_* engine metrics.
_SUMMED = ("queued", "running", "steps", "prompt_tokens", "generated_tokens", "cached_tokens",
           "cache_hits", "cache_misses", "kv_budget_bytes", "prefix_cache_capacity_bytes",
           "out_of_memory_steps", "preemptions", "spec_proposed_tokens", "spec_accepted_tokens")


@dataclass(frozen=True)
class ReplicaModel:
    """Where the replicas' model runs, for /version (the gateway holds no weights)."""

    device: str
    dtype: str


class RemoteJobHandle:
    """A job running on a replica: its first item says whether it was queued, then its deltas.

    A replica that dies mid-job ends the job with an error delta naming it, so the client gets
    a clear error (a 5xx, or an error event on a stream) and nothing waits forever."""

    def __init__(self, job_id: str, response: DeploymentResponseGenerator,
                 on_end: Callable[[str], None]):
        self.job_id = job_id
        self.replica: str | None = None
        self._response = response
        self._on_end = on_end

    async def accepted(self) -> None:
        try:
            first = await self._response.__anext__()
        except _REPLICA_GONE as exc:
            self._on_end(self.job_id)
            raise EngineUnavailable(f"the engine replica died before taking the job ({exc}); "
                                    "retry") from None
        except BaseException:
            self._on_end(self.job_id)
            raise
        if isinstance(first, Exception):  # the replica refused it (queue full, stopping)
            self._on_end(self.job_id)
            raise first
        assert isinstance(first, Admitted), first
        self.replica = first.replica

    async def __aiter__(self) -> AsyncIterator[JobDelta]:
        try:
            async for delta in self._response:
                yield delta
        except _REPLICA_GONE as exc:
            log.warning("replica %s died while running %s: %s", self.replica, self.job_id, exc)
            yield JobDelta(self.job_id, 0, [], "", finish_reason="error",
                           error=f"the engine replica {self.replica} died while running this "
                                 "request; Ray restarts it, retry the request")
        except RequestCancelledError:
            return
        finally:
            self._on_end(self.job_id)

    def cancel(self) -> None:
        self._response.cancel()


class RemoteEngine:
    """The engine API over a Ray Serve deployment of EngineReplica (see module docstring)."""

    def __init__(self, config: EngineConfig, handle: DeploymentHandle, info: ModelInfo,
                 on_stop: Callable[[], None] | None = None):
        self.config = config
        self._handle = handle.options(stream=True, method_name="generate")
        self.info = info
        self.tokenizer = info.tokenizer
        self.model_name = info.name
        self.max_model_len = info.max_model_len
        self.eos_ids = list(info.eos_ids)
        self.loaded = ReplicaModel(info.device, info.dtype)
        # Grammars are compiled here to refuse a bad one with a 400 before it travels; the
        # replica compiles its own copy (a compiled matcher does not pickle).
        self.grammars = GrammarCompiler(info.tokenizer, info.vocab_size, self.eos_ids)
        self.draining = False
        self._open: dict[str, RemoteJobHandle] = {}
        self._lock = threading.Lock()
        self._on_stop = on_stop
        self._stopped = False

    def start(self, background: bool = True) -> None:
        """The replicas run their engines; nothing to start here."""

    def add_step_listener(self, fn: Callable) -> None:
        """Per-step figures stay with each replica (their step histograms are not collected)."""

    @property
    def alive(self) -> bool:
        return not self._stopped

    def submit(self, prompt_ids: list[int], params: SamplingParams,
               job_id: str | None = None) -> RemoteJobHandle:
        validate_job(prompt_ids, params, self.config, self.info.vocab_size, self.max_model_len)
        if self.draining:
            raise EngineStopped("the engine is not accepting new jobs (draining or stopped)")
        grammar = params.grammar.grammar if params.grammar is not None else None
        wire = dataclasses.replace(params, grammar=None)
        job_id = job_id or f"job-{uuid.uuid4().hex}"
        handle = RemoteJobHandle(job_id, self._handle.remote(list(prompt_ids), wire, grammar),
                                 self._forget)
        with self._lock:
            self._open[job_id] = handle
        return handle

    def _forget(self, job_id: str) -> None:
        with self._lock:
            self._open.pop(job_id, None)

    def abort(self, job_id: str) -> None:
        # Forgotten here too: a job aborted before anyone iterated it (its request's other job
        # was refused) would otherwise hold a drain until its timeout.
        with self._lock:
            handle = self._open.pop(job_id, None)
        if handle is not None:
            handle.cancel()

    def stats(self) -> EngineStats:
        """The replicas' counters summed, as they last reported them (board.py)."""
        out = EngineStats()
        for rec in REPLICA_BOARD.snapshot().values():
            for name in _SUMMED:
                setattr(out, name, getattr(out, name) + int(rec.stats.get(name, 0)))
        return out

    def stop(self, drain: bool = True, timeout: float | None = None) -> None:
        """Refuse new jobs; with `drain`, wait (up to `timeout`) for this gateway's open jobs;
        cancel the rest; then `on_stop` (the cluster's teardown, which drains the replicas)."""
        self.draining = True
        if self._stopped:
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        while drain and self._open and (deadline is None or time.monotonic() < deadline):
            time.sleep(0.05)
        with self._lock:
            left = list(self._open.values())
        for handle in left:
            handle.cancel()
        self._stopped = True
        if self._on_stop is not None:
            self._on_stop()

