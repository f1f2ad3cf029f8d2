"""The Messages adapter without a server: blocks → chat messages, tools and tool_choice, the
error shape, stop reasons, the stream events built from engine deltas, and a reasoning model's
thinking as a thinking block (checked against the anthropic SDK's types)."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json

import anthropic
import msgspec
import pydantic
import pytest

from adapters.anthropic_messages import (
    build_messages_job,
    chat_messages,
    chat_tool_choice,
    chat_tools,
    count_tokens,
    error_body,
)
from adapters.anthropic_output import MessagesAssembler, MessagesChunker, matched_stop
from adapters.anthropic_thinking import template_thinking
from adapters.anthropic_types import CountTokensRequest, MessagesRequest, TextBlock
from adapters.errors import ApiError
from adapters.reasoning import parser_name
from adapters.tool_syntax import HERMES, LLAMA3, mistral
from adapters.tools import ToolPlan, call_block, tool_plan
from engine import JobDelta
from tests.adapters.test_reasoning import DEEPSEEK_R1_LIKE, QWEN3_LIKE

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


OSLO = {"city": "Oslo"}
ANSWERS = {"hermes": call_block("get_weather", OSLO),  # each family's syntax (tool_syntax.py)
           "llama3": json.dumps({"name": "get_weather", "parameters": OSLO}),
           "mistral": "[TOOL_CALLS] " + json.dumps([{"name": "get_weather", "arguments": OSLO}])}


@pytest.mark.parametrize("syntax", [HERMES, LLAMA3, mistral()], ids=lambda s: s.name)
def test_stream_events_and_message_agree_on_a_tool_call(syntax):
    plan = dataclasses.replace(tool_plan(chat_tools([WEATHER]), "required", None, None, None),
                               syntax=syntax)
    answer = ANSWERS[syntax.name]
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


# -- thinking ---------------------------------------------------------------------------------

STREAM_EVENT = pydantic.TypeAdapter(anthropic.types.RawMessageStreamEvent)
THOUGHT_BLOCKS = [{"type": "thinking", "thinking": "They want the weather.", "signature": "x"},
                  {"type": "redacted_thinking", "data": "opaque"}]


def test_thinking_blocks_sent_back_are_left_out():
    turn = [{"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}]
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1"}]}
    plain = chat_messages(request([{"role": "user", "content": "Weather?"},
                                   {"role": "assistant", "content": turn}, result]))
    thought = chat_messages(request([{"role": "user", "content": "Weather?"},
                                     {"role": "assistant", "content": [*THOUGHT_BLOCKS, *turn]},
                                     result]))
    assert thought == plain


def test_thinking_not_asked_for_is_not_shown():
    """A template that thinks regardless: the thinking is split from the answer and dropped,
    as Anthropic returns no thinking blocks unless thinking was enabled."""
    whole = MessagesAssembler("msg_1", "m", None, [], lambda ids: "", thinks=True, shown=False)
    whole.add(delta("Colors first.</think>Red.", [1, 2, 3], "stop", done=3))
    assert whole.response().content == [TextBlock("Red.")]
    stream = MessagesChunker("msg_1", "m", 10, None, [], lambda ids: "", thinks=True,
                             shown=False)
    events = [*stream.start(), *stream.on_delta(0, delta("Colors first.</think>Red.", [1, 2, 3],
                                                           "stop", done=3)), *stream.finish()]
    starts = [type(e.content_block) for e in events if hasattr(e, "content_block")]
    assert starts == [TextBlock]


def test_the_thinking_parameter_is_the_templates_switch():
    assert template_thinking(None, 2000) == {"enable_thinking": False}  # Anthropic's default
    assert template_thinking({"type": "disabled"}, 8) == {"enable_thinking": False}
    assert template_thinking({"type": "enabled", "budget_tokens": 1024}, 2000) == {
        "enable_thinking": True}
    for thinking, param in [({"type": "adaptive"}, "thinking.type"),
                            ({"type": "enabled"}, "thinking.budget_tokens"),
                            ({"type": "enabled", "budget_tokens": 1000}, "thinking.budget_tokens"),
                            ({"type": "enabled", "budget_tokens": 2000}, "thinking.budget_tokens"),
                            ({"type": "enabled", "budget_tokens": True}, "thinking.budget_tokens")]:
        with pytest.raises(ApiError) as info:
            template_thinking(thinking, 2000)
        assert info.value.param == param
        assert param in error_body(400, info.value.message, info.value.param).error.message


def templated(tokenizer, template: str):
    tok = copy.copy(tokenizer)
    tok.chat_template = template
    return tok


def test_the_template_and_the_thinking_parameter_decide_where_the_output_starts(tokenizer):
    def job(template: str, **fields):
        req = msgspec.convert({"messages": [{"role": "user", "content": "Hi"}],
                               "max_tokens": 2000, **fields}, MessagesRequest)
        tok = templated(tokenizer, template)
        spec = build_messages_job(req, tok, 4096, reasoning_parser=parser_name(None, template))
        assert count_tokens(req, tok, 4096) == len(spec.prompt_ids)
        return spec, tokenizer.decode(spec.prompt_ids)

    spec, prompt = job(QWEN3_LIKE, thinking={"type": "enabled", "budget_tokens": 1024})
    assert spec.thinks is False and prompt.endswith("assistant\n")
    spec, prompt = job(QWEN3_LIKE, thinking={"type": "disabled"})
    assert spec.thinks is False and prompt.endswith("<think>\n\n</think>\n\n")
    assert job(DEEPSEEK_R1_LIKE)[0].thinks is True
    assert job(tokenizer.chat_template)[0].thinks is None  # no parser


def thinking_deltas(answer: str) -> list[JobDelta]:
    pieces = ["<thi", "nk>Paris is", " the capital.</think>\n\n", answer[:5], answer[5:]]
    return [delta(text, [k], "stop" if k == len(pieces) else None, done=k)
            for k, text in enumerate(pieces, start=1)]


def run(deltas: list[JobDelta], plan: ToolPlan | None = None):
    assembler = MessagesAssembler("msg_1", "m", plan, [], lambda ids: "", thinks=False)
    chunker = MessagesChunker("msg_1", "m", 10, plan, [], lambda ids: "", thinks=False)
    events = [*chunker.start()]
    for d in deltas:
        assembler.add(d)
        events += chunker.on_delta(0, d)
    events += chunker.finish()
    message = anthropic.types.Message.model_validate(msgspec.to_builtins(assembler.response()))
    bodies = [msgspec.to_builtins(e) for e in events if e.type != "ping"]
    return message, [STREAM_EVENT.validate_python(b) for b in bodies]


def test_the_thinking_is_a_block_before_the_text_whole_and_streamed():
    message, events = run(thinking_deltas("Paris."))
    assert [b.type for b in message.content] == ["thinking", "text"]
    thinking, text = message.content
    assert thinking.thinking == "Paris is the capital." and text.text == "Paris."
    assert thinking.signature == hashlib.sha256(b"Paris is the capital.").hexdigest()
    assert message.usage.output_tokens == 5
    kinds = [(e.type, getattr(e, "index", None)) for e in events]
    assert kinds[:2] == [("message_start", None), ("content_block_start", 0)]
    assert events[1].content_block.model_dump() == {"type": "thinking", "thinking": "",
                                                    "signature": ""}
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert "".join(d.thinking for d in deltas if d.type == "thinking_delta") == \
        thinking.thinking
    signed = [i for i, d in enumerate(deltas) if d.type == "signature_delta"]
    assert len(signed) == 1 and deltas[signed[0]].signature == thinking.signature
    assert all(d.type == "thinking_delta" for d in deltas[:signed[0]])
    stop = kinds.index(("content_block_stop", 0))
    assert events[stop - 1].delta.type == "signature_delta"
    assert events[stop + 1].type == "content_block_start" and events[stop + 1].index == 1
    assert "".join(d.text for d in deltas if d.type == "text_delta") == "Paris."
    assert kinds[-3:] == [("content_block_stop", 1), ("message_delta", None),
                          ("message_stop", None)]


def test_thinking_before_a_tool_call():
    plan = tool_plan(chat_tools([WEATHER]), "required", None, None, None)
    message, events = run(thinking_deltas(call_block("get_weather", {"city": "Oslo"})), plan)
    assert [b.type for b in message.content] == ["thinking", "tool_use"]
    assert message.stop_reason == "tool_use" and message.content[1].input == {"city": "Oslo"}
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == ["thinking", "tool_use"]
    assert [e.index for e in events if e.type == "content_block_stop"] == [0, 1]
