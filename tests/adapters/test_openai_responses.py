"""The Responses API adapter without a server: input items → chat messages, chat's errors in
this API's names, and chat's stream chunks → OpenAI's event order."""

from __future__ import annotations

import pytest

from adapters.errors import ApiError
from adapters.openai_responses import InputReader, chat_response_format, chat_tools, renamed
from adapters.openai_types import (
    ChatCompletionChunk,
    ChunkChoice,
    ChunkDelta,
    FunctionCall,
    PromptTokensDetails,
    ToolCallDelta,
    Usage,
)
from adapters.responses_output import ResponseDraft, ResponseEvents
from adapters.responses_types import ResponsesRequest

CALL = {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": '{"a": 1}'}


def read(items, history=()) -> InputReader:
    reader = InputReader(list(history))
    reader.read(items)
    return reader


def test_items_become_chat_messages_and_stored_items():
    reader = read([{"role": "developer", "content": "be brief"},
                   {"type": "message", "role": "assistant",
                    "content": [{"type": "output_text", "text": "ok"}]}, CALL,
                   {"type": "function_call_output", "call_id": "call_1", "output": "2"}])
    assert reader.messages == [
        {"role": "developer", "content": "be brief"},
        {"role": "assistant", "content": "ok", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f",
                                                            "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "2"}]
    assert [i["type"] for i in reader.items] == ["message", "message", "function_call",
                                                 "function_call_output"]
    assert reader.items[0]["content"] == [{"type": "input_text", "text": "be brief"}]
    assert all(i["id"] for i in reader.items)


def test_a_call_in_the_history_can_be_answered():
    history = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_9", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]
    reader = read([{"type": "function_call_output", "call_id": "call_9", "output": "x"}],
                  history)
    assert reader.messages[0]["tool_call_id"] == "call_9"


@pytest.mark.parametrize(("items", "param"), [
    (None, "input"),
    ([], "input"),
    ([{"type": "reasoning"}], "input[0].type"),
    ([{"role": "tool", "content": "x"}], "input[0].role"),
    ([{"role": "user"}], "input[0].content"),
    ([{"role": "user", "content": [{"type": "input_file"}]}], "input[0].content[0].type"),
    ([{"type": "function_call_output", "call_id": "call_1", "output": "x"}], "input[0].call_id"),
    ([{**CALL, "arguments": "{"}], "input[0].arguments"),
    ([{**CALL, "name": ""}], "input[0].name"),
])
def test_bad_items_are_refused_by_name(items, param):
    with pytest.raises(ApiError) as err:
        read(items)
    assert err.value.param == param


def test_tools_and_formats_take_chat_shapes():
    tool = {"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": True}
    assert chat_tools([tool]) == [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object"}}}]
    with pytest.raises(ApiError) as err:
        chat_tools([tool, {"type": "web_search_preview"}])
    assert (err.value.param, err.value.code) == ("tools[1].type", "unsupported_parameter")
    fmt = {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}}
    assert chat_response_format(fmt) == {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object"}}}


@pytest.mark.parametrize(("param", "expected"), [
    ("response_format.json_schema.name", "text.format.name"),
    ("response_format", "text.format"),
    ("max_completion_tokens", "max_output_tokens"),
    ("tools[2].function.parameters", "tools[2].parameters"),
    ("messages[3].content", "input"),
])
def test_chat_errors_are_renamed(param, expected):
    err = renamed(ApiError.bad_request(f"{param} is wrong", param=param))
    assert (err.param, err.message) == (expected, f"{expected} is wrong")


def chunk(content=None, call=None, finish=None, usage=None) -> ChatCompletionChunk:
    delta = ChunkDelta(content=content) if content else ChunkDelta()
    if call is not None:
        delta = ChunkDelta(tool_calls=[ToolCallDelta(0, "call_1", FunctionCall(*call))])
    choices = [] if usage else [ChunkChoice(0, delta, None, finish)]
    return ChatCompletionChunk("c", 0, "m", choices, "fp", usage=usage)


def test_stream_events_follow_openai_order():
    events = ResponseEvents(ResponseDraft.of(ResponsesRequest(input="hi"), "m", caching=True))
    out = events.start()
    out += events.on_chunk(chunk("Hel")) + events.on_chunk(chunk("lo"))
    out += events.on_chunk(chunk(call=("f", "{}"), finish="tool_calls"))
    usage = Usage(5, 4, 9, PromptTokensDetails(2))
    out += events.on_chunk(chunk(usage=usage)) + events.close()
    assert [e.type for e in out] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    assert [e.sequence_number for e in out] == list(range(len(out)))
    final = out[-1].response
    assert [type(i).__name__ for i in final.output] == ["OutputMessage", "FunctionCallItem"]
    assert final.output[0].content[0].text == "Hello" and final.status == "completed"
    assert final.usage.input_tokens_details.cached_tokens == 2
    assert final.usage.input_tokens_details.cache_write_tokens == 3
    assert events.answer.turn["tool_calls"][0]["id"] == "call_1"


def test_a_stream_cut_by_the_limit_is_incomplete_and_a_silent_one_has_a_message():
    events = ResponseEvents(ResponseDraft.of(ResponsesRequest(input="hi"), "m", caching=False))
    events.start()
    events.on_chunk(chunk(finish="length"))
    out = events.close()
    assert [e.type for e in out][-1] == "response.incomplete"
    final = out[-1].response
    assert final.incomplete_details.reason == "max_output_tokens"
    assert final.output[0].status == "incomplete" and final.output[0].content[0].text == ""
