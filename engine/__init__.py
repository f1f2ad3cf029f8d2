"""seq-scheduler: rolling batching with max-sparsity splitting and a radix prefix KV cache."""

from engine.config import ConfigError, EngineConfig
from engine.engine import Engine, EngineStats, EngineStopped, EngineUnavailable, JobHandle
from engine.loader import LoadedModel, ModelLoadError, load_model
from engine.outputs import JobDelta, StepStats, TokenLogprob
from engine.queue import QueueFull
from engine.sampling_params import (
    ContextLengthExceeded,
    InvalidParams,
    SamplingParams,
    check_context,
)

__all__ = [
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
    "LoadedModel",
    "ModelLoadError",
    "QueueFull",
    "SamplingParams",
    "StepStats",
    "TokenLogprob",
    "load_model",
]
