"""The Responses API's answers, made from chat's: the `response` object from a chat completion,
and the typed stream events from chat's stream chunks (the same tool-call parsing and finish
reasons as /v1/chat/completions, so both APIs answer alike).

Events follow OpenAI's order: response.created, response.in_progress; per output item
output_item.added, then for a message content_part.added, output_text.delta..., output_text.done,
content_part.done, or for a function call function_call_arguments.delta and .done; then
output_item.done; last response.completed (response.incomplete when max_output_tokens cut it).
Every event carries its sequence_number, counted from 0.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from msgspec import UNSET

from adapters.errors import ApiError
from adapters.openai_responses import new_id
from adapters.openai_types import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatResponseMessage,
    ToolCallDelta,
    Usage,
)
from adapters.responses_types import (
    ArgumentsDeltaEvent,
    ArgumentsDoneEvent,
    ContentPartEvent,
    ErrorEvent,
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    LifecycleEvent,
    OutputItem,
    OutputItemEvent,
    OutputMessage,
    OutputText,
    OutputTokensDetails,
    ResponseErrorInfo,
    ResponseObject,
    ResponsesRequest,
    ResponseStreamEvent,
    ResponseUsage,
    TextDeltaEvent,
    TextDoneEvent,
)


def response_usage(usage: Usage, caching: bool) -> ResponseUsage:
    """Chat's usage as the Responses API counts it. With the prefix cache on, every prompt
    token it did not supply is written to it (engine/sched/caching.py caches every prompt)."""
    cached = usage.prompt_tokens_details.cached_tokens
    written = usage.prompt_tokens - cached if caching else 0
    return ResponseUsage(input_tokens=usage.prompt_tokens,
                         input_tokens_details=InputTokensDetails(cached, written),
                         output_tokens=usage.completion_tokens,
                         output_tokens_details=OutputTokensDetails(),
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


def _call_item(call_id: str, name: str, arguments: str) -> FunctionCallItem:
    return FunctionCallItem(id=new_id("fc"), call_id=call_id, name=name, arguments=arguments)


def _message_item(text: str, status: str) -> OutputMessage:
    return OutputMessage(id=new_id("msg"), status=status, content=[OutputText(text)])


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
    calls = [_call_item(c.id, c.function.name, c.function.arguments)
             for c in message.tool_calls or ()]
    text = message.content or ""
    output: list[OutputItem] = []
    if text or not calls:
        output.append(_message_item(text, "incomplete" if status != "completed" else status))
    output += calls
    return Answer(draft.response(status, output, completion.usage), assistant_turn(text, calls))


@dataclass
class ResponseEvents:
    """Turns chat's stream chunks into the Responses API's events, numbering them."""

    draft: ResponseDraft
    output: list[OutputItem] = field(default_factory=list)
    seq: int = 0
    message: OutputMessage | None = None  # the message item being streamed
    texts: list[str] = field(default_factory=list)
    finish: str | None = None
    usage: Usage | None = None
    answer: Answer | None = None  # once finished

    def _n(self) -> int:
        self.seq += 1
        return self.seq - 1

    def _lifecycle(self, kind: str, response: ResponseObject) -> LifecycleEvent:
        return LifecycleEvent(type=f"response.{kind}", response=response,
                              sequence_number=self._n())

    def start(self) -> list[ResponseStreamEvent]:
        snapshot = self.draft.response()
        return [self._lifecycle("created", snapshot), self._lifecycle("in_progress", snapshot)]

    def on_chunk(self, chunk: ChatCompletionChunk) -> list[ResponseStreamEvent]:
        if chunk.usage:
            self.usage = chunk.usage
        events: list[ResponseStreamEvent] = []
        for choice in chunk.choices:
            if choice.delta.content:
                events += self._text(choice.delta.content)
            for call in choice.delta.tool_calls or ():
                events += self._call(call)
            if choice.finish_reason is not None:
                self.finish = choice.finish_reason
        return events

    def _part(self, kind: str) -> ContentPartEvent:
        return ContentPartEvent(type=f"response.content_part.{kind}", item_id=self.message.id,
                                output_index=len(self.output) - 1, content_index=0,
                                part=OutputText("".join(self.texts)), sequence_number=self._n())

    def _open_message(self) -> list[ResponseStreamEvent]:
        self.message = OutputMessage(id=new_id("msg"), status="in_progress", content=[])
        self.output.append(self.message)
        added = OutputItemEvent(type="response.output_item.added",
                                output_index=len(self.output) - 1, item=self._copy(self.message),
                                sequence_number=self._n())
        return [added, self._part("added")]

    @staticmethod
    def _copy(item: OutputMessage) -> OutputMessage:
        return OutputMessage(item.id, item.status, list(item.content))

    def _text(self, delta: str) -> list[ResponseStreamEvent]:
        events = self._open_message() if self.message is None else []
        self.texts.append(delta)
        events.append(TextDeltaEvent(item_id=self.message.id, output_index=len(self.output) - 1,
                                     content_index=0, delta=delta, sequence_number=self._n()))
        return events

    def _close_message(self, status: str) -> list[ResponseStreamEvent]:
        if self.message is None:
            return []
        text, index = "".join(self.texts), len(self.output) - 1
        done = TextDoneEvent(item_id=self.message.id, output_index=index, content_index=0,
                             text=text, sequence_number=self._n())
        part = self._part("done")
        self.message.content, self.message.status = [OutputText(text)], status
        item = OutputItemEvent(type="response.output_item.done", output_index=index,
                               item=self.message, sequence_number=self._n())
        self.message = None
        return [done, part, item]

    def _call(self, call: ToolCallDelta) -> list[ResponseStreamEvent]:
        events = self._close_message("completed")
        item = _call_item(call.id, call.function.name, call.function.arguments)
        self.output.append(item)
        index = len(self.output) - 1
        pending = FunctionCallItem(item.id, item.call_id, item.name, "", "in_progress")
        events += [
            OutputItemEvent(type="response.output_item.added", output_index=index, item=pending,
                            sequence_number=self._n()),
            ArgumentsDeltaEvent(item_id=item.id, output_index=index, delta=item.arguments,
                                sequence_number=self._n()),
            ArgumentsDoneEvent(item_id=item.id, output_index=index, name=item.name,
                               arguments=item.arguments, sequence_number=self._n()),
            OutputItemEvent(type="response.output_item.done", output_index=index, item=item,
                            sequence_number=self._n())]
        return events

    def close(self, cancelled: bool = False) -> list[ResponseStreamEvent]:
        """The events that end the stream: the open message closed (an empty one when the
        answer had nothing to show), then response.completed or response.incomplete (a
        cancelled response ends with response.failed, its status `cancelled`)."""
        status = status_of(self.finish, cancelled)
        events: list[ResponseStreamEvent] = []
        if self.message is None and not self.output:
            events += self._open_message()
        text = "".join(self.texts)
        events += self._close_message("completed" if status == "completed" else "incomplete")
        calls = [i for i in self.output if isinstance(i, FunctionCallItem)]
        self.answer = Answer(self.draft.response(status, self.output, self.usage),
                             assistant_turn(text, calls))
        kind = {"completed": "completed", "incomplete": "incomplete"}.get(status, "failed")
        return [*events, self._lifecycle(kind, self.answer.response)]

    def error(self, err: ApiError) -> list[ResponseStreamEvent]:
        return [ErrorEvent(code=err.code, message=err.message, param=err.param,
                           sequence_number=self._n())]
