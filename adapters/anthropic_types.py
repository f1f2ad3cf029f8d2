"""Anthropic Messages API wire types (POST /v1/messages, /v1/messages/count_tokens) as msgspec
structs.

Requests keep content blocks, system blocks and tools as plain JSON: adapters/anthropic_messages.py
checks them block by block, so that an error names the block (`messages[2].content[0].type`)
rather than repeating a decoder's message. Responses and stream events are typed, the blocks
tagged by `type` as Anthropic's SDK reads them.
"""

from __future__ import annotations

from typing import Any, Literal

from msgspec import Struct


class AnthropicMessage(Struct, kw_only=True):
    role: str
    content: str | list[Any]


class CountTokensRequest(Struct, kw_only=True):
    """POST /v1/messages/count_tokens: what the prompt of a Messages request is made of."""

    messages: list[AnthropicMessage]
    model: str | None = None
    system: str | list[Any] | None = None
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None
    # {"type": "enabled", "budget_tokens"} or {"type": "disabled"}: the template's
    # enable_thinking (adapters/anthropic_thinking.py), which changes the prompt.
    thinking: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest, kw_only=True):
    """POST /v1/messages. `max_tokens` is required, as Anthropic's API requires it."""

    max_tokens: int
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop_sequences: list[str] | None = None
    stream: bool | None = None
    metadata: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None  # `format`: structured outputs; `effort` ignored


# -- responses --------------------------------------------------------------------------------


class ThinkingBlock(Struct, tag_field="type", tag="thinking"):
    """A reasoning model's thinking, where a reasoning parser split it off the answer."""

    thinking: str
    signature: str


class TextBlock(Struct, tag_field="type", tag="text"):
    text: str


class ToolUseBlock(Struct, tag_field="type", tag="tool_use"):
    id: str
    name: str
    input: dict[str, Any]


ContentBlock = ThinkingBlock | TextBlock | ToolUseBlock


class MessagesUsage(Struct):
    """Anthropic counts cached prompt tokens apart: `input_tokens` excludes them."""

    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int
    cache_creation_input_tokens: int = 0


class MessageResponse(Struct):
    id: str
    model: str
    content: list[ContentBlock]
    stop_reason: str | None
    stop_sequence: str | None
    usage: MessagesUsage
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"


class CountTokensResponse(Struct):
    input_tokens: int


class ErrorDetail(Struct):
    type: str
    message: str


class ErrorResponse(Struct):
    """Anthropic's error shape."""

    error: ErrorDetail
    type: Literal["error"] = "error"


# -- stream events (each goes out as `event: <type>`) ------------------------------------------


class MessageStart(Struct):
    message: MessageResponse
    type: Literal["message_start"] = "message_start"


class ContentBlockStart(Struct):
    index: int
    content_block: ContentBlock
    type: Literal["content_block_start"] = "content_block_start"


class TextDelta(Struct, tag_field="type", tag="text_delta"):
    text: str


class InputJsonDelta(Struct, tag_field="type", tag="input_json_delta"):
    partial_json: str


class ThinkingDelta(Struct, tag_field="type", tag="thinking_delta"):
    thinking: str


class SignatureDelta(Struct, tag_field="type", tag="signature_delta"):
    """A thinking block's signature, sent just before the block stops."""

    signature: str


class ContentBlockDelta(Struct):
    index: int
    delta: TextDelta | InputJsonDelta | ThinkingDelta | SignatureDelta
    type: Literal["content_block_delta"] = "content_block_delta"


class ContentBlockStop(Struct):
    index: int
    type: Literal["content_block_stop"] = "content_block_stop"


class StopDelta(Struct):
    stop_reason: str
    stop_sequence: str | None


class MessageDelta(Struct):
    """The end of the answer; `usage` carries the final counts (the SDK overwrites with them)."""

    delta: StopDelta
    usage: MessagesUsage
    type: Literal["message_delta"] = "message_delta"


class MessageStop(Struct):
    type: Literal["message_stop"] = "message_stop"


class Ping(Struct):
    type: Literal["ping"] = "ping"
