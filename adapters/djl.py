"""DJL-serving's `/invocations`: `{"inputs", "parameters", "cached_prompt"}` → engine jobs, and
deltas → DJL rolling-batch output (`json`: `{"generated_text", "details"?}`; `jsonlines`: one
`{"token": {"id", "text", "log_prob"}}` line per token, the last also carrying `generated_text`).
"""

from __future__ import annotations

import json
import logging
from typing import Any

import msgspec
from msgspec import UNSET, Struct, UnsetType

from adapters.errors import DJL_NAMES, ApiError, from_engine_error
from adapters.limits import MAX_PROMPTS
from adapters.openai_params import JobSpec, check_token_limit, stop_list, validated
from adapters.openai_types import convert, decode_request
from adapters.prompt_size import encode_bounded
from adapters.token_text import TokenText
from engine import InvalidParams, JobDelta, SamplingParams, check_context

log = logging.getLogger("seqgate.adapters.djl")

# DJL's rolling-batch default.
DEFAULT_MAX_NEW_TOKENS = 30

_KNOWN_PARAMETERS = {
    "max_new_tokens", "min_new_tokens", "do_sample", "temperature", "top_p", "top_k",
    "repetition_penalty", "stop_sequences", "stop", "decoding_strategy", "details", "seed",
    "return_full_text", "penalty_alpha", "ignore_eos",
}


class DjlRequest(Struct, kw_only=True):
    """POST /invocations as DJL-serving takes it."""

    inputs: str | list[str]
    parameters: dict[str, Any] | None = None
    cached_prompt: str | None = None
    stream: bool | None = None


class DjlToken(Struct):
    id: int
    text: str
    log_prob: float | None


class DjlDetails(Struct):
    finish_reason: str  # eos_token | stop_sequence | length | error
    generated_tokens: int
    inputs: str
    tokens: list[DjlToken] | UnsetType = UNSET  # json only


class DjlOutput(Struct):
    """The `json` formatter's answer per input (documentation; built as a dict below)."""

    generated_text: str
    details: DjlDetails | UnsetType = UNSET


class DjlOptions(Struct, kw_only=True):
    """The `parameters` object, typed; unknown keys are logged and ignored (DJL passes them on)."""

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    min_new_tokens: int = 0
    do_sample: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None
    stop_sequences: str | list[str] | None = None
    stop: str | list[str] | None = None
    decoding_strategy: str | None = None
    details: bool = False
    seed: int | None = None
    return_full_text: bool = False
    penalty_alpha: float | None = None
    ignore_eos: bool = False


def decode_djl(body: bytes) -> tuple[DjlRequest, DjlOptions]:
    req, unknown = decode_request(body, DjlRequest)
    if unknown:
        log.info("/invocations: ignoring unknown fields %s", unknown)
    raw = {k: v for k, v in (req.parameters or {}).items() if v is not None}
    if extra := sorted(set(raw) - _KNOWN_PARAMETERS):
        log.info("/invocations: ignoring unknown parameters %s", extra)
    try:
        opts = convert({k: v for k, v in raw.items() if k in _KNOWN_PARAMETERS}, DjlOptions)
    except msgspec.ValidationError as exc:
        raise ApiError.bad_request(f"Invalid parameters: {exc}", param="parameters",
                                   code="invalid_type") from None
    return req, opts


def djl_params(opts: DjlOptions) -> SamplingParams:
    strategy = opts.decoding_strategy  # SamplingParams.validate checks it
    if strategy is None and opts.do_sample is not None:
        strategy = "sample" if opts.do_sample else "greedy"
    params = SamplingParams(
        strategy=strategy,
        temperature=1.0 if opts.temperature is None else opts.temperature,
        top_p=1.0 if opts.top_p is None else opts.top_p,
        top_k=opts.top_k or 0,
        seed=opts.seed,
        repetition_penalty=1.0 if opts.repetition_penalty is None else opts.repetition_penalty,
        max_new_tokens=opts.max_new_tokens,
        min_new_tokens=opts.min_new_tokens,
        stop=stop_list(opts.stop_sequences) + stop_list(opts.stop),
        ignore_eos=opts.ignore_eos,
        # DJL reports every token's log_prob.
        logprobs=True,
    )
    return validated(params, opts.penalty_alpha, DJL_NAMES)


