"""Engine configuration: one frozen dataclass, validated on construction."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from engine.errors import ConfigError

STRATEGIES = ("greedy", "sample", "contrastive")
POLICIES = ("fifo", "priority", "shortest")
DTYPES = ("auto", "fp32", "fp16", "bf16")
KV_CACHE_DTYPES = ("auto", "fp32", "fp16", "bf16")
QUANTIZE_MODES = ("none", "int8", "int4", "w8a8")
DECODE_ATTENTION = ("auto", "sdpa")
LINEAR_KERNELS = ("auto", "torch")
# Rows of an automatic max_rolling_batch_size where the KV budget does not set it (the CPU);
# at least MAX_N (engine/request/sampling_params.py), so any job's `n` fits. 64 rather than 32:
# a CPU step of 64 rows costs well under twice one of 32, so at 64 clients the second half no
# longer queues (docs/benchmarks/speed.md); admission by bytes still bounds the memory.
AUTO_BATCH_ROWS = 64
AUTO_SPLITS = 3


def default_num_threads() -> int:
    """Intra-op threads for the engine: every core of a small machine, one spare on a larger one.

    DESIGN.md warns that torch's threads spin while they wait, so a pool as wide as the machine can
    lose to one thread when another busy thread shares the cores. Under the serving benchmark on
    2 cores, taking both was faster at every concurrency (docs/benchmarks/speed.md), so on small
    machines the engine takes them all; the HTTP loop's work between steps is small.
    """
    if hasattr(os, "sched_getaffinity"):
        cores = len(os.sched_getaffinity(0))
    else:
        cores = os.cpu_count() or 1
    return cores if cores <= 4 else cores - 1


@dataclass(frozen=True)
class EngineConfig:
    """Everything the seq-scheduler needs to load a model and run its loop."""

    # Model: a hub id, a local directory, a .gguf file, or None for the embedded SmolLM2.
    model_id: str | None = None
    revision: str | None = None
    dtype: str = "auto"
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    trust_remote_code: bool = False
    # Where de-quantised GGUF models are cached as safetensors; None: ~/.cache/seqgate.
    cache_dir: str | None = None
    # Rolling batch: the most sequences it runs; 0: auto, `batch_rows`.
    max_rolling_batch_size: int = 0
    job_queue_size: int = 1000
    # Max-sparsity thresholding.
    max_sparsity: float = 0.33
    # None: auto, `splits` (3; 1 on CUDA, where the engine sets it: docs/gpu.md).
    max_splits: int | None = None
    # Decoding default for jobs that do not choose.
    decoding_strategy: str = "greedy"
    # Run all sub-batches in one forward call with attention split per sub-batch (models using
    # transformers' attention interface); off: one forward per sub-batch.
    fuse_sub_batches: bool = True
    # Prompt cache (system-prompt prefix KV), bounded in bytes; 0 disables it. Within the KV
    # budget it gets at most a share of it (engine/kv/budget.py).
    prompt_cache_bytes: int = 512 * 1024 * 1024
    # The KV budget, in bytes, for the rolling batch's slabs and the prompt cache together
    # (engine/kv/budget.py); 0: auto, from gpu_memory_utilization on CUDA, from the memory
    # available at start on the CPU.
    kv_cache_bytes: int = 0
    # On CUDA, the share of the device's memory the engine may use: the KV budget is that, less
    # what the loaded model and a warm-up step take (vLLM's and DJL LMI's name).
    gpu_memory_utilization: float = 0.9
    # Smallest prefix (tokens) worth caching.
    prompt_cache_min_tokens: int = 16
    # Tokens one step computes: every running row's decode token, then prompt chunks in what is
    # left (stall-free chunked prefill). Must exceed max_rolling_batch_size; 0: `token_budget`.
    max_num_batched_tokens: int = 0
    # While rows decode, a step takes on at most the prompt work that keeps it within this many
    # times a decode-only step of the same rows (costs learnt from the steps that ran,
    # engine/sched/step_cost.py); 0: the token budget alone. The price of a bound is long
    # prompts' time to first token (docs/benchmarks/scheduler.md).
    stall_ratio: float = 2.5
    # Admission order: fifo; priority (the request's `priority`, lower first); shortest (prompt
    # first). Under the last two a job waiting `scheduling_age_limit` seconds goes first.
    scheduling_policy: str = "fifo"
    scheduling_age_limit: float = 10.0
    # Context tokens whose attention costs as much as one token's linear layers, for charging
    # a prompt chunk's attention to the budget; 0 derives it from the model (ModelRunner).
    chunk_attention_tokens: int = 0
    # One-query (decode) attention on CPU models (bf16, fp32): auto runs seqgate's own kernel
    # (engine/kernels/, compiled for the host on first use) where it builds, else PyTorch's SDPA;
    # sdpa always runs SDPA.
    decode_attention: str = "auto"
    # Speculative decoding by prompt lookup (engine/sample/speculative.py): up to this many
    # tokens per plain row (greedy, or sampled without a seed), proposed from n-grams of its
    # prompt and output and verified in the step's forward; 0: off.
    num_speculative_tokens: int = 4
    # No step speculates while more rows than this decode: a sub-batch keeps only the drafts
    # every one of its rows accepted, and a large batch already reads each weight for many.
    speculative_max_rows: int = 4
    # A smaller model sharing the tokenizer (directory, hub id or GGUF file) whose greedy
    # continuation is the draft instead of prompt lookup (engine/sample/draft_model.py).
    speculative_model: str | None = None
    # Quantisation on the CPU: none | int8 | int4 weights (fp32 and bf16 models:
    # engine/model/lowbit.py, whose kernel also rounds few rows to 8 bits as llama.cpp does;
    # engine/model/quantize.py where its blocks are not used) | w8a8, int8 weights and
    # activations for forwards of many rows (engine/model/w8a8.py: bf16 or fp32 models where
    # the native library builds, fp32 ones through FBGEMM where it does not).
    quantize: str = "none"
    # The KV cache's dtype: auto keeps the model's, except that a quantised fp32 model on the
    # CPU (int4, int8, w8a8: already judged by next-token distance, not exactness) keeps fp16
    # where the decode-attention kernel reads it, halving the bytes each decode step's attention
    # reads (engine.model.prepare._kv_dtype); fp32 | fp16 | bf16 set it (narrower than the
    # model's only with the packed forward, whose attention widens it).
    kv_cache_dtype: str = "auto"
    # Linear layers of CPU models: auto multiplies forwards of few rows through seqgate's
    # 4/8-bit block kernels (engine/model/lowbit.py) where the weights are exact blocks (in
    # bf16: blocks rounded to bf16) or `quantize` rounds them; torch keeps PyTorch's products.
    linear_kernel: str = "auto"
    # On CUDA, packed forwards of up to `max_cudagraph_capture_size` tokens replay the work
    # between attentions as CUDA graphs (engine/model/cuda_graphs.py); enforce_eager turns them
    # off (vLLM's and DJL LMI's names).
    enforce_eager: bool = False
    max_cudagraph_capture_size: int = 512
    # torch intra-op threads; 0 picks a default from the cores available.
    num_threads: int = 0
    # Context length limit; 0 means the model's max_position_embeddings.
    max_model_len: int = 0
    # Ranks (processes) the model is split over with transformers' tensor-parallel plan
    # (engine/distributed/tensor_parallel.py); 1: one process.
    tensor_parallel_degree: int = 1
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError("dtype", self.dtype, "one of " + ", ".join(DTYPES))
        if self.quantize not in QUANTIZE_MODES:
            raise ConfigError("quantize", self.quantize, "one of " + ", ".join(QUANTIZE_MODES))
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError("kv_cache_dtype", self.kv_cache_dtype,
                              "one of " + ", ".join(KV_CACHE_DTYPES))
        if self.decoding_strategy not in STRATEGIES:
            raise ConfigError("decoding_strategy", self.decoding_strategy,
                              "one of " + ", ".join(STRATEGIES))
        if self.linear_kernel not in LINEAR_KERNELS:
            raise ConfigError("linear_kernel", self.linear_kernel,
                              "one of " + ", ".join(LINEAR_KERNELS))
        if self.decode_attention not in DECODE_ATTENTION:
            raise ConfigError("decode_attention", self.decode_attention,
                              "one of " + ", ".join(DECODE_ATTENTION))
        if self.scheduling_policy not in POLICIES:
            raise ConfigError("scheduling_policy", self.scheduling_policy,
                              "one of " + ", ".join(POLICIES))
        if not self.scheduling_age_limit > 0:
            raise ConfigError("scheduling_age_limit", self.scheduling_age_limit, "> 0 seconds")
        if self.max_rolling_batch_size < 0:
            raise ConfigError("max_rolling_batch_size", self.max_rolling_batch_size,
                              ">= 1, or 0 for auto")
        for name in ("num_speculative_tokens", "speculative_max_rows"):
            if getattr(self, name) < 0:
                raise ConfigError(name, getattr(self, name), ">= 0 (0: off)")
        if self.job_queue_size < 0:
            raise ConfigError("job_queue_size", self.job_queue_size, ">= 0")
        if not 0.0 <= self.max_sparsity <= 1.0:
            raise ConfigError("max_sparsity", self.max_sparsity, "a number in [0, 1]")
        if self.max_splits is not None and self.max_splits < 1:
            raise ConfigError("max_splits", self.max_splits, ">= 1")
        if self.prompt_cache_bytes < 0:
            raise ConfigError("prompt_cache_bytes", self.prompt_cache_bytes, ">= 0")
        if self.kv_cache_bytes < 0:
            raise ConfigError("kv_cache_bytes", self.kv_cache_bytes, ">= 0 (0 = auto)")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError("gpu_memory_utilization", self.gpu_memory_utilization,
                              "a number in (0, 1]")
        if self.max_num_batched_tokens and self.max_num_batched_tokens <= self.batch_rows:
            raise ConfigError("max_num_batched_tokens", self.max_num_batched_tokens,
                              f"more than max_rolling_batch_size ({self.batch_rows}),"
                              " so that prompts progress while the batch decodes")
        if self.stall_ratio and not self.stall_ratio > 1.0:
            raise ConfigError("stall_ratio", self.stall_ratio, "> 1, or 0 to turn it off")
        if self.chunk_attention_tokens < 0:
            raise ConfigError("chunk_attention_tokens", self.chunk_attention_tokens,
                              ">= 0 (0 = derived from the model)")
        if self.max_cudagraph_capture_size < 1:
            raise ConfigError("max_cudagraph_capture_size", self.max_cudagraph_capture_size,
                              ">= 1 (enforce_eager turns graphs off)")
        if self.num_threads < 0:
            raise ConfigError("num_threads", self.num_threads, ">= 0 (0 = auto)")
        if self.tensor_parallel_degree < 1:
            raise ConfigError("tensor_parallel_degree", self.tensor_parallel_degree, ">= 1")
        if self.tensor_parallel_degree > 1 and self.scheduling_policy != "fifo":
            # The other policies read the clock, which differs between ranks in lock step.
            raise ConfigError("scheduling_policy", self.scheduling_policy,
                              "fifo when tensor_parallel_degree > 1")
        if self.tensor_parallel_degree > 1 and self.speculative_model:
            # Every rank would run the whole draft model: refused rather than run untested.
            raise ConfigError("speculative_model", self.speculative_model,
                              "unset when tensor_parallel_degree > 1")
        if self.tensor_parallel_degree > 1 and self.quantize != "none":
            # Each rank's share of a layer is a DTensor shard, which the packed kernels were
            # never tried on: refused by name rather than run untested.
            raise ConfigError("quantize", self.quantize, "none when tensor_parallel_degree > 1")
        if self.max_model_len < 0:
            raise ConfigError("max_model_len", self.max_model_len, ">= 0 (0 = the model's)")
        if not (self.device == "auto" or self.device == "cpu" or self.device.startswith("cuda")):
            raise ConfigError("device", self.device, "auto, cpu, cuda or cuda:N")

    @property
    def batch_rows(self) -> int:
        """The most sequences the rolling batch runs: `max_rolling_batch_size`, or when that is
        0, AUTO_BATCH_ROWS, below a `max_num_batched_tokens` set (so that prompts progress
        while the batch decodes, as on CUDA, where the engine derives the rows from the KV
        budget instead and runs with that value set)."""
        if self.max_rolling_batch_size:
            return self.max_rolling_batch_size
        if self.max_num_batched_tokens:
            return max(1, min(AUTO_BATCH_ROWS, self.max_num_batched_tokens - 1))
        return AUTO_BATCH_ROWS

    @property
    def splits(self) -> int:
        """The most sub-batches a step runs: `max_splits`, or when that is unset, AUTO_SPLITS (on
        CUDA the engine runs with 1 set instead)."""
        return self.max_splits or AUTO_SPLITS

    @property
    def token_budget(self) -> int:
        """A step's token budget: `max_num_batched_tokens`, by default 256 (measured on the
        ShareGPT sweep and the stall scenario, docs/benchmarks.md) or twice the batch when
        that is larger, so that prompts always get part of a full batch's step."""
        return self.max_num_batched_tokens or max(256, 2 * self.batch_rows)

    @property
    def threads(self) -> int:
        return self.num_threads or default_num_threads()
