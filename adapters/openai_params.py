"""OpenAI request parameters → engine SamplingParams, shared by chat and completions.

Everything here is checked before anything is submitted, so a bad request never reaches the
engine and a multi-prompt request is refused whole rather than half-submitted.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from adapters.errors import ApiError, ParamNames, from_engine_error
from adapters.openai_types import SamplingFields
from adapters.tools import ToolPlan
from engine import InvalidParams, SamplingParams, check_context


@dataclass
class JobSpec:
    """One engine job to submit: prompt token ids and the parameters."""

    prompt_ids: list[int]
    params: SamplingParams
    tools: ToolPlan | None = None  # chat: the answer may hold tool calls to parse
    # chat with a reasoning parser: whether the output starts inside the think block; None: no
    # parser (adapters/reasoning.py).
    thinks: bool | None = None


@dataclass(frozen=True)
class ResponseMeta:
    """What every response and chunk of one request repeats."""

    id: str
    created: int
    model: str
    system_fingerprint: str

    @classmethod
    def new(cls, prefix: str, model: str, system_fingerprint: str) -> ResponseMeta:
        return cls(f"{prefix}-{uuid.uuid4().hex}", int(time.time()), model, system_fingerprint)


def check_model(requested: str | None, served: str) -> None:
    """404 model_not_found unless the request names the served model (or none)."""
    if requested and requested != served:
        raise ApiError.model_not_found(requested, served)


def stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def strategy_for(req: SamplingFields) -> str | None:
    """The decoding strategy a request asks for; None leaves the server default.

    Like vLLM: an explicit temperature or top_p means sampling (temperature 0 means greedy),
    because OpenAI clients that set them expect sampling; a request that sets neither gets the
    server's `option.decoding_strategy`. An explicit `decoding_strategy` wins over both.
    """
    if req.decoding_strategy is not None:
        return req.decoding_strategy  # SamplingParams.validate checks it
    if req.temperature is not None or req.top_p is not None:
        return "greedy" if req.temperature == 0 else "sample"
    return None


def logit_bias_ids(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's string keys as token ids (their number and range: SamplingParams.validate)."""
    out: dict[int, float] = {}
    for key, value in (bias or {}).items():
        try:
            out[int(key)] = float(value)
        except ValueError:
            raise ApiError.bad_request(f"logit_bias keys must be token ids, got {key!r}",
                                       param="logit_bias") from None
    return out


def sampling_params(req: SamplingFields, names: ParamNames, *, max_tokens: int,
                    logprobs: bool = False, top_logprobs: int = 0,
                    prompt_logprobs: int | None = None) -> SamplingParams:
    """Build and validate the engine parameters; raises ApiError(400) naming the parameter."""
    if req.stream_options is not None and not req.stream:
        raise ApiError.bad_request("stream_options is only allowed with stream=true",
                                   param="stream_options")
    params = SamplingParams(
        strategy=strategy_for(req),
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k or 0,
        min_p=req.min_p or 0.0,
        seed=req.seed,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        logit_bias=logit_bias_ids(req.logit_bias),
        max_new_tokens=max_tokens,
        min_new_tokens=req.min_tokens or 0,
        stop=stop_list(req.stop),
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=bool(req.ignore_eos),
        n=1 if req.n is None else req.n,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        prompt_logprobs=prompt_logprobs,
        skip_special_tokens=True if req.skip_special_tokens is None else req.skip_special_tokens,
        priority=req.priority or 0,
    )
    return validated(params, req.penalty_alpha, names)


def validated(params: SamplingParams, penalty_alpha: float | None,
              names: ParamNames) -> SamplingParams:
    """`params` (with the request's contrastive `penalty_alpha`, if it gave one) checked by
    their owner, SamplingParams.validate; a 400 naming the parameter as the protocol does."""
    if penalty_alpha is not None:
        params.penalty_alpha = penalty_alpha
    try:
        params.validate()
    except InvalidParams as exc:
        raise from_engine_error(exc, names) from None
    return params


def max_tokens_for(requested: int | None, prompt_len: int, max_model_len: int,
                   names: ParamNames, limit: int = 0) -> int:
    """The completion budget: as asked, or (None) whatever the context has left, like vLLM;
    never more than the server's `limit` (--max-tokens-limit; 0: none). A budget under 1 is
    refused by SamplingParams.validate.

    Raises ApiError(400) when the request asks for more than the limit, and
    ApiError(400, context_length_exceeded) when the prompt and budget do not fit.
    """
    check_token_limit(requested, limit, names("max_new_tokens"))
    budget = requested if requested is not None else max(max_model_len - prompt_len, 1)
    if limit:
        budget = min(budget, limit)
    try:
        check_context(prompt_len, budget, max_model_len)
    except InvalidParams as exc:
        raise from_engine_error(exc, names) from None
    return budget


def check_token_limit(requested: int | None, limit: int, param: str) -> None:
    """400 when a request asks to generate more than the server allows (0: no limit)."""
    if limit and requested is not None and requested > limit:
        raise ApiError.bad_request(f"{param} must be at most {limit} on this server "
                                   f"(--max-tokens-limit), got {requested}", param=param)


def openai_finish_reason(reason: str | None) -> str | None:
    """Engine finish reasons that reach a client are OpenAI's; others are errors upstream."""
    return reason if reason in (None, "stop", "length") else "stop"