def build_djl_jobs(req: DjlRequest, opts: DjlOptions, tokenizer, max_model_len: int,
                   max_tokens_limit: int = 0) -> list[JobSpec]:
    """One job per input. The cached prompt is tokenized on its own and put in front, so its ids
    are the same for every request whatever follows them, and the engine's prefix cache reuses
    them."""
    inputs = [req.inputs] if isinstance(req.inputs, str) else req.inputs
    check_token_limit(opts.max_new_tokens, max_tokens_limit, "parameters.max_new_tokens")
    if not inputs or len(inputs) > MAX_PROMPTS:
        raise ApiError.bad_request(f"inputs must hold 1 to {MAX_PROMPTS} strings", param="inputs")
    head = encode_bounded(tokenizer, req.cached_prompt, max_model_len, "inputs") \
        if req.cached_prompt else []
    jobs = []
    for text in inputs:
        tail = encode_bounded(tokenizer, text, max_model_len, "inputs",
                              add_special_tokens=not head) if text else []
        ids = head + tail
        if not ids:
            raise ApiError.bad_request("inputs must not be empty", param="inputs")
        params = djl_params(opts)
        try:
            check_context(len(ids), params.max_new_tokens, max_model_len)
        except InvalidParams as exc:
            raise from_engine_error(exc, DJL_NAMES) from None
        jobs.append(JobSpec(ids, params))
    return jobs


def djl_finish_reason(reason: str | None, last_token: int | None, eos_ids: set[int]) -> str:
    """DJL's names: eos_token, stop_sequence, length (and error)."""
    if reason == "length":
        return "length"
    if reason == "stop":
        return "eos_token" if last_token in eos_ids else "stop_sequence"
    return "error"


class DjlAssembler:
    """Collects one job's deltas; renders DJL's json object or jsonlines lines."""

    def __init__(self, inputs: str, opts: DjlOptions, token_text: TokenText, eos_ids: set[int]):
        self.inputs, self.opts, self.token_text, self.eos_ids = inputs, opts, token_text, eos_ids
        self.text: list[str] = [inputs] if opts.return_full_text else []
        self.tokens: list[dict[str, Any]] = []
        self.finish: str | None = None

    def _token_dicts(self, delta: JobDelta) -> list[dict[str, Any]]:
        lps = {i: lp.logprob for i, lp in enumerate(delta.logprobs or [])}
        out = [{"id": t, "text": self.token_text.text(t), "log_prob": lps.get(i)}
               for i, t in enumerate(delta.token_ids)]
        self.tokens.extend(out)
        return out

    def _details(self) -> dict[str, Any]:
        return {"finish_reason": self.finish, "generated_tokens": len(self.tokens),
                "inputs": self.inputs}

    def add(self, delta: JobDelta) -> list[str]:
        """Record a delta; returns the jsonlines lines it produces (each ending in a newline)."""
        new = self._token_dicts(delta)
        self.text.append(delta.text)
        lines = [{"token": t} for t in new]
        if delta.finish_reason is not None:
            last = self.tokens[-1]["id"] if self.tokens else None
            self.finish = djl_finish_reason(delta.finish_reason, last, self.eos_ids)
            if not lines:
                lines = [{}]
            lines[-1]["generated_text"] = "".join(self.text)
            if self.opts.details:
                lines[-1]["details"] = self._details()
            elif self.finish == "error":
                lines[-1]["details"] = {"finish_reason": "error"}
        return [json.dumps(x, ensure_ascii=False) + "\n" for x in lines]

    def result(self) -> dict[str, Any]:
        """The `json` formatter's object for the finished job."""
        out: dict[str, Any] = {"generated_text": "".join(self.text)}
        if self.opts.details:
            out["details"] = {**self._details(), "tokens": self.tokens}
        return out
