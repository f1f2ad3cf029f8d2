"""seq-scheduler: rolling batching with max-sparsity splitting and a radix prefix KV cache.

One room per concern, importing only downwards: `config`, `errors`, `outputs`, `staging` (the
shared vocabulary) → `kv` (KV storage) → `request` (jobs, parameters, stops) → `sample` (token
choice) → `sched` (who runs) → `kernels`, `model` (forwards, model surgery) → `distributed` (ranks
in lock step) → `core` (the step and the service around it). A feature goes where its data lives:
a new decoding rule in `sample`, a new cache tier in `kv`, a new protocol outside the engine, in
`adapters/`. docs/architecture.md follows a request through them.

What the app uses is exported here; `EngineClient` is the contract it depends on.
"""

from engine.config import EngineConfig
from engine.core.client import EngineClient, SubmittedJob
from engine.core.handle import JobHandle
from engine.core.service import Engine
from engine.errors import (
    ConfigError,
    ContextLengthExceeded,
    EngineStopped,
    EngineUnavailable,
    InvalidParams,
    KvBudgetExceeded,
    ModelLoadError,
    QueueFull,
)
from engine.model.loader import LoadedModel, load_model
from engine.outputs import EngineStats, JobDelta, StepStats, TokenLogprob
from engine.request.sampling_params import SamplingParams, check_context

__all__ = [
    "EngineClient",
    "SubmittedJob",
    "ConfigError",
    "ContextLengthExceeded",
    "check_context",
    "Engine",
    "EngineConfig",
    "EngineStats",
    "EngineStopped",
    "EngineUnavailable",
    "InvalidParams",
    "JobDelta",
    "JobHandle",
    "KvBudgetExceeded",
    "LoadedModel",
    "ModelLoadError",
    "QueueFull",
    "SamplingParams",
    "StepStats",
    "TokenLogprob",
    "load_model",
]
