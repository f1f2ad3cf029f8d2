"""Engine deltas → Anthropic's answer: the Message of a non-streaming request, or the named stream
events (message_start, content blocks opened, extended and stopped, message_delta, message_stop).

Under a reasoning parser the thinking is split off as chat splits it (adapters/reasoning.py) and
leads as a `thinking` block; a stream sends it as `thinking_delta`s and its `signature_delta`
before the block stops. Tool calls are parsed from the answer as chat parses them
(adapters/tools.py) and become `tool_use` blocks; a stream sends each call whole, as one
`input_json_delta`, once its block has closed. The engine says only that a sequence stopped, not
on what: a stop sequence is recognised in the decoded output, where the engine, which stops at
the first one to complete, left it.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable

from adapters.anthropic_thinking import signature
from adapters.anthropic_types import (
    ContentBlock,
    ContentBlockDelta,
    ContentBlockStart,
    ContentBlockStop,
    InputJsonDelta,
    MessageDelta,
    MessageResponse,
    MessageStart,
    MessageStop,
    MessagesUsage,
    Ping,
    SignatureDelta,
    StopDelta,
    TextBlock,
    TextDelta,
    ThinkingBlock,
    ThinkingDelta,
    ToolUseBlock,
)
from adapters.reasoning import ReasoningSplitter
from adapters.tool_syntax import ToolCall, ToolStreamParser
from adapters.tools import ToolPlan
from adapters.usage import UsageCounter
from engine import JobDelta

Decode = Callable[[list[int]], str]  # generated token ids → their text, special tokens skipped


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def matched_stop(text: str, stops: list[str]) -> str | None:
    """The stop sequence that ended `text`, by the engine's rule (engine/request/stops.py): the
    one that completes first; of two completing together, the longer."""
    ends = [(found + len(stop), -len(stop), stop) for stop in stops
            if stop and (found := text.find(stop)) >= 0]
    return min(ends)[2] if ends else None


def stop_reason(finish: str | None, calls: int, stops: list[str],
                generated: Callable[[], str]) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished answer; `generated` decodes it on demand."""
    if finish == "length":
        return "max_tokens", None
    if calls:
        return "tool_use", None
    if stops and (stop := matched_stop(generated(), stops)) is not None:
        return "stop_sequence", stop
    return "end_turn", None


def tool_use_block(call: ToolCall) -> ToolUseBlock:
    return ToolUseBlock(f"toolu_{call.id.removeprefix('call_')}", call.name,
                        json.loads(call.arguments))


class _Answer:
    """What both shapes of the answer track: usage, the generated ids, how it finished, and
    the thinking split off (`thinks` None: no reasoning parser); the thinking is shown only
    where the request enabled it (`shown`), as Anthropic returns it."""

    def __init__(self, stops: list[str], decode: Decode, thinks: bool | None,
                 shown: bool = True):
        self.shown = shown
        self.stops, self.decode = stops, decode
        self.usage = UsageCounter()
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.splitter = None if thinks is None else ReasoningSplitter.starting(thinks)
        self.thought: list[str] = []

    def track(self, delta: JobDelta) -> tuple[str, str]:
        """Count the delta; its (thinking, answer) text."""
        self.usage.add(delta)
        self.token_ids += delta.token_ids
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
        if self.splitter is None:
            return "", delta.text
        thought, text = self.splitter.feed(delta.text, len(delta.token_ids), last=delta.finished)
        thought = thought if self.shown else ""
        self.thought.append(thought)
        return thought, text

    def stop(self, calls: int) -> tuple[str, str | None]:
        return stop_reason(self.finish_reason, calls, self.stops,
                           lambda: self.decode(self.token_ids))

    def final_usage(self) -> MessagesUsage:
        total = self.usage.total()
        cached = total.prompt_tokens_details.cached_tokens
        return MessagesUsage(input_tokens=total.prompt_tokens - cached,
                             output_tokens=total.completion_tokens,
                             cache_read_input_tokens=cached)


