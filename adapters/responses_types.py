"""OpenAI Responses API wire types (POST /v1/responses and its stream events) as msgspec structs.

The request inherits chat's sampling fields, so our extras (top_k, seed, stop, guided_*...) work
here as they do on /v1/chat/completions. Input items stay plain JSON until the adapter checks
them (adapters/openai_responses.py), which names the offending item (`input[2].call_id`) as
msgspec could not. Output items, the response object and the events follow OpenAI's schema:
fields it requires are always present, null where they have no value.
"""

from __future__ import annotations

from typing import Any, Literal

from msgspec import UNSET, Struct, UnsetType

from adapters.openai_types import SamplingFields

# -- the request ------------------------------------------------------------------------------


class ResponsesRequest(SamplingFields, kw_only=True):
    """POST /v1/responses."""

    input: str | list[Any] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    stream_options: dict[str, Any] | None = None  # Responses' own (include_obfuscation)
    store: bool | None = None
    previous_response_id: str | None = None
    # Accepted so they can be refused by name (or ignored where harmless, see the adapter).
    background: bool | None = None
    conversation: Any | None = None
    prompt: Any | None = None
    truncation: str | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None
    reasoning: Any | None = None
    service_tier: str | None = None
    max_tool_calls: int | None = None


# -- output items -----------------------------------------------------------------------------


class OutputText(Struct, tag="output_text", tag_field="type"):
    text: str
    annotations: list[Any] = []
    logprobs: list[Any] = []


class OutputMessage(Struct, tag="message", tag_field="type"):
    id: str
    status: str  # in_progress | completed | incomplete
    content: list[OutputText]
    role: Literal["assistant"] = "assistant"


class FunctionCallItem(Struct, tag="function_call", tag_field="type"):
    id: str
    call_id: str
    name: str
    arguments: str  # JSON text
    status: str = "completed"


class ReasoningText(Struct, tag="reasoning_text", tag_field="type"):
    text: str


class ReasoningItem(Struct, kw_only=True, tag="reasoning", tag_field="type"):
    """The thinking before the answer, where a reasoning parser split it off; no summary is
    written, so `summary` stays empty."""

    id: str
    summary: list[Any] = []
    content: list[ReasoningText]
    status: str = "completed"  # in_progress | completed | incomplete


OutputItem = OutputMessage | FunctionCallItem | ReasoningItem


# -- the response object ----------------------------------------------------------------------


class InputTokensDetails(Struct):
    cached_tokens: int
    cache_write_tokens: int


class OutputTokensDetails(Struct):
    reasoning_tokens: int = 0


class ResponseUsage(Struct):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(Struct):
    reason: str  # max_output_tokens


class ResponseErrorInfo(Struct):
    code: str
    message: str


class ResponseObject(Struct, kw_only=True):
    """The `response` object: what POST answers, GET returns, and the lifecycle events carry."""

    id: str
    created_at: int
    model: str
    status: str  # in_progress | completed | incomplete | cancelled | failed
    output: list[OutputItem]
    usage: ResponseUsage | UnsetType = UNSET  # absent until it has finished
    instructions: str | None
    max_output_tokens: int | None
    previous_response_id: str | None
    temperature: float | None
    top_p: float | None
    tools: list[dict[str, Any]]
    tool_choice: str | dict[str, Any]
    parallel_tool_calls: bool
    text: dict[str, Any]
    metadata: dict[str, str]
    user: str | UnsetType = UNSET  # absent unless sent (OpenAI's schema allows no null here)
    error: ResponseErrorInfo | None = None
    incomplete_details: IncompleteDetails | None = None
    completed_at: int | None = None
    background: bool = False
    truncation: str = "disabled"
    reasoning: dict[str, Any] | None = None  # {"effort", "summary"} as the request set them
    object: Literal["response"] = "response"


class ResponseItemList(Struct):
    """GET /v1/responses/{id}/input_items."""

    data: list[dict[str, Any]]
    has_more: bool
    first_id: str | None
    last_id: str | None
    object: Literal["list"] = "list"


class DeletedResponse(Struct):
    id: str
    deleted: bool = True
    object: Literal["response.deleted"] = "response.deleted"


# -- stream events ----------------------------------------------------------------------------


class LifecycleEvent(Struct, kw_only=True):
    """response.created / in_progress / completed / incomplete: the whole response so far."""

    type: str
    response: ResponseObject
    sequence_number: int


class OutputItemEvent(Struct, kw_only=True):
    """response.output_item.added / done."""

    type: str
    output_index: int
    item: OutputItem
    sequence_number: int


class ContentPartEvent(Struct, kw_only=True):
    """response.content_part.added / done."""

    type: str
    item_id: str
    output_index: int
    content_index: int
    part: OutputText
    sequence_number: int


class _TextEvent(Struct, kw_only=True):
    """What the output_text events have in common: where the text part is."""

    item_id: str
    output_index: int
    content_index: int
    sequence_number: int
    logprobs: list[Any] = []


class TextDeltaEvent(_TextEvent, kw_only=True):
    """response.output_text.delta."""

    delta: str
    type: Literal["response.output_text.delta"] = "response.output_text.delta"


class TextDoneEvent(_TextEvent, kw_only=True):
    """response.output_text.done: the message's whole text."""

    text: str
    type: Literal["response.output_text.done"] = "response.output_text.done"


class _ArgumentsEvent(Struct, kw_only=True):
    """What the function_call_arguments events have in common: which call."""

    item_id: str
    output_index: int
    sequence_number: int


class ArgumentsDeltaEvent(_ArgumentsEvent, kw_only=True):
    """response.function_call_arguments.delta (a call's arguments arrive whole, in one)."""

    delta: str
    type: Literal["response.function_call_arguments.delta"] = \
        "response.function_call_arguments.delta"


class ArgumentsDoneEvent(_ArgumentsEvent, kw_only=True):
    """response.function_call_arguments.done."""

    name: str
    arguments: str
    type: Literal["response.function_call_arguments.done"] = \
        "response.function_call_arguments.done"


class _ReasoningEvent(Struct, kw_only=True):
    """What the reasoning_text events have in common: where the reasoning text is."""

    item_id: str
    output_index: int
    content_index: int
    sequence_number: int


class ReasoningDeltaEvent(_ReasoningEvent, kw_only=True):
    """response.reasoning_text.delta."""

    delta: str
    type: Literal["response.reasoning_text.delta"] = "response.reasoning_text.delta"


class ReasoningDoneEvent(_ReasoningEvent, kw_only=True):
    """response.reasoning_text.done: the item's whole thinking."""

    text: str
    type: Literal["response.reasoning_text.done"] = "response.reasoning_text.done"


class ErrorEvent(Struct, kw_only=True):
    """`error`: a failure after the stream began (the headers are gone)."""

    code: str | None
    message: str
    param: str | None
    sequence_number: int
    type: Literal["error"] = "error"


ResponseStreamEvent = (LifecycleEvent | OutputItemEvent | ContentPartEvent | TextDeltaEvent
                       | TextDoneEvent | ArgumentsDeltaEvent | ArgumentsDoneEvent
                       | ReasoningDeltaEvent | ReasoningDoneEvent | ErrorEvent)
