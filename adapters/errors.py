"""Errors in OpenAI's envelope: `{"error": {"message", "type", "param", "code"}}`, and the one
place where engine outcomes and the gateway's refusals become HTTP errors.

`code` is always a string: the openai SDK and LangChain surface only what is in the envelope, and
LangChain recognises a context overflow only by the text `context_length_exceeded` or "maximum
context length" in the message. Headers tell the SDK whether a retry can help: `Retry-After` on
429/503, `x-should-retry: false` on errors that a retry would only repeat.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from engine import (
    ContextLengthExceeded,
    EngineStopped,
    EngineUnavailable,
    InvalidParams,
    JobDelta,
    KvBudgetExceeded,
    QueueFull,
)

# Error types by status, as OpenAI names them.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}

# Seconds a client should wait before retrying a refused request.
QUEUE_FULL_RETRY_AFTER = 1
DRAINING_RETRY_AFTER = 5
LOADING_RETRY_AFTER = DRAINING_RETRY_AFTER


@dataclass
class ApiError(Exception):
    """An error answered to the client in OpenAI's envelope, with its HTTP status and headers."""

    status: int
    message: str
    code: str
    param: str | None = None
    type: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__init__(self.message)
        self.type = self.type or _TYPES.get(self.status, "invalid_request_error"
                                            if self.status < 500 else "server_error")
        # 4xx other than 408/409/429 repeat on retry; the SDK retries only when told it can help.
        if 400 <= self.status < 500 and self.status not in (408, 409, 429):
            self.headers.setdefault("x-should-retry", "false")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    @classmethod
    def bad_request(cls, message: str, param: str | None = None,
                    code: str = "invalid_value") -> ApiError:
        return cls(400, message, code, param)

    @classmethod
    def unsupported(cls, param: str, detail: str = "") -> ApiError:
        return cls(400, f"The parameter '{param}' is not supported by this server{detail}.",
                   "unsupported_parameter", param)

    @classmethod
    def model_not_found(cls, model: str, served: str) -> ApiError:
        return cls(404, f"The model '{model}' does not exist. This server serves '{served}'.",
                   "model_not_found", "model")


@dataclass(frozen=True)
class ParamNames:
    """How a protocol names the engine's parameters: `renamed` where it differs, else the
    engine's name behind `prefix`."""

    renamed: Mapping[str, str]
    prefix: str = ""

    def __call__(self, engine_name: str) -> str:
        return self.renamed.get(engine_name) or self.prefix + engine_name

    def renaming(self, **renamed: str) -> ParamNames:
        """These names, with `renamed` on top (a request that used an alternative field)."""
        return ParamNames({**self.renamed, **renamed}, self.prefix)


_OPENAI_TOKENS = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}
CHAT_NAMES = ParamNames({**_OPENAI_TOKENS, "prompt": "messages"})
COMPLETION_NAMES = ParamNames(_OPENAI_TOKENS)
DJL_NAMES = ParamNames({"prompt": "inputs"}, prefix="parameters.")


def from_engine_error(exc: Exception, names: ParamNames) -> ApiError:
    """Translate an engine exception (from `SamplingParams.validate`, `check_context` or
    `Engine.submit`) into the API error it means, the parameter named as `names` says."""
    if isinstance(exc, InvalidParams):
        param = names(exc.param)
        # A job too large for the KV cache is, to a client, a context too long for this server.
        code = "context_length_exceeded" if isinstance(
            exc, (ContextLengthExceeded, KvBudgetExceeded)) else "invalid_value"
        return ApiError(400, exc.message_for(param), code, param)
    if isinstance(exc, QueueFull):
        return ApiError(429, f"The server is at capacity: {exc}.", "rate_limit_exceeded",
                        headers={"Retry-After": str(QUEUE_FULL_RETRY_AFTER)})
    if isinstance(exc, EngineStopped):
        return draining_error()
    if isinstance(exc, EngineUnavailable):
        return ApiError(503, f"The engine is unavailable: {exc}.", "service_unavailable",
                        headers={"Retry-After": "1"})
    return ApiError(500, f"Internal error: {type(exc).__name__}: {exc}", "internal_error")


def job_outcome_error(delta: JobDelta) -> ApiError | None:
    """The error a job's last delta means, if any: a generation error, or an abort the client
    did not ask for (the engine was stopped)."""
    if delta.finish_reason == "error":
        return generation_error(delta.error, delta.error_cause)
    if delta.finish_reason == "abort":
        return ApiError(503, "The job was cancelled: the server is shutting down.",
                        "service_unavailable")
    return None


def missing_api_key() -> ApiError:
    return ApiError(401, "Missing API key: send it as 'Authorization: Bearer <key>' (or "
                    "'x-api-key: <key>').", "invalid_api_key")


def invalid_api_key() -> ApiError:
    return ApiError(401, "Incorrect API key provided.", "invalid_api_key")


def too_many_for_key(limit: int) -> ApiError:
    return ApiError(429, f"Too many concurrent requests for this API key (at most {limit} at a "
                    "time, --max-concurrent-per-key); retry when one has finished.",
                    "rate_limit_exceeded", headers={"Retry-After": str(QUEUE_FULL_RETRY_AFTER)})


def model_load_failed() -> ApiError:
    return ApiError(503, "The model failed to load; the server is exiting.",
                    "service_unavailable")


def model_loading() -> ApiError:
    return ApiError(503, "The model is still loading; retry shortly.", "service_unavailable",
                    headers={"Retry-After": str(LOADING_RETRY_AFTER)})


def prompt_too_long(max_model_len: int, found: str, param: str) -> ApiError:
    """A prompt refused before tokenizing it whole (adapters/prompt_size.py)."""
    return ApiError(400, f"This model's maximum context length is {max_model_len} tokens. "
                    f"However, your prompt is {found}. Please reduce the prompt. "
                    "(context_length_exceeded)", "context_length_exceeded", param)


def draining_error() -> ApiError:
    return ApiError(503, "The server is shutting down and accepts no new requests.",
                    "service_unavailable", headers={"Retry-After": str(DRAINING_RETRY_AFTER)})


def request_timeout_error(seconds: float) -> ApiError:
    """The request ran past the server's --request-timeout; its jobs were cancelled. The same
    request would time out again, so the SDK is told not to retry."""
    return ApiError(408, f"The request did not finish within this server's request timeout of "
                    f"{seconds:g} s (--request-timeout) and was cancelled.", "request_timeout",
                    headers={"x-should-retry": "false"})


def generation_error(message: str | None, cause: str | None = None) -> ApiError:
    """A job that failed inside the engine (finish_reason 'error'): a 500, unless the request
    was the cause (`JobDelta.error_cause`)."""
    if cause == "grammar":
        reason = (message or "").partition("\n")[0]  # llguidance appends its parser state
        return ApiError(400, "The output cannot follow the request's grammar (guided_*, "
                        f"response_format or tools) with this model's tokenizer: {reason}",
                        "invalid_value")
    return ApiError(500, f"Generation failed: {message or 'internal engine error'}",
                    "generation_failed")
