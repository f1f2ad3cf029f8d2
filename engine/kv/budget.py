"""The KV memory budget: how many bytes the rolling batch's slabs and the prefix cache may hold
together, what one token's KV costs, and the admission rule that keeps the batch within it.

A job may come to hold (prompt + max_new_tokens) tokens of KV in each of its `n` rows, and a
sub-batch pads every row to its longest one, whose grouping changes as rows grow; so admission
charges every admitted row as much as the longest reservation (`KvBudget.admits`). The batch's
slabs are then laid out within what that charge leaves (engine.kv.rolling_batch), and never hold
more than `KvBudget.batch` bytes. docs/architecture.md says where each figure comes from.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import AUTO_BATCH_ROWS

# On the CPU the automatic budget is this share of the memory available at start: regroups and
# slab moves hold a block's old and new copies at once, and a step's activations, prompts being
# prefilled and the other processes on the host need the rest.
CPU_AVAILABLE_SHARE = 0.5
# The prefix cache gets at most this share of the budget (and at most --prompt-cache-bytes): the
# batch's rows turn memory into throughput, the cache only saves prefill; with a quarter the
# default 512 MiB binds first from a 2 GiB budget up.
PREFIX_CACHE_SHARE = 0.25
# On CUDA an automatic max_rolling_batch_size is as many rows of this many tokens (a chat's prompt
# and answer, typically) as the batch's budget holds, between the bounds below: fewer rows than
# that leave memory idle, more are admitted only while their reservations fit anyway.
AUTO_ROW_TOKENS = 2048
AUTO_MAX_ROWS = 256  # vLLM's default max_num_seqs: per-row host work grows with every step


def kv_bytes_per_token(model_config, dtype: torch.dtype, tp_degree: int = 1) -> int | None:
    """Bytes of KV one token takes on this rank: layers × 2 (keys, values) × KV heads × head
    dimension × dtype size, from the model's config; None when the config does not say."""
    cfg = model_config.get_text_config()
    heads = getattr(cfg, "num_attention_heads", None)
    hidden = getattr(cfg, "hidden_size", None)
    head_dim = getattr(cfg, "head_dim", None) or (hidden // heads if heads and hidden else None)
    kv_heads = (getattr(cfg, "num_key_value_heads", None) or heads or 0) // tp_degree
    layers = getattr(cfg, "num_hidden_layers", None)
    if not (head_dim and kv_heads and layers):
        return None
    return layers * 2 * kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()


def cuda_budget(total: int, in_use: int, utilization: float) -> int:
    """Bytes left for KV on a device of `total` bytes when `in_use` are taken (weights, the
    CUDA context, a warm-up step's activations, other processes) and the engine may take
    `utilization` of the device."""
    return max(int(total * utilization) - in_use, 0)


def cpu_budget(available: int, ranks: int = 1) -> int:
    """Bytes for KV on the CPU: a share of the memory `available`, split between the `ranks`
    of a tensor-parallel engine (they share the host's memory)."""
    return int(available * CPU_AVAILABLE_SHARE) // max(ranks, 1)


def mem_available(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """The kernel's estimate of memory available without swapping (MemAvailable), in bytes;
    None where it is not published."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


@dataclass(frozen=True)
class KvBudget:
    """Bytes of KV the engine may hold: the prefix cache's capacity, the rolling batch's rest,
    and what one token's KV costs."""

    total: int
    per_token: int
    prefix_cache: int  # the prefix cache's capacity within `total`

    @classmethod
    def split(cls, total: int, per_token: int, prompt_cache_bytes: int) -> KvBudget:
        """`total` shared: the prefix cache gets min(prompt_cache_bytes, its share), the batch
        the rest."""
        cache = min(prompt_cache_bytes, int(total * PREFIX_CACHE_SHARE))
        return cls(total, per_token, cache)

    @property
    def batch(self) -> int:
        """Bytes the rolling batch's slabs (and the prompts being prefilled) may hold."""
        return self.total - self.prefix_cache

    @property
    def batch_tokens(self) -> int:
        return self.batch // self.per_token

    def admits(self, rows: int, longest: int) -> bool:
        """Whether `rows` rows fit when each is charged the `longest` reservation among them
        (tokens): a sub-batch pads its rows to its longest, and rows regroup as they grow."""
        return rows * longest <= self.batch_tokens

    def auto_rows(self, cap: int = AUTO_MAX_ROWS) -> int:
        """A max_rolling_batch_size for CUDA: the rows of AUTO_ROW_TOKENS tokens the batch
        holds, at most `cap`, and at least the CPU's default (shorter rows fill it within the
        budget)."""
        rows = self.batch_tokens // AUTO_ROW_TOKENS
        return max(min(rows, cap), min(AUTO_BATCH_ROWS, cap))
