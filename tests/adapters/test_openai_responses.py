"""The Responses API adapter without a server: input items → chat messages, chat's errors in
this API's names, chat's stream chunks → OpenAI's event order, and a reasoning model's thinking
as a reasoning item (whole and streamed, checked against OpenAI's schema)."""

from __future__ import annotations

import copy

import msgspec
import pytest

from adapters.errors import ApiError
from adapters.openai_chat import ChatAssembler, ChatChunker
from adapters.openai_params import ResponseMeta
from adapters.openai_responses import (
    build_responses_job,
    chat_response_format,
    chat_tools,
    renamed,
)
from adapters.openai_types import (
    ChatCompletionChunk,
    ChunkChoice,
    ChunkDelta,
    FunctionCall,
    PromptTokensDetails,
    ToolCallDelta,
    Usage,
)
from adapters.reasoning import parser_name
from adapters.responses_events import ResponseEvents
from adapters.responses_input import InputReader
from adapters.responses_output import ResponseDraft, from_chat
from adapters.responses_types import ResponsesRequest
from adapters.token_text import TokenText
from engine import JobDelta
from tests.adapters.test_reasoning import DEEPSEEK_R1_LIKE, QWEN3_LIKE
from tests.app.schema import EVENT_SCHEMAS

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
    ([{"type": "item_reference"}], "input[0].type"),
    ([{"type": "reasoning", "summary": "x"}], "input[0].summary"),
    ([{"type": "reasoning", "summary": [], "content": ["x"]}], "input[0].content[0]"),
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


# -- reasoning --------------------------------------------------------------------------------

THOUGHT = {"type": "reasoning", "id": "rs_1", "summary": [],
           "content": [{"type": "reasoning_text", "text": "They greet me."}]}


def test_reasoning_items_are_kept_and_not_rendered():
    reader = read([{"role": "user", "content": "hi"}, THOUGHT,
                   {"role": "assistant", "content": "Hello!"}, {"type": "reasoning"}])
    assert reader.messages == [{"role": "user", "content": "hi"},
                               {"role": "assistant", "content": "Hello!"}]
    assert [i["type"] for i in reader.items] == ["message", "reasoning", "message", "reasoning"]
    assert reader.items[1] == {**THOUGHT, "status": "completed"}
    assert reader.items[3]["id"].startswith("rs_") and reader.items[3]["summary"] == []


def templated(tokenizer, template: str):
    tok = copy.copy(tokenizer)
    tok.chat_template = template
    return tok


def job(tokenizer, template: str, previous=None, **fields):
    req = msgspec.convert({"input": "Hi", "max_output_tokens": 8, **fields}, ResponsesRequest)
    return build_responses_job(req, previous, templated(tokenizer, template), 2048,
                               reasoning_parser=parser_name("auto", template))


def test_effort_reaches_the_template_and_a_bad_one_is_named(tokenizer):
    effort = QWEN3_LIKE.replace("'<|im_start|>assistant\\n'",
                                "'<|im_start|>assistant effort=' + reasoning_effort + '\\n'")
    assert effort != QWEN3_LIKE
    spec = job(tokenizer, effort, reasoning={"effort": "low", "summary": "auto"}).spec
    assert tokenizer.decode(spec.prompt_ids).endswith("assistant effort=low\n")
    for bad, param in [({"effort": "extreme"}, "reasoning.effort"), ("high", "reasoning")]:
        with pytest.raises(ApiError) as err:
            job(tokenizer, effort, reasoning=bad)
        assert err.value.param == param


def test_the_template_decides_whether_the_output_starts_thinking(tokenizer):
    assert job(tokenizer, QWEN3_LIKE).spec.thinks is False
    assert job(tokenizer, DEEPSEEK_R1_LIKE).spec.thinks is True
    assert job(tokenizer, tokenizer.chat_template).spec.thinks is None  # no parser


def test_a_continued_conversation_renders_no_thinking(tokenizer):
    """The stored turn is the answer alone, and a reasoning item sent back is left out: the
    prompt is the one the conversation without any thinking renders."""
    first = answer(thinking_deltas())
    assert first.turn == {"role": "assistant", "content": "Paris."}
    history = [{"role": "user", "content": "Hi"}, first.turn]
    continued = job(tokenizer, QWEN3_LIKE, history, input=[THOUGHT, {"role": "user",
                                                                     "content": "Thanks"}])
    plain = job(tokenizer, QWEN3_LIKE, history, input="Thanks")
    assert continued.spec.prompt_ids == plain.spec.prompt_ids
    assert "Paris is" not in tokenizer.decode(continued.spec.prompt_ids)