class MessagesAssembler(_Answer):
    """Collects a job's deltas into the non-streaming Message."""

    def __init__(self, id: str, model: str, tools: ToolPlan | None, stops: list[str],
                 decode: Decode, thinks: bool | None = None, shown: bool = True):
        super().__init__(stops, decode, thinks, shown)
        self.id, self.model, self.tools = id, model, tools
        self.texts: list[str] = []

    def add(self, delta: JobDelta) -> None:
        self.texts.append(self.track(delta)[1])

    def response(self) -> MessageResponse:
        text, calls, thought = "".join(self.texts), [], "".join(self.thought)
        if self.tools is not None:
            content, calls = self.tools.syntax.parse(text)
            text = content or ""
        blocks: list[ContentBlock] = [ThinkingBlock(thought, signature(thought))] \
            if thought else []
        blocks += [TextBlock(text)] if text else []
        blocks += [tool_use_block(c) for c in calls]
        reason, sequence = self.stop(len(calls))
        return MessageResponse(self.id, self.model, blocks, reason, sequence, self.final_usage())


class MessagesChunker(_Answer):
    """Turns a job's deltas into stream events: a thinking block opens with the first thinking,
    a text block with the first text, a tool_use block per call as it completes, and the stop
    with the final usage at the end."""

    def __init__(self, id: str, model: str, prompt_tokens: int, tools: ToolPlan | None,
                 stops: list[str], decode: Decode, thinks: bool | None = None,
                 shown: bool = True):
        super().__init__(stops, decode, thinks, shown)
        self.id, self.model, self.prompt_tokens = id, model, prompt_tokens
        self.parser = ToolStreamParser(tools.syntax) if tools is not None else None
        self.blocks = 0  # blocks opened so far
        self.open: str | None = None  # the type of the last block while it is open
        self.calls = 0

    def start(self) -> list[object]:
        # The cached share of the prompt is known once the job has run; message_delta has it.
        usage = MessagesUsage(self.prompt_tokens, 0, 0)
        return [MessageStart(MessageResponse(self.id, self.model, [], None, None, usage)), Ping()]

    def on_delta(self, _: int, delta: JobDelta) -> list[object]:
        thought, text = self.track(delta)
        calls: list[ToolCall] = []
        if self.parser is not None:
            text, calls = self.parser.feed(text)
            if delta.finish_reason is not None:
                text += self.parser.finish()
        events = self._extend("thinking", ThinkingDelta(thought)) if thought else []
        events += self._extend("text", TextDelta(text)) if text else []
        for call in calls:
            events += self._call(call)
        return events

    def _extend(self, kind: str, delta: ThinkingDelta | TextDelta) -> list[object]:
        """`delta` added to the open block of its kind, opened first (the last one closed)."""
        events: list[object] = []
        if self.open != kind:
            events += self._close()
            empty = ThinkingBlock("", "") if kind == "thinking" else TextBlock("")
            events.append(ContentBlockStart(self.blocks, empty))
            self.blocks, self.open = self.blocks + 1, kind
        events.append(ContentBlockDelta(self.blocks - 1, delta))
        return events

    def _call(self, call: ToolCall) -> list[object]:
        events, index = self._close(), self.blocks
        block = tool_use_block(call)
        self.blocks, self.calls = self.blocks + 1, self.calls + 1
        return [*events, ContentBlockStart(index, ToolUseBlock(block.id, block.name, {})),
                ContentBlockDelta(index, InputJsonDelta(call.arguments)),
                ContentBlockStop(index)]

    def _close(self) -> list[object]:
        if self.open is None:
            return []
        events: list[object] = []
        if self.open == "thinking":
            events.append(ContentBlockDelta(self.blocks - 1,
                                            SignatureDelta(signature("".join(self.thought)))))
        self.open = None
        return [*events, ContentBlockStop(self.blocks - 1)]

    def finish(self) -> list[object]:
        reason, sequence = self.stop(self.calls)
        return [*self._close(), MessageDelta(StopDelta(reason, sequence), self.final_usage()),
                MessageStop()]
