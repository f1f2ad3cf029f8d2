"""The Responses API's stream events, made from chat's stream chunks (the same tool-call parsing,
reasoning split and finish reasons as /v1/chat/completions).

Events follow OpenAI's order: response.created, response.in_progress; per output item
output_item.added, then for a reasoning item reasoning_text.delta..., reasoning_text.done, for a
message content_part.added, output_text.delta..., output_text.done, content_part.done, or for a
function call function_call_arguments.delta and .done; then output_item.done; last
response.completed (response.incomplete when max_output_tokens cut it). Every event carries its
sequence_number, counted from 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from adapters.errors import ApiError
from adapters.openai_types import ChatCompletionChunk, ToolCallDelta, Usage
from adapters.responses_input import new_id
from adapters.responses_output import (
    Answer,
    ResponseDraft,
    assistant_turn,
    call_item,
    status_of,
)
from adapters.responses_types import (
    ArgumentsDeltaEvent,
    ArgumentsDoneEvent,
    ContentPartEvent,
    ErrorEvent,
    FunctionCallItem,
    LifecycleEvent,
    OutputItem,
    OutputItemEvent,
    OutputMessage,
    OutputText,
    ReasoningDeltaEvent,
    ReasoningDoneEvent,
    ReasoningItem,
    ReasoningText,
    ResponseObject,
    ResponseStreamEvent,
    TextDeltaEvent,
    TextDoneEvent,
)


@dataclass
class ResponseEvents:
    """Turns chat's stream chunks into the Responses API's events, numbering them."""

    draft: ResponseDraft
    output: list[OutputItem] = field(default_factory=list)
    seq: int = 0
    reasoning: ReasoningItem | None = None  # the reasoning item being streamed
    thought: list[str] = field(default_factory=list)
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

    def _added(self, item: OutputItem, shown: OutputItem) -> OutputItemEvent:
        """`item` joins the output; the event shows `shown`, a copy of its state now (the item
        itself is completed in place)."""
        self.output.append(item)
        return OutputItemEvent(type="response.output_item.added",
                               output_index=len(self.output) - 1, item=shown,
                               sequence_number=self._n())

    def start(self) -> list[ResponseStreamEvent]:
        snapshot = self.draft.response()
        return [self._lifecycle("created", snapshot), self._lifecycle("in_progress", snapshot)]

    def on_chunk(self, chunk: ChatCompletionChunk) -> list[ResponseStreamEvent]:
        if chunk.usage:
            self.usage = chunk.usage
        events: list[ResponseStreamEvent] = []
        for choice in chunk.choices:
            if choice.delta.reasoning_content:
                events += self._think(choice.delta.reasoning_content)
            if choice.delta.content:
                events += self._text(choice.delta.content)
            for call in choice.delta.tool_calls or ():
                events += self._call(call)
            if choice.finish_reason is not None:
                self.finish = choice.finish_reason
        return events

    def _think(self, delta: str) -> list[ResponseStreamEvent]:
        events: list[ResponseStreamEvent] = []
        if self.reasoning is None:
            self.reasoning = ReasoningItem(id=new_id("rs"), content=[], status="in_progress")
            events.append(self._added(self.reasoning, ReasoningItem(
                id=self.reasoning.id, content=[], status="in_progress")))
        self.thought.append(delta)
        events.append(ReasoningDeltaEvent(item_id=self.reasoning.id, output_index=0,
                                          content_index=0, delta=delta,
                                          sequence_number=self._n()))
        return events

    def _close_reasoning(self, status: str) -> list[ResponseStreamEvent]:
        """The reasoning item (always the first: the thinking precedes the answer) closed."""
        if self.reasoning is None or self.reasoning.status != "in_progress":
            return []
        text = "".join(self.thought)
        done = ReasoningDoneEvent(item_id=self.reasoning.id, output_index=0, content_index=0,
                                  text=text, sequence_number=self._n())
        self.reasoning.content, self.reasoning.status = [ReasoningText(text)], status
        return [done, OutputItemEvent(type="response.output_item.done", output_index=0,
                                      item=self.reasoning, sequence_number=self._n())]

    def _part(self, kind: str) -> ContentPartEvent:
        return ContentPartEvent(type=f"response.content_part.{kind}", item_id=self.message.id,
                                output_index=len(self.output) - 1, content_index=0,
                                part=OutputText("".join(self.texts)), sequence_number=self._n())

    def _open_message(self) -> list[ResponseStreamEvent]:
        events = self._close_reasoning("completed")
        self.message = OutputMessage(id=new_id("msg"), status="in_progress", content=[])
        added = self._added(self.message, OutputMessage(self.message.id, "in_progress", []))
        return [*events, added, self._part("added")]

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
        events = self._close_reasoning("completed") + self._close_message("completed")
        item = call_item(call.id, call.function.name, call.function.arguments)
        events.append(self._added(item, FunctionCallItem(item.id, item.call_id, item.name, "",
                                                         "in_progress")))
        index = len(self.output) - 1
        events += [
            ArgumentsDeltaEvent(item_id=item.id, output_index=index, delta=item.arguments,
                                sequence_number=self._n()),
            ArgumentsDoneEvent(item_id=item.id, output_index=index, name=item.name,
                               arguments=item.arguments, sequence_number=self._n()),
            OutputItemEvent(type="response.output_item.done", output_index=index, item=item,
                            sequence_number=self._n())]
        return events

    def close(self, cancelled: bool = False) -> list[ResponseStreamEvent]:
        """The events that end the stream: open items closed (an empty message when the answer
        had nothing to show), then response.completed or response.incomplete (a cancelled
        response ends with response.failed, its status `cancelled`)."""
        status = status_of(self.finish, cancelled)
        ended = "completed" if status == "completed" else "incomplete"
        events = self._close_reasoning(ended)
        if self.message is None and not any(isinstance(i, OutputMessage | FunctionCallItem)
                                            for i in self.output):
            events += self._open_message()
        text = "".join(self.texts)
        events += self._close_message(ended)
        calls = [i for i in self.output if isinstance(i, FunctionCallItem)]
        self.answer = Answer(self.draft.response(status, self.output, self.usage),
                             assistant_turn(text, calls))
        kind = {"completed": "completed", "incomplete": "incomplete"}.get(status, "failed")
        return [*events, self._lifecycle(kind, self.answer.response)]

    def error(self, err: ApiError) -> list[ResponseStreamEvent]:
        return [ErrorEvent(code=err.code, message=err.message, param=err.param,
                           sequence_number=self._n())]
