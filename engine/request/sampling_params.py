"""Per-job decoding parameters."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.config import STRATEGIES
from engine.errors import ContextLengthExceeded, InvalidParams, KvBudgetExceeded

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.kv.budget import KvBudget
    from engine.sample.grammar import CompiledGrammar

# Bounds on what a client controls per job: each one caps memory or work on the engine thread.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024  # per stop string
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 1024  # entries
PRIORITY_LIMIT = 2**31 - 1
MAX_N = 16
MAX_TOP_LOGPROBS = 20
MAX_CONTRASTIVE_TOP_K = 16  # each candidate is one more row in the look-ahead forward
CONTRASTIVE_DEFAULT_K = 4  # candidates of a contrastive job that leaves top_k at 0
MAX_TOP_K = 2**31 - 1
SEED_RANGE = (-(2**63), 2**63 - 1)  # int64, as OpenAI documents it




def check_context(prompt_tokens: int, max_new_tokens: int, limit: int) -> None:
    """Raise ContextLengthExceeded when a prompt and its new tokens do not fit `limit`."""
    if prompt_tokens + max_new_tokens > limit:
        raise ContextLengthExceeded(prompt_tokens, max_new_tokens, limit)


def row_kv_tokens(prompt_tokens: int, params: SamplingParams, strategy: str) -> int:
    """Tokens of KV one of a job's rows may come to hold: its prompt, every token it may
    generate, and a contrastive row's candidates, written beside its context for a step."""
    candidates = (params.top_k or CONTRASTIVE_DEFAULT_K) if strategy == "contrastive" else 0
    return prompt_tokens + params.max_new_tokens + candidates


def check_kv_budget(prompt_tokens: int, params: SamplingParams, strategy: str,
                    budget: KvBudget | None) -> None:
    """Raise KvBudgetExceeded when a job could not be admitted even into an empty batch: its
    `n` rows' KV over the budget (`KvBudget.admits`). The error names what to reduce."""
    tokens = row_kv_tokens(prompt_tokens, params, strategy)
    if budget is None or budget.admits(params.n, tokens):
        return
    least = tokens - params.max_new_tokens + 1  # with a single new token
    param = "prompt" if not budget.admits(1, least) else \
        "n" if not budget.admits(params.n, least) else "max_new_tokens"
    raise KvBudgetExceeded(param, prompt_tokens, params.max_new_tokens, params.n, tokens,
                           budget.batch_tokens)


def validate_job(prompt_ids: list[int], params: SamplingParams, config: EngineConfig,
                 vocab_size: int, max_model_len: int) -> str:
    """Check a job against an engine's limits before it is queued; return its decoding strategy.
    Raises InvalidParams (ContextLengthExceeded) naming the parameter, the value and the limit.
    A gateway in front of replicas checks with the replicas' figures, so a refusal is a 400 from
    the gateway rather than an error from the replica."""
    params.validate()
    if not prompt_ids:
        raise InvalidParams("prompt", "{param} must not be empty")
    if params.n > config.batch_rows:
        raise InvalidParams(
            "n", f"{{param}}={params.n} exceeds max_rolling_batch_size={config.batch_rows}")
    for param, ids in (
        ("prompt", prompt_ids),
        ("stop_token_ids", params.stop_token_ids),
        ("logit_bias", params.logit_bias),
    ):
        if (bad := next((t for t in ids if not 0 <= t < vocab_size), None)) is not None:
            raise InvalidParams(param, f"{{param}} has token id {bad}, outside the vocabulary "
                                       f"[0, {vocab_size})")
    strategy = params.resolved_strategy(config.decoding_strategy)
    if strategy == "contrastive":
        params.check_contrastive()
    check_context(len(prompt_ids), params.max_new_tokens, max_model_len)
    return strategy


