"""OpenAI wire types as msgspec structs, and request decoding with OpenAI-style errors.

Requests: explicit `null` means absent (the SDK and LangChain send nulls for unset fields);
unknown top-level fields are reported to the caller for logging and otherwise ignored, never
rejected (rejecting them breaks LangChain). Responses: fields the OpenAI schema requires to be
present-but-null (`message.refusal`, `choices[].logprobs`, stream `finish_reason`) are encoded as
null; fields that must be absent when unused are `UNSET`.
"""

from __future__ import annotations

import re
import threading
from typing import Any, Literal, TypeVar

import msgspec
from msgspec import UNSET, Struct, UnsetType

from adapters.errors import ApiError

T = TypeVar("T", bound=Struct)

# -- requests ---------------------------------------------------------------------------------


class ContentPart(Struct, kw_only=True):
    """One part of a message's content; only `text` parts are supported."""

    type: str
    text: str | None = None


class ChatMessage(Struct, kw_only=True):
    """A chat message as clients send it, tool traffic included (adapters/openai_chat.py)."""

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None
    function_call: Any | None = None
    refusal: str | None = None


class StreamOptions(Struct, kw_only=True):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class SamplingFields(Struct, kw_only=True):
    """Parameters shared by /v1/chat/completions and /v1/completions, with our extras."""

    model: str | None = None
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Extras (vLLM / DJL names): not in OpenAI's API, accepted from any client.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    decoding_strategy: str | None = None
    penalty_alpha: float | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    priority: int | None = None  # vLLM's: lower goes first (--scheduling-policy priority)
    # vLLM's structured-output extras (adapters/structured.py): at most one per request.
    guided_json: Any | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class ChatCompletionRequest(SamplingFields, kw_only=True):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    # Tools and structured outputs (adapters/tools.py, adapters/structured.py).
    tools: list[Any] | None = None
    tool_choice: Any | None = None
    functions: list[Any] | None = None
    function_call: Any | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    # seqgate's extra: show the model the schema its answer is held to (adapters/schema_prompt.py);
    # None: the server's --schema-prompt.
    schema_prompt: bool | None = None
    # Accepted so they can be refused by name (or ignored when harmless).
    audio: Any | None = None
    modalities: list[str] | None = None
    prediction: Any | None = None
    web_search_options: Any | None = None
    echo: bool | None = None  # /v1/completions' (prompt log-probabilities are served there)
    # Passed to the chat template (a reasoning model's `enable_thinking`, ...), as vLLM does.
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    # This request's reasoning parser (adapters/reasoning.py), over the server's.
    reasoning_parser: str | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None


class CompletionRequest(SamplingFields, kw_only=True):
    """POST /v1/completions (legacy): text or token-id prompts."""

    prompt: str | list[Any]
    max_tokens: int | None = None
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None
    response_format: dict[str, Any] | None = None  # vLLM accepts it here too
    prompt_logprobs: int | None = None  # vLLM's: the prompt's log-probabilities, in the choice


