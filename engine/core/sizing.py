"""The KV budget an engine sizes for itself when it starts (engine.kv.budget holds the figures):
`kv_cache_bytes`, or what the device leaves once the model is loaded; and the configuration
the engine then runs with."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Protocol

import torch

from engine.config import EngineConfig
from engine.errors import ConfigError
from engine.kv.budget import (
    AUTO_MAX_ROWS,
    KvBudget,
    cpu_budget,
    cuda_budget,
    kv_bytes_per_token,
    mem_available,
)
from engine.model.loader import LoadedModel
from engine.model.runner import Chunk, ModelRunner

log = logging.getLogger("seqgate.engine")


def warm_up(runner: ModelRunner, tokens: int, fill_id: int, device: torch.device) -> None:
    """One prompt forward of `tokens` tokens (a step's longest), so that its activations' peak is
    in use (kept by CUDA's caching allocator) when the budget is measured."""
    with torch.inference_mode():
        runner.prefill_chunk(Chunk(runner.prompt_kv(None, tokens), [fill_id] * tokens, 0,
                                   logits=True, hidden=False))
    torch.cuda.synchronize(device)


class Ranks(Protocol):
    """What the engine needs of a tensor-parallel rank group (engine.distributed's RankGroup,
    which sits above the step): agreeing on a value every rank computed."""

    def least(self, value: int) -> int: ...


def kv_budget(config: EngineConfig, loaded: LoadedModel, dtype: torch.dtype,
              ranks: Ranks | None, warm_up: Callable[[], None]) -> KvBudget | None:
    """The KV budget: `kv_cache_bytes`, or what this device leaves (`free_memory`, after
    `warm_up` on CUDA); the least of the ranks' under tensor parallelism, so that they admit
    alike. None where the model's config does not give its KV shape (rows are then admitted by
    count)."""
    per_token = kv_bytes_per_token(loaded.model.config, dtype, config.tensor_parallel_degree)
    total = config.kv_cache_bytes or free_memory(config, loaded.device, warm_up)
    if ranks is not None:
        total = ranks.least(total if total is not None else -1)
        total = None if total < 0 else total
    if per_token is None or total is None:
        log.warning("no KV budget (the model's KV shape or the memory available is "
                    "unknown): jobs are admitted by max_rolling_batch_size alone")
        return None
    if total < per_token:
        auto_cuda = not config.kv_cache_bytes and loaded.device.type == "cuda"
        name = "gpu_memory_utilization" if auto_cuda else "kv_cache_bytes"
        raise ConfigError(name, getattr(config, name),
                          f"a KV budget of at least one token ({per_token} bytes); "
                          f"{total} bytes are left after loading the model")
    budget = KvBudget.split(total, per_token, config.prompt_cache_bytes)
    log.info("KV budget: %.2f GiB, %d tokens for the rolling batch, %.2f GiB for the "
             "prefix cache", total / 2**30, budget.batch_tokens, budget.prefix_cache / 2**30)
    return budget


def free_memory(config: EngineConfig, device: torch.device,
                warm_up: Callable[[], None]) -> int | None:
    """Bytes this device leaves for KV: on CUDA after a warm-up step, under
    gpu_memory_utilization; on the CPU, a share of the memory available."""
    if device.type != "cuda":
        available = mem_available()
        return None if available is None else \
            cpu_budget(available, config.tensor_parallel_degree)
    warm_up()
    free, total = torch.cuda.mem_get_info(device)
    # mem_get_info: it also sees the CUDA context, other processes and the cached warm-up peak.
    return cuda_budget(total, total - free, config.gpu_memory_utilization)


def resolved(config: EngineConfig, budget: KvBudget | None,
             device: torch.device) -> EngineConfig:
    """The configuration the engine runs with. On CUDA an automatic max_splits is 1, since a GPU
    pays little for padding and much for an attention call per sub-batch per layer
    (docs/gpu.md); an automatic max_rolling_batch_size is derived from the KV budget
    (`KvBudget.auto_rows`), below max_num_batched_tokens."""
    if device.type != "cuda":
        return config
    changes: dict = {} if config.max_splits is not None else {"max_splits": 1}
    if not config.max_rolling_batch_size and budget is not None:
        cap = AUTO_MAX_ROWS
        if config.max_num_batched_tokens:
            cap = min(cap, config.max_num_batched_tokens - 1)
        changes["max_rolling_batch_size"] = budget.auto_rows(cap)
    return dataclasses.replace(config, **changes)
