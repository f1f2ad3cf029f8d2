"""The Messages adapter without a server: blocks → chat messages, tools and tool_choice, the
error shape, stop reasons, and the stream events built from engine deltas."""

from __future__ import annotations

import json

import msgspec
import pytest

from adapters.anthropic_messages import (
    chat_messages,
    chat_tool_choice,
    chat_tools,
    error_body,
)
from adapters.anthropic_output import MessagesAssembler, MessagesChunker, matched_stop
from adapters.anthropic_types import CountTokensRequest
from adapters.errors import ApiError
from adapters.tools import ToolPlan, call_block, tool_plan
from engine import JobDelta

WEATHER = {"name": "get_weather", "input_schema": {"type": "object", "properties": {
    "city": {"type": "string"}}}}


def request(messages: list, **kw) -> CountTokensRequest:
    return msgspec.convert({"messages": messages, **kw}, CountTokensRequest)


def test_a_tool_round_trip_becomes_chat_messages():
    req = request([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1",
             "content": [{"type": "text", "text": "Sunny"}]},
            {"type": "text", "text": "And tomorrow?"}]},
    ], system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}])
    out = chat_messages(req)
    assert [m.role for m in out] == ["system", "user", "assistant", "tool", "user"]
    assert out[0].content == "Be brief.\nBe kind."
    assert out[2].content == "Let me look."
    assert out[2].tool_calls == [{"id": "toolu_1", "type": "function", "function": {
        "name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]
    assert (out[3].tool_call_id, out[3].content) == ("toolu_1", "Sunny")
    assert out[4].content == "And tomorrow?"


@pytest.mark.parametrize("messages, param", [
    ([{"role": "user", "content": []}], "messages[0].content"),
    ([{"role": "user", "content": [{"type": "document"}]}], "messages[0].content[0].type"),
    ([{"role": "user", "content": ["text"]}], "messages[0].content[0]"),
    ([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x"}]}],
     "messages[0].content[0].tool_use_id"),
    # A result answers only the assistant turn right before it.
    ([{"role": "user", "content": "a"},
      {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                         "input": {}}]},
      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t"}]},
      {"role": "assistant", "content": "ok"},
      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t"}]}],
     "messages[4].content[0].tool_use_id"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "prefill"}],
     "messages[1].role"),
    ([{"role": "user", "content": "a"},
      {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                         "input": {}}]},
      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": 5}]}],
     "messages[2].content[0].content"),
])
def test_malformed_blocks_are_named(messages, param):
    with pytest.raises(ApiError) as info:
        chat_messages(request(messages))
    assert info.value.status == 400 and info.value.param == param
    assert param in error_body(400, info.value.message, info.value.param).error.message


def test_tools_and_tool_choice_map_to_chats():
    tools = chat_tools([WEATHER])
    choice, parallel = chat_tool_choice({"type": "tool", "name": "get_weather",
                                         "disable_parallel_tool_use": True})
    plan = tool_plan(tools, choice, parallel, None, None)
    assert isinstance(plan, ToolPlan) and plan.choice == "get_weather" and not plan.parallel
    assert plan.tools[0].parameters == WEATHER["input_schema"]
    assert chat_tool_choice({"type": "any"}) == ("required", None)
    assert chat_tool_choice({"type": "none"}) == ("none", None)
    for bad, param in [({"type": ["auto"]}, "tool_choice.type"),
                       ({"type": "tool"}, "tool_choice.name")]:
        with pytest.raises(ApiError) as info:
            chat_tool_choice(bad)
        assert info.value.param == param
    with pytest.raises(ApiError) as info:
        chat_tools([{"type": "bash_20250124", "name": "bash"}])
    assert info.value.param == "tools[0].type" and info.value.code == "unsupported_parameter"


def test_error_shape_by_status():
    assert msgspec.to_builtins(error_body(404, "no such name", "model")) == {
        "type": "error", "error": {"type": "not_found_error", "message": "model: no such name"}}
    assert error_body(400, "max_tokens is required", "max_tokens").error.message == \
        "max_tokens is required"
    assert [error_body(s, "x").error.type for s in (401, 413, 429, 500, 503)] == [
        "authentication_error", "request_too_large", "rate_limit_error", "api_error",
        "overloaded_error"]


def test_the_stop_that_completes_first_is_the_one_matched():
    assert matched_stop("one two three", ["three", "two"]) == "two"
    assert matched_stop("abc", ["bc", "abc"]) == "abc"  # both end at 3: the longer
    assert matched_stop("abc", ["x"]) is None


def delta(text: str, ids: list[int], finish: str | None = None, done: int = 0) -> JobDelta:
    return JobDelta("j", 0, ids, text, finish, prompt_tokens=10, cached_tokens=4,
                    completion_tokens=done)


def test_stream_events_and_message_agree_on_a_tool_call():
    plan = tool_plan(chat_tools([WEATHER]), "required", None, None, None)
    answer = call_block("get_weather", {"city": "Oslo"})
    deltas = [delta(answer[:12], [1], done=1), delta(answer[12:], [2], "stop", done=2)]
    chunker = MessagesChunker("msg_1", "m", 10, plan, [], lambda ids: "")
    events = [*chunker.start()]
    for d in deltas:
        events += chunker.on_delta(0, d)
    events += chunker.finish()
    kinds = [e.type for e in events]
    assert kinds == ["message_start", "ping", "content_block_start", "content_block_delta",
                     "content_block_stop", "message_delta", "message_stop"]
    assert json.loads(events[3].delta.partial_json) == {"city": "Oslo"}
    assert events[5].delta.stop_reason == "tool_use"
    usage = events[5].usage
    assert (usage.input_tokens, usage.cache_read_input_tokens, usage.output_tokens) == (6, 4, 2)
    assembler = MessagesAssembler("msg_1", "m", plan, [], lambda ids: "")
    for d in deltas:
        assembler.add(d)
    message = assembler.response()
    assert message.stop_reason == "tool_use" and message.content[0].input == {"city": "Oslo"}
    assert message.content[0].id.startswith("toolu_")
    assert events[2].content_block.id.startswith("toolu_")


def test_a_stop_sequence_is_found_in_the_decoded_output():
    assembler = MessagesAssembler("msg_1", "m", None, ["END", "."], lambda ids: "Hi there. END")
    assembler.add(delta("Hi there", [1, 2, 3], "stop", done=3))
    message = assembler.response()
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", ".")
    assert message.content[0].text == "Hi there"
    ended = MessagesAssembler("msg_1", "m", None, ["END"], lambda ids: "Hi there")
    ended.add(delta("Hi there", [1, 2, 3], "stop", done=3))
    assert ended.response().stop_reason == "end_turn"
    cut = MessagesAssembler("msg_1", "m", None, [], lambda ids: "")
    cut.add(delta("Hi", [1], "length", done=1))
    assert cut.response().stop_reason == "max_tokens"
