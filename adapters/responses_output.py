"""The Responses API's answer, made from chat's: the `response` object from a chat completion
(adapters/responses_events.py makes the stream's events from chat's stream chunks), with the
same tool-call parsing, reasoning split and finish reasons as /v1/chat/completions, so both APIs
answer alike. Where a reasoning parser split off the thinking, a `reasoning` item precedes the
message.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from msgspec import UNSET

from adapters.errors import ApiError
from adapters.openai_types import ChatCompletionResponse, ChatResponseMessage, Usage
from adapters.responses_input import new_id
from adapters.responses_types import (
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    OutputItem,
    OutputMessage,
    OutputText,
    OutputTokensDetails,
    ReasoningItem,
    ReasoningText,
    ResponseErrorInfo,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)


def response_usage(usage: Usage, caching: bool) -> ResponseUsage:
    """Chat's usage as the Responses API counts it. With the prefix cache on, every prompt
    token it did not supply is written to it (engine/sched/caching.py caches every prompt)."""
    cached = usage.prompt_tokens_details.cached_tokens
    written = usage.prompt_tokens - cached if caching else 0
    details = usage.completion_tokens_details  # unset without a reasoning parser
    return ResponseUsage(input_tokens=usage.prompt_tokens,
                         input_tokens_details=InputTokensDetails(cached, written),
                         output_tokens=usage.completion_tokens,
                         output_tokens_details=OutputTokensDetails(
                             details.reasoning_tokens if details else 0),
                         total_tokens=usage.total_tokens)


def _echo_tools(tools: list[Any] | None) -> list[dict[str, Any]]:
    # `strict`: arguments always follow their schema here (the tools grammar), asked or not.
    return [{"type": "function", "name": t.get("name"), "description": t.get("description"),
             "parameters": t.get("parameters"), "strict": True} for t in tools or ()]


@dataclass
class ResponseDraft:
    """What every state of one response repeats: its id, and the request's settings echoed."""

    id: str
    created_at: int
    model: str
    echo: dict[str, Any]
    caching: bool  # the prefix cache is on (usage's cache_write_tokens)

    @classmethod
    def of(cls, req: ResponsesRequest, model: str, caching: bool) -> ResponseDraft:
        fmt = (req.text or {}).get("format") or {"type": "text"}
        echo = {"instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
                "previous_response_id": req.previous_response_id,
                "temperature": req.temperature, "top_p": req.top_p,
                "tools": _echo_tools(req.tools), "tool_choice": req.tool_choice or "auto",
                "parallel_tool_calls": req.parallel_tool_calls is not False,
                "text": {"format": fmt}, "metadata": dict(req.metadata or {}),
                # No summary is written, whatever the request asked (OpenAI's null: none).
                "reasoning": {"effort": (req.reasoning or {}).get("effort"), "summary": None},
                "user": UNSET if req.user is None else req.user}
        return cls(new_id("resp"), int(time.time()), model, echo, caching)

    def response(self, status: str = "in_progress", output: list[OutputItem] | None = None,
                 usage: Usage | None = None, error: ApiError | None = None) -> ResponseObject:
        finished = status in ("completed", "incomplete")
        return ResponseObject(
            id=self.id, created_at=self.created_at, model=self.model, status=status,
            output=list(output or ()), **self.echo,
            usage=response_usage(usage, self.caching) if usage is not None else UNSET,
            error=ResponseErrorInfo("server_error", error.message) if error else None,
            incomplete_details=IncompleteDetails("max_output_tokens")
            if status == "incomplete" else None,
            completed_at=int(time.time()) if finished else None)


def status_of(finish: str | None, cancelled: bool) -> str:
    """The response's status from its chat finish reason (None: it never finished)."""
    if cancelled or finish is None:
        return "cancelled"
    return "incomplete" if finish == "length" else "completed"


def assistant_turn(text: str, calls: list[FunctionCallItem]) -> dict[str, Any]:
    """The answer as a chat message, for the stored conversation."""
    turn: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
    if calls:
        turn["tool_calls"] = [{"id": c.call_id, "type": "function",
                               "function": {"name": c.name, "arguments": c.arguments}}
                              for c in calls]
    return turn


def call_item(call_id: str, name: str, arguments: str) -> FunctionCallItem:
    return FunctionCallItem(id=new_id("fc"), call_id=call_id, name=name, arguments=arguments)


def message_item(text: str, status: str) -> OutputMessage:
    return OutputMessage(id=new_id("msg"), status=status, content=[OutputText(text)])


def reasoning_item(text: str, status: str) -> ReasoningItem:
    return ReasoningItem(id=new_id("rs"), content=[ReasoningText(text)], status=status)


@dataclass
class Answer:
    """A finished response and the assistant turn it adds to the conversation."""

    response: ResponseObject
    turn: dict[str, Any]


def from_chat(draft: ResponseDraft, completion: ChatCompletionResponse,
              finish: str | None, cancelled: bool = False) -> Answer:
    """The response a (non-streamed) chat completion means; `finish` is the engine's finish
    reason as chat reports it (None when the job never finished)."""
    message: ChatResponseMessage = completion.choices[0].message
    status = status_of(finish, cancelled)
    calls = [call_item(c.id, c.function.name, c.function.arguments)
             for c in message.tool_calls or ()]
    text, thought = message.content or "", message.reasoning_content or ""
    output: list[OutputItem] = []
    if thought:  # complete once the answer after it began
        output.append(reasoning_item(thought, "completed" if text or calls or
                                     status == "completed" else "incomplete"))
    if text or not calls:
        output.append(message_item(text, "incomplete" if status != "completed" else status))
    output += calls
    return Answer(draft.response(status, output, completion.usage), assistant_turn(text, calls))