@dataclass
class SamplingParams:
    """How one job decodes and when it stops. `None` strategy means the engine default."""

    strategy: str | None = None  # greedy | sample | contrastive
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off (contrastive: 0 means 4)
    min_p: float = 0.0
    seed: int | None = None
    penalty_alpha: float = 0.6  # contrastive search
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    max_new_tokens: int = 256
    min_new_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0
    # The prompt's tokens' log-probabilities (vLLM's prompt_logprobs): None, or how many top
    # alternatives each reports.
    prompt_logprobs: int | None = None
    # The output must match this grammar (compiled off the engine thread: GrammarCompiler).
    grammar: CompiledGrammar | None = None
    skip_special_tokens: bool = True
    priority: int = 0  # lower is admitted first under the "priority" scheduling policy

    def validate(self) -> None:
        """Raise InvalidParams naming the first parameter out of range."""
        self._validate_sizes()
        if self.strategy is not None and self.strategy not in STRATEGIES:
            raise InvalidParams(
                "decoding_strategy",
                f"{{param}} must be one of {STRATEGIES}, got {self.strategy!r}",
            )
        if not 0.0 <= self.temperature <= 2.0:
            raise InvalidParams(
                "temperature", f"{{param}} must be in [0, 2], got {self.temperature}"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidParams("top_p", f"{{param}} must be in (0, 1], got {self.top_p}")
        if not 0 <= self.top_k <= MAX_TOP_K:
            raise InvalidParams("top_k", f"{{param}} must be in [0, {MAX_TOP_K}], got {self.top_k}")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise InvalidParams("seed",
                                f"{{param}} must be a 64-bit signed integer, got {self.seed}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidParams("min_p", f"{{param}} must be in [0, 1], got {self.min_p}")
        if not 0.0 <= self.penalty_alpha <= 1.0:
            raise InvalidParams(
                "penalty_alpha", f"{{param}} must be in [0, 1], got {self.penalty_alpha}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -2.0 <= v <= 2.0:
                raise InvalidParams(name, f"{{param}} must be in [-2, 2], got {v}")
        if self.repetition_penalty <= 0.0:
            raise InvalidParams(
                "repetition_penalty",
                f"{{param}} must be > 0, got {self.repetition_penalty}",
            )
        for tok, bias in self.logit_bias.items():
            if not -100.0 <= bias <= 100.0:
                raise InvalidParams(
                    "logit_bias", f"{{param}} for token {tok} must be in [-100, 100], got {bias}"
                )
        if self.max_new_tokens < 1:
            raise InvalidParams("max_new_tokens",
                                f"{{param}} must be >= 1, got {self.max_new_tokens}")
        if self.min_new_tokens < 0 or self.min_new_tokens > self.max_new_tokens:
            raise InvalidParams(
                "min_new_tokens",
                f"{{param}} must be in [0, the maximum new tokens], got {self.min_new_tokens}",
            )
        if not -PRIORITY_LIMIT <= self.priority <= PRIORITY_LIMIT:
            raise InvalidParams("priority", f"{{param}} must be in [-{PRIORITY_LIMIT}, "
                                f"{PRIORITY_LIMIT}], got {self.priority}")
        if not 1 <= self.n <= MAX_N:
            raise InvalidParams("n", f"{{param}} must be in [1, {MAX_N}], got {self.n}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidParams(
                "top_logprobs",
                f"{{param}} must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}",
            )
        if self.prompt_logprobs is not None and \
                not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidParams("prompt_logprobs", f"{{param}} must be in [0, {MAX_TOP_LOGPROBS}], "
                                f"got {self.prompt_logprobs}")
        if self.strategy == "contrastive":
            self.check_contrastive()

    def _validate_sizes(self) -> None:
        """Lists and maps the client sizes: bounded, so no request can hog the engine."""
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidParams(
                "stop", f"{{param}} takes at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}"
            )
        for s in self.stop:
            if not s or len(s) > MAX_STOP_CHARS:
                raise InvalidParams(
                    "stop",
                    f"each {{param}} string must have 1 to {MAX_STOP_CHARS} characters, got one of "
                    f"{len(s)}",
                )
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidParams(
                "stop_token_ids",
                f"{{param}} takes at most {MAX_STOP_TOKEN_IDS} ids, "
                f"got {len(self.stop_token_ids)}",
            )
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidParams(
                "logit_bias",
                f"{{param}} takes at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}",
            )

    def check_contrastive(self) -> None:
        """Contrastive search's own bound (also checked once a server default resolves to it)."""
        if self.top_k > MAX_CONTRASTIVE_TOP_K:
            raise InvalidParams(
                "top_k",
                f"contrastive search takes {{param}} up to {MAX_CONTRASTIVE_TOP_K} (each candidate "
                f"is a look-ahead row), got {self.top_k}",
            )

    def resolved_strategy(self, default: str) -> str:
        strategy = self.strategy or default
        # temperature 0 means greedy whatever the strategy, as OpenAI clients expect.
        if strategy == "sample" and self.temperature == 0.0:
            return "greedy"
        return strategy
