"""EngineClient: what the HTTP app asks of an engine, written down once.

The local engine (engine.core.service.Engine) and the gateway's view of Ray Serve replicas
(app.replicas.remote_engine.RemoteEngine) both implement it; the app depends on this contract
alone (vLLM's EngineClient plays the same part).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol, runtime_checkable

from engine.config import EngineConfig
from engine.outputs import EngineStats, JobDelta, StepStats
from engine.request.sampling_params import SamplingParams
from engine.sample.grammar import GrammarCompiler


class SubmittedJob(Protocol):
    """A submitted job's output: `accepted()` once it is queued (or raises the refusal), then
    its deltas, the last of each sequence carrying a finish reason."""

    job_id: str
    replica: str | None  # which replica runs it; None: this process

    async def accepted(self) -> None: ...

    def __aiter__(self) -> AsyncIterator[JobDelta]: ...


class ModelInfo(Protocol):
    """Where the model runs (for /version)."""

    device: Any
    dtype: Any


@runtime_checkable
class EngineClient(Protocol):
    """Submit, abort and observe jobs; the model's tokenizer, limits and grammar compiler."""

    config: EngineConfig
    tokenizer: Any  # the model's transformers tokenizer
    model_name: str
    max_model_len: int
    eos_ids: list[int]
    grammars: GrammarCompiler
    loaded: ModelInfo
    draining: bool

    @property
    def alive(self) -> bool: ...

    def start(self, background: bool = True) -> None: ...

    def submit(self, prompt_ids: list[int], params: SamplingParams,
               job_id: str | None = None) -> SubmittedJob:
        """Queue a job, or raise QueueFull, InvalidParams, ContextLengthExceeded,
        KvBudgetExceeded, EngineStopped."""
        ...

    def abort(self, job_id: str) -> None: ...

    def stats(self) -> EngineStats: ...

    def stop(self, drain: bool = True, timeout: float | None = None) -> None: ...

    def add_step_listener(self, fn: Callable[[StepStats], None]) -> None: ...