class TokenizeRequest(Struct, kw_only=True):
    """POST /tokenize: text, or chat messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None


class DetokenizeRequest(Struct, kw_only=True):
    model: str | None = None
    tokens: list[int]


# -- responses --------------------------------------------------------------------------------


class PromptTokensDetails(Struct):
    cached_tokens: int = 0


class CompletionTokensDetails(Struct):
    reasoning_tokens: int = 0


class Usage(Struct, omit_defaults=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    # With a reasoning parser: how many of the completion tokens were thinking.
    completion_tokens_details: CompletionTokensDetails | UnsetType = UNSET


class TopLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprobEntry(Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(Struct):
    content: list[TokenLogprobEntry] | None
    refusal: list[TokenLogprobEntry] | None = None


class FunctionCall(Struct):
    name: str
    arguments: str  # JSON text


class ToolCall(Struct):
    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class ToolCallDelta(Struct):
    """A streamed call: sent whole, in one delta (the SDK's stream helpers accept that)."""

    index: int
    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class ChatResponseMessage(Struct):
    role: Literal["assistant"]
    content: str | None
    refusal: str | None = None
    tool_calls: list[ToolCall] | UnsetType = UNSET
    function_call: FunctionCall | UnsetType = UNSET  # the legacy `functions` answer
    # A reasoning model's thinking (adapters/reasoning.py), under vLLM's two names.
    reasoning_content: str | UnsetType = UNSET
    reasoning: str | UnsetType = UNSET


class ChatChoice(Struct):
    index: int
    message: ChatResponseMessage
    logprobs: ChoiceLogprobs | None
    finish_reason: str


class ChatCompletionResponse(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str
    object: Literal["chat.completion"] = "chat.completion"


class ChunkDelta(Struct, omit_defaults=True):
    """A stream delta: the role on the first chunk, text after, `{}` on the finishing chunk."""

    role: str | UnsetType = UNSET
    content: str | UnsetType = UNSET
    tool_calls: list[ToolCallDelta] | UnsetType = UNSET
    function_call: FunctionCall | UnsetType = UNSET
    reasoning_content: str | UnsetType = UNSET
    reasoning: str | UnsetType = UNSET


class ChunkChoice(Struct):
    index: int
    delta: ChunkDelta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(Struct):
    id: str
    created: int
    model: str
    choices: list[ChunkChoice]
    system_fingerprint: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    # Absent unless include_usage; then null on every chunk but the last, as OpenAI sends it.
    usage: Usage | None | UnsetType = UNSET


class CompletionLogprobs(Struct):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(Struct):
    """One alternative at a prompt position, as vLLM reports `prompt_logprobs`."""

    logprob: float
    rank: int | None
    decoded_token: str


class CompletionChoice(Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    # vLLM's prompt_logprobs: per prompt token (None for the first), token id -> its entry.
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | UnsetType = UNSET


class CompletionResponse(Struct):
    """A /v1/completions response; stream chunks share its shape (usage UNSET until the end)."""

    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    system_fingerprint: str
    object: Literal["text_completion"] = "text_completion"
    usage: Usage | None | UnsetType = UNSET


class ModelCard(Struct):
    id: str
    created: int
    owned_by: str
    max_model_len: int
    object: Literal["model"] = "model"


class ModelList(Struct):
    data: list[ModelCard]
    object: Literal["list"] = "list"


class TokenizeResponse(Struct):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(Struct):
    prompt: str


# -- decoding ---------------------------------------------------------------------------------

_PATH = re.compile(r"at `\$\.?(.*?)`")
_MISSING = re.compile(r"missing required field `([^`]+)`")


def _param_of(message: str) -> str | None:
    """The parameter a msgspec validation message is about, in OpenAI's dotted style."""
    path = _PATH.search(message)
    missing = _MISSING.search(message)
    parts = [path.group(1) if path else "", missing.group(1) if missing else ""]
    parts = [p for p in parts if p]
    return ".".join(parts) or None


# msgspec builds a Struct type's conversion info on its first use, and two threads converting to
# a type for the first time at once crash the process (a segmentation fault in msgspec 0.22 on
# CPython 3.11; reproduced by tests/adapters/test_openai_types.py). Requests are prepared on a
# pool of threads, so every conversion takes this lock: it costs microseconds, a crash costs
# every stream.
_CONVERT_LOCK = threading.Lock()


def convert(obj: object, type_: type[T]) -> T:
    """`msgspec.convert`, one thread at a time (see _CONVERT_LOCK)."""
    with _CONVERT_LOCK:
        return msgspec.convert(obj, type_)


def decode_request(body: bytes, type_: type[T]) -> tuple[T, list[str]]:
    """Decode a JSON request body into `type_`; returns it and the unknown top-level fields.

    Raises ApiError(400) naming the offending parameter for malformed JSON or a schema violation.
    """
    try:
        raw = msgspec.json.decode(body)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:  # JSON text is UTF-8
        raise ApiError.bad_request(f"The request body is not valid JSON: {exc}",
                                   code="invalid_json") from None
    except RecursionError:  # msgspec's own bound on nesting
        raise ApiError.bad_request("The request body nests too deeply to decode.",
                                   code="invalid_json") from None
    if not isinstance(raw, dict):
        raise ApiError.bad_request("The request body must be a JSON object.", code="invalid_json")
    known = type_.__struct_fields__
    unknown = [k for k in raw if k not in known]
    # null means absent: drop it here so every field's default applies.
    clean = {k: v for k, v in raw.items() if k in known and v is not None}
    try:
        return convert(clean, type_), unknown
    except msgspec.ValidationError as exc:
        message = str(exc)
        missing = "missing required field" in message
        code = "missing_required_parameter" if missing else "invalid_type"
        raise ApiError.bad_request(f"Invalid request: {message}", param=_param_of(message),
                                   code=code) from None
