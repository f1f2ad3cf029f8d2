"""What crosses the engine boundary: per-step deltas for clients, step plans and stats for tests."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    """The chosen token's log-probability and, when asked, the top alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    rank: int | None = None  # its rank in the distribution (1: the likeliest), where computed


@dataclass
class JobDelta:
    """What one sequence of a job produced since its last delta.

    `text` is the newly committed text (stop strings and held-back partial matches excluded);
    `finish_reason` is set on the sequence's last delta (stop / length / abort / error).
    """

    job_id: str
    index: int  # which of the job's n sequences
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0  # total so far for this sequence
    error: str | None = None
    # Why it failed, when the request itself is the cause: "grammar" (the output could not
    # follow the request's grammar with this tokenizer); None: an engine failure.
    error_cause: str | None = None
    # On a sequence's first delta, when asked: each prompt token's log-probability (None for the
    # first, which nothing precedes).
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class StepStats:
    """One engine step, as counted for metrics and tests."""

    step: int
    running: int  # sequences admitted (decoding or being prefilled) after the step
    queued: int
    admitted: int
    finished: int
    sub_batches: int
    sub_batch_sizes: list[int]
    sparsity: float  # padding / real tokens over the whole batch, after partitioning
    padded_tokens: int
    kv_bytes: int  # bytes held by the rolling batch's KV after the step
    regrouped: bool  # the batch was laid out anew (rows joined or left)
    decode_rows: int  # rows that decoded a token this step
    prefill_tokens: int  # prompt tokens computed this step (in `prefill_chunks` chunks)
    prefill_chunks: int
    cached_prompt_tokens: int  # prompt tokens of the jobs admitted this step found cached
    seconds: float  # the whole step: schedule, layout, forward, token choice, publish
    # Per job aborted this step: engine steps started between its abort request and now.
    abort_free_steps: list[int] = field(default_factory=list)


@dataclass
class EngineStats:
    """Counters since start, and the last step's stats."""

    queued: int = 0
    running: int = 0
    steps: int = 0
    last_step: StepStats | None = None
    prompt_tokens: int = 0
    generated_tokens: int = 0
    cache_hits: int = 0  # prefills that reused a cached prefix
    cache_misses: int = 0  # prefills that found none (with the cache on)
    cached_tokens: int = 0  # prompt tokens whose KV came from the cache
    prefix_cache_bytes: int = 0
    prefix_cache_entries: int = 0  # nodes of the radix tree holding KV
    prefix_cache_evictions: int = 0
    grammars_compiled: int = 0  # grammars built (not found in the compile cache)
    grammar_masked_tokens: int = 0  # tokens chosen under a grammar's mask
    grammar_mask_seconds: float = 0.0  # time spent computing and applying those masks
    kv_bytes: int = 0  # held by the rolling batch's slabs after the last step
    peak_kv_bytes: int = 0  # the most they held after any step
    kv_budget_bytes: int = 0  # the most they may hold (the KV budget less the prefix cache's)
    prefix_cache_capacity_bytes: int = 0  # --prompt-cache-bytes, or less within the KV budget
    out_of_memory_steps: int = 0  # steps an allocation failure undid (engine.core.step)
    preemptions: int = 0  # jobs put back on the queue to be recomputed after one
    spec_proposed_tokens: int = 0  # draft tokens fed for verification (speculative decoding)
    spec_accepted_tokens: int = 0  # of those, kept
    finished_by_reason: Counter = field(default_factory=Counter)