META = ResponseMeta("chatcmpl-t", 1, "m", "fp")


def thinking_deltas(finish: str = "stop") -> list[JobDelta]:
    pieces = ["<thi", "nk>Paris is", " the capital.</think>\n\nPar", "is."]
    return [JobDelta("j", 0, [k], text, finish if k == len(pieces) else None, None, 5, 0, k)
            for k, text in enumerate(pieces, start=1)]


def draft(**fields) -> ResponseDraft:
    return ResponseDraft.of(msgspec.convert({"input": "Hi", **fields}, ResponsesRequest), "m",
                            caching=False)


def answer(deltas: list[JobDelta], tokenizer=None, **fields):
    assembler = ChatAssembler(META, 1, TokenText(tokenizer), False, thinks=False)
    for d in deltas:
        assembler.add(d)
    return from_chat(draft(**fields), assembler.response(), assembler.finish[0])


def stream(deltas: list[JobDelta], tokenizer) -> ResponseEvents:
    chunker = ChatChunker(META, 1, TokenText(tokenizer), True, thinks=False)
    events = ResponseEvents(draft())
    out = events.start()
    for d in deltas:
        out += [e for c in chunker.on_delta(d) for e in events.on_chunk(c)]
    out += [e for c in chunker.finish() for e in events.on_chunk(c)] + events.close()
    return events, out


def test_the_thinking_is_a_reasoning_item_before_the_message(tokenizer, schema_errors):
    response = answer(thinking_deltas(), tokenizer, reasoning={"effort": "high"}).response
    body = msgspec.to_builtins(response)
    assert schema_errors("Response", body) == []
    thought, message = body["output"]
    assert thought["type"] == "reasoning" and thought["id"].startswith("rs_")
    assert thought["summary"] == [] and thought["status"] == "completed"
    assert thought["content"] == [{"type": "reasoning_text", "text": "Paris is the capital."}]
    assert message["content"][0]["text"] == "Paris."
    assert body["usage"]["output_tokens_details"]["reasoning_tokens"] == 3
    assert body["usage"]["output_tokens"] == 4
    assert body["reasoning"] == {"effort": "high", "summary": None}
    assert msgspec.to_builtins(draft().response())["reasoning"] == {"effort": None,
                                                                    "summary": None}


def test_streamed_thinking_follows_openai_order_and_schema(tokenizer, schema_errors):
    events, out = stream(thinking_deltas(), tokenizer)
    kinds = [e.type for e in out]
    assert kinds[:3] == ["response.created", "response.in_progress",
                         "response.output_item.added"]
    first_text = kinds.index("response.output_item.added", 3)
    assert set(kinds[3:first_text - 2]) == {"response.reasoning_text.delta"}
    assert kinds[first_text - 2:first_text + 2] == [
        "response.reasoning_text.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added"]
    assert kinds[-1] == "response.completed"
    bodies = [msgspec.to_builtins(e) for e in out]
    for body in bodies:
        assert schema_errors(EVENT_SCHEMAS[body["type"]], body) == [], body
    deltas = [b for b in bodies if b["type"] == "response.reasoning_text.delta"]
    assert "".join(b["delta"] for b in deltas) == "Paris is the capital."
    assert {(b["output_index"], b["content_index"]) for b in deltas} == {(0, 0)}
    assert bodies[2]["item"]["status"] == "in_progress" and bodies[2]["item"]["content"] == []
    final = bodies[-1]["response"]
    whole = msgspec.to_builtins(answer(thinking_deltas(), tokenizer).response)
    for item in (*final["output"], *whole["output"]):
        item.pop("id")
    assert final["output"] == whole["output"] and final["usage"] == whole["usage"]
    assert events.answer.turn["content"] == "Paris."


def test_thinking_cut_by_the_limit_is_an_incomplete_reasoning_item(tokenizer, schema_errors):
    cut = thinking_deltas("length")[:2]
    cut[-1] = JobDelta("j", 0, [2], "nk>Paris is", "length", None, 5, 0, 2)
    whole = msgspec.to_builtins(answer(cut, tokenizer).response)
    _, out = stream(cut, tokenizer)
    streamed = msgspec.to_builtins(out[-1].response)
    for body in (whole, streamed):
        assert schema_errors("Response", body) == []
        assert body["status"] == "incomplete"
        assert [(i["type"], i["status"]) for i in body["output"]] == [
            ("reasoning", "incomplete"), ("message", "incomplete")]
        assert body["output"][0]["content"][0]["text"] == "Paris is"
        assert body["output"][1]["content"][0]["text"] == ""
        assert body["usage"]["output_tokens_details"]["reasoning_tokens"] == 2
