"""Every exception the engine raises to its callers, in one place.

Each carries what a caller needs to act on it (the parameter, the value, the limit); the app maps
them to HTTP in one table (adapters/errors.py).
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field, the value and the limit."""

    def __init__(self, field_name: str, value: object, expected: str):
        self.field = field_name
        self.value = value
        super().__init__(f"{field_name}={value!r} is invalid: expected {expected}")


class ModelLoadError(RuntimeError):
    """The model named in the configuration cannot be found or loaded; the message says which and
    why."""


class InvalidParams(ValueError):
    """A job parameter is out of range. `param` is the engine's name for it (`max_new_tokens`,
    `prompt`, ...); `message` may say `{param}` where the name goes (once, before anything the
    client sent), so that an adapter can speak its protocol's name instead (`message_for`)."""

    def __init__(self, param: str, message: str):
        self.param = param
        self.template = message
        super().__init__(self.message_for(param))

    def message_for(self, name: str) -> str:
        # Not str.format, and the first `{param}` only: the message may quote what the client
        # sent, braces included, after the name.
        return self.template.replace("{param}", name, 1)


class ContextLengthExceeded(InvalidParams):
    """Prompt plus requested tokens do not fit the model's context (`param` is the prompt)."""

    def __init__(self, prompt_tokens: int, max_new_tokens: int, limit: int):
        self.prompt_tokens, self.max_new_tokens, self.limit = prompt_tokens, max_new_tokens, limit
        super().__init__(
            "prompt",
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_tokens + max_new_tokens} tokens ({prompt_tokens} in the prompt, "
            f"{max_new_tokens} for the completion). Please reduce the prompt or the completion "
            f"length. (context_length_exceeded)",
        )


class KvBudgetExceeded(InvalidParams):
    """A job whose KV could not fit the engine's KV budget even alone: `n` rows of up to
    `row_tokens` tokens each (its prompt, `max_new_tokens`, contrastive candidates) over the
    `limit` tokens the rolling batch may hold. `param` is what to reduce: the prompt when it
    alone does not fit, else `n` or `max_new_tokens`."""

    def __init__(self, param: str, prompt_tokens: int, max_new_tokens: int, n: int,
                 row_tokens: int, limit: int):
        self.prompt_tokens, self.max_new_tokens, self.n = prompt_tokens, max_new_tokens, n
        self.row_tokens, self.limit = row_tokens, limit
        rows = f"{n} sequences of up to {row_tokens} tokens" if n > 1 else \
            f"up to {row_tokens} tokens"
        super().__init__(
            param,
            f"{{param}} is too large for this server's KV cache: the request may hold {rows} of "
            f"KV ({prompt_tokens} in the prompt, {max_new_tokens} for the completion), and the "
            f"cache holds at most {limit} tokens for one request (its memory budget: "
            f"--kv-cache-bytes or --gpu-memory-utilization). Please reduce the prompt or the "
            f"completion length. (context_length_exceeded)",
        )

    def __reduce__(self):  # rebuilt from its figures when it crosses processes (replicas)
        return KvBudgetExceeded, (self.param, self.prompt_tokens, self.max_new_tokens, self.n,
                                  self.row_tokens, self.limit)


class InvalidGrammar(InvalidParams):
    """A grammar llguidance cannot compile; the message says why (the adapter names the
    parameter that carried it)."""

    def __init__(self, reason: str):
        super().__init__("grammar", f"{{param}} is not a valid grammar: {reason}")
        self.reason = reason


class QueueFull(RuntimeError):
    """The wait queue is at `job_queue_size`; the request is refused (HTTP 429), never dropped."""

    def __init__(self, queue_size: int):
        self.queue_size = queue_size
        super().__init__(f"the job queue is full ({queue_size} waiting); retry later")

    def __reduce__(self):  # rebuilt from queue_size when it crosses processes (replicas)
        return QueueFull, (self.queue_size,)


class EngineStopped(RuntimeError):
    """The engine is draining or stopped and admits no new jobs."""


class EngineUnavailable(RuntimeError):
    """The engine that was to run a job is gone (a remote replica died); retrying may succeed."""


def out_of_memory(exc: BaseException) -> bool:
    """Whether `exc` is an allocation failure: CUDA's (torch.OutOfMemoryError), Python's, or the
    CPU allocator's (a RuntimeError that says so)."""
    import torch  # here: the rest of this module is imported by the app without torch

    return isinstance(exc, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc))
