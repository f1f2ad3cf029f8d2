"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) against a live server with
the real model: the `anthropic` SDK, langchain-anthropic's ChatAnthropic, raw events, errors, and
thinking blocks behind a thinking model's chat template."""

from __future__ import annotations

import copy
import json
from typing import Literal

import anthropic
import httpx
import pydantic
import pytest
from langchain_anthropic import ChatAnthropic

from adapters.errors import ApiError
from app.controllers.anthropic import ANTHROPIC_FRAMING
from app.factory import create_app
from tests.app.conftest import API_KEYS, settings, start_server

pytestmark = pytest.mark.slow  # a live server with the real model

MESSAGES = "/v1/messages"
HELLO = [{"role": "user", "content": "Name three colors."}]
WEATHER = {"name": "get_weather", "description": "The current weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


STREAM_EVENT = pydantic.TypeAdapter(anthropic.types.RawMessageStreamEvent)


class Color(pydantic.BaseModel):
    color: Literal["red", "green"]


def sdk(server, **kw) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=kw.pop("api_key", "unused"),
                               max_retries=0, timeout=120, **kw)


def body(**kw) -> dict:
    return {"model": "", "messages": HELLO, "max_tokens": 8, **kw}


def test_create_matches_chat_and_counts_usage(live_server):
    """The same conversation through /v1/messages and /v1/chat/completions is the same job."""
    client, model = sdk(live_server), live_server.gateway.model_name
    raw = client.messages.with_raw_response.create(model=model, system="You are terse.",
                                                   messages=HELLO, max_tokens=10)
    # Validated by the SDK's own (pydantic) types, which the SDK itself applies leniently.
    message = anthropic.types.Message.model_validate(raw.http_response.json())
    chat = live_server.client().chat.completions.create(
        model=model, messages=[{"role": "system", "content": "You are terse."}, *HELLO],
        max_tokens=10, temperature=0)
    assert message.id.startswith("msg_") and message.role == "assistant"
    assert message.content[0].type == "text"
    assert message.content[0].text == chat.choices[0].message.content
    assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[
        chat.choices[0].finish_reason]
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert usage.output_tokens == chat.usage.completion_tokens
    # The second run of one system prompt finds its prefix cached.
    assert chat.usage.prompt_tokens_details.cached_tokens > 0
    again = client.messages.create(model=model, system="You are terse.", messages=HELLO,
                                   max_tokens=2)
    assert again.usage.cache_read_input_tokens > 0
    counted = client.messages.count_tokens(model=model, system="You are terse.",
                                           messages=HELLO)
    assert counted.input_tokens == usage.input_tokens + usage.cache_read_input_tokens


def test_stream_reassembles_to_the_same_message(live_server):
    client = sdk(live_server)
    kw = {"model": "", "messages": HELLO, "max_tokens": 8}
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(texts) == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert (final.usage.input_tokens + final.usage.cache_read_input_tokens
            == whole.usage.input_tokens + whole.usage.cache_read_input_tokens)


def test_raw_stream_events_in_order(live_server):
    # The sampling fields the SDK no longer sends, as older clients do: temperature 0 is greedy.
    raw = body(stream=True, temperature=0, top_p=0.9, top_k=40, metadata={"user_id": "u1"})
    with httpx.stream("POST", live_server.url + MESSAGES, json=raw,
                      headers={"anthropic-version": "2023-06-01"}, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        names, events = [], []
        for line in r.iter_lines():
            if line.startswith("event: "):
                names.append(line[7:])
            elif line.startswith("data: "):
                events.append(json.loads(line[6:]))
    assert names == [e["type"] for e in events]  # every event named after its type
    for event in events:
        if event["type"] != "ping":
            STREAM_EVENT.validate_python(event)
    assert "ping" in names  # after message_start, and as keep-alive
    kinds = [n for n in names if n != "ping"]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds[1] == "content_block_start" and kinds[-3] == "content_block_stop"
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert events[-2]["delta"]["stop_reason"] == "max_tokens"
    assert events[-2]["usage"]["output_tokens"] == 8


def test_stop_sequence_is_reported(live_server):
    """Whatever the model writes first, stopping at its own first word is `stop_sequence`."""
    first = sdk(live_server).messages.create(**body(max_tokens=4)).content[0].text
    word = first.split()[0]
    message = sdk(live_server).messages.create(**body(stop_sequences=["zzqx", word]))
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == word
    assert not message.content or word not in message.content[0].text


def test_forced_tool_use_streamed_then_tool_result(live_server):
    client = sdk(live_server)
    with client.messages.stream(model="", messages=ASK_WEATHER, max_tokens=40, tools=[WEATHER],
                                tool_choice={"type": "tool", "name": "get_weather",
                                             "disable_parallel_tool_use": True}) as stream:
        events = [e.type for e in stream]
        first = stream.get_final_message()
    assert "input_json" in events  # the SDK's event for an input_json_delta
    assert first.stop_reason == "tool_use" and [b.type for b in first.content] == ["tool_use"]
    call = first.content[0]
    assert call.name == "get_weather" and isinstance(call.input.get("city"), str)
    assert call.id.startswith("toolu_")
    second = client.messages.create(
        model="", max_tokens=6, tools=[WEATHER],
        messages=[*ASK_WEATHER, {"role": "assistant", "content": first.content},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                "content": "Sunny, 24 C."}]}],
        tool_choice={"type": "none"})
    assert second.content[0].type == "text" and second.content[0].text
    assert second.stop_reason in ("end_turn", "max_tokens")


def test_output_format_is_followed(live_server):
    """The SDK's messages.parse sends the model's schema as output_config.format."""
    parsed = sdk(live_server).messages.parse(model="", messages=HELLO, max_tokens=16,
                                             output_format=Color)
    assert parsed.parsed_output.color in ("red", "green")
    assert json.loads(parsed.content[0].text) == parsed.parsed_output.model_dump()


def test_api_key_as_x_api_key(auth_server):
    url = auth_server.url + MESSAGES
    assert httpx.post(url, json=body(max_tokens=2), headers={"x-api-key": API_KEYS[0]},
                      timeout=60).status_code == 200
    missing = httpx.post(url, json=body(max_tokens=2), timeout=60)
    assert missing.status_code == 401 and "x-api-key" in missing.json()["error"]["message"]
    refused = httpx.post(url, json=body(max_tokens=2), headers={"x-api-key": "nope"}, timeout=60)
    assert refused.status_code == 401
    assert refused.json() == {"type": "error", "error": {
        "type": "authentication_error", "message": "Incorrect API key provided."}}
    assert sdk(auth_server, api_key=API_KEYS[1]).messages.count_tokens(
        model="", messages=HELLO).input_tokens > 0
    with pytest.raises(anthropic.AuthenticationError):
        sdk(auth_server, api_key="wrong").messages.create(**body(max_tokens=2))


# (name, body, status, error type, the field the message must name)
TOOL_USE = {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1",
                                              "name": "get_weather", "input": {"city": "x"}}]}
ERRORS = [
    ("malformed JSON", b'{"messages": [', 400, "invalid_request_error", "not valid JSON"),
    ("wrong type", body(max_tokens="ten"), 400, "invalid_request_error", "max_tokens"),
    ("missing max_tokens", {"model": "", "messages": HELLO}, 400, "invalid_request_error",
     "max_tokens"),
    ("max_tokens over the context", body(max_tokens=9000), 400, "invalid_request_error",
     "max_tokens"),
    ("unknown block type", body(messages=[{"role": "user", "content": [
        {"type": "image", "source": {}}]}]), 400, "invalid_request_error",
     "messages[0].content[0].type"),
    ("text block without text", body(messages=[{"role": "user", "content": [{"type": "text"}]}]),
     400, "invalid_request_error", "messages[0].content[0].text"),
    ("tool_use from the user", body(messages=[{"role": "user", "content": TOOL_USE["content"]}]),
     400, "invalid_request_error", "messages[0].content[0].type"),
    ("tool_result matching no tool_use", body(messages=[*ASK_WEATHER, TOOL_USE, {
        "role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_2",
                                     "content": "x"}]}]), 400, "invalid_request_error",
     "messages[2].content[0].tool_use_id"),
    ("tool_use without input", body(messages=[*ASK_WEATHER, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f"}]}, *HELLO]), 400, "invalid_request_error",
     "messages[1].content[0].input"),
    ("unknown role", body(messages=[{"role": "system", "content": "x"}]), 400,
     "invalid_request_error", "messages[0].role"),
    ("server tool", body(tools=[{"type": "web_search_20250305", "name": "web_search"}]), 400,
     "invalid_request_error", "tools[0].type"),
    ("tool without input_schema", body(tools=[{"name": "f"}]), 400, "invalid_request_error",
     "tools[0].input_schema"),
    ("bad tool name", body(tools=[{**WEATHER, "name": "a b"}]), 400, "invalid_request_error",
     "tools[0].name"),
    ("tool_choice naming no tool", body(tools=[WEATHER], tool_choice={"type": "tool",
                                                                    "name": "other"}), 400,
     "invalid_request_error", "tool_choice"),
    ("unknown tool_choice", body(tools=[WEATHER], tool_choice={"type": "sometimes"}), 400,
     "invalid_request_error", "tool_choice.type"),
    ("too many stop sequences", body(stop_sequences=["x"] * 100), 400, "invalid_request_error",
     "stop_sequences"),
    ("unknown model", body(model="claude-opus-4"), 404, "not_found_error", "model"),
    ("output format that is not a schema", body(output_config={"format": {
        "type": "json_schema", "schema": {"type": "objectx"}}}), 400, "invalid_request_error",
     "output_config.format"),
    ("system with an image block", body(system=[{"type": "image"}]), 400,
     "invalid_request_error", "system[0].type"),
    ("thinking budget under Anthropic's least", body(max_tokens=2000, thinking={
        "type": "enabled", "budget_tokens": 512}), 400, "invalid_request_error",
     "thinking.budget_tokens"),
    ("thinking budget not under max_tokens", body(thinking={
        "type": "enabled", "budget_tokens": 1024}), 400, "invalid_request_error",
     "thinking.budget_tokens"),
    ("unknown thinking type", body(thinking={"type": "sometimes"}), 400,
     "invalid_request_error", "thinking.type"),
]


def test_bad_input_is_refused_in_anthropic_shape_while_a_stream_runs(live_server, http):
    engine = live_server.engine
    with httpx.stream("POST", live_server.url + MESSAGES, json=body(max_tokens=16, stream=True),
                      timeout=60) as r:
        lines = r.iter_lines()
        next(line for line in lines if "text_delta" in line)  # the stream is generating
        before = engine.stats().prompt_tokens
        for name, payload, status, kind, field in ERRORS:
            reply = (http.post(MESSAGES, content=payload) if isinstance(payload, bytes)
                     else http.post(MESSAGES, json=payload))
            assert reply.status_code == status, (name, reply.text)
            error = reply.json()
            assert error["type"] == "error" and error["error"]["type"] == kind, name
            assert field in error["error"]["message"], (name, error)
        assert engine.stats().prompt_tokens == before  # none of them reached the engine
        rest = [line for line in lines if line.startswith("event: ")]
    assert rest[-2:] == ["event: message_delta", "event: message_stop"]


def test_sdk_raises_its_error_classes(live_server):
    client = sdk(live_server)
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model="", messages=HELLO, max_tokens=9000)
    assert info.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-opus-4", messages=HELLO, max_tokens=2)


def test_langchain_chat_anthropic(live_server):
    def chat_model(max_tokens: int) -> ChatAnthropic:
        return ChatAnthropic(base_url=live_server.url, api_key="unused", max_retries=0,
                             model=live_server.gateway.model_name, max_tokens=max_tokens,
                             timeout=60)

    reply = chat_model(10).invoke("Name a fruit.")
    assert isinstance(reply.content, str) and reply.content
    assert reply.usage_metadata["output_tokens"] >= 1
    tooled = chat_model(40).bind_tools([WEATHER], tool_choice="get_weather",
                                       parallel_tool_calls=False)
    answer = tooled.invoke("What is the weather in Paris?")
    assert answer.tool_calls and answer.tool_calls[0]["name"] == "get_weather"
    assert isinstance(answer.tool_calls[0]["args"]["city"], str)
    assert answer.response_metadata["stop_reason"] == "tool_use"


def test_an_error_after_the_start_is_an_error_event():
    """Once the headers are out, a failure is Anthropic's `error` event (the SDK raises it)."""
    err = ApiError(500, "Generation failed: boom", "generation_failed")
    text = ANTHROPIC_FRAMING.error(err).encode().decode()
    name, data = text.strip().split("\n")
    assert name == "event: error"
    assert json.loads(data.removeprefix("data: ")) == {
        "type": "error", "error": {"type": "api_error", "message": "Generation failed: boom"}}
    assert ANTHROPIC_FRAMING.ping.encode() == b'event: ping\ndata: {"type":"ping"}\n\n'
    assert ANTHROPIC_FRAMING.end == ()  # no [DONE]: message_stop ends a stream


# -- thinking ---------------------------------------------------------------------------------

# A template in the style of Qwen3's and DeepSeek-R1's: the generation prompt opens a think block,
# or with `enable_thinking: false` closes an empty one.
THINKING_TEMPLATE = (
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- else %}{{- '<think>\\n' }}{%- endif %}"
    "{%- endif %}")
THINK = {"type": "enabled", "budget_tokens": 1024}


class TemplatedEngine:
    """The shared engine behind a tokenizer with another chat template: the same model, given
    the prompts a thinking model's template writes."""

    def __init__(self, engine, template: str):
        self.engine = engine
        self.tokenizer = copy.copy(engine.tokenizer)
        self.tokenizer.chat_template = template

    def __getattr__(self, name: str):
        return getattr(self.engine, name)


@pytest.fixture(scope="module")
def reasoning_server(gateway_engine):
    """The reasoning parser comes from the template (`auto`), as it would for a thinking model.
    The model does not think, so inside the block the template opened it writes only
    thinking: its whole answer is the thinking block."""
    srv = start_server(create_app(settings(), engine=TemplatedEngine(gateway_engine,
                                                                     THINKING_TEMPLATE)))
    yield srv
    srv.stop()


def test_thinking_is_a_block_before_the_text_whole_and_streamed(reasoning_server):
    client = sdk(reasoning_server)
    kw = {"model": "", "messages": HELLO, "max_tokens": 1100, "thinking": THINK}
    raw = client.messages.with_raw_response.create(**kw)
    message = anthropic.types.Message.model_validate(raw.http_response.json())
    thinking = message.content[0]
    assert thinking.type == "thinking" and thinking.thinking and thinking.signature
    chat = reasoning_server.client().chat.completions.create(
        model="", messages=HELLO, max_tokens=1100, temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    said = chat.choices[0].message
    assert thinking.thinking == said.reasoning_content and "think>" not in thinking.thinking
    assert [b.text for b in message.content[1:]] == ([said.content] if said.content else [])
    assert message.usage.output_tokens == chat.usage.completion_tokens
    if not said.content:  # all of it thinking
        assert chat.usage.completion_tokens_details.reasoning_tokens == \
            chat.usage.completion_tokens

    with httpx.stream("POST", reasoning_server.url + MESSAGES, json={**kw, "stream": True},
                      timeout=120) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    events = [e for e in events if e["type"] != "ping"]
    for event in events:
        STREAM_EVENT.validate_python(event)
    assert events[1] == {"type": "content_block_start", "index": 0, "content_block": {
        "type": "thinking", "thinking": "", "signature": ""}}
    stop = events.index({"type": "content_block_stop", "index": 0})
    assert events[stop - 1]["delta"] == {"type": "signature_delta",
                                         "signature": thinking.signature}
    assert "".join(e["delta"]["thinking"] for e in events[2:stop - 1]) == thinking.thinking
    with client.messages.stream(**kw) as stream:
        kinds = {e.type for e in stream}
        final = stream.get_final_message()
    assert {"thinking", "signature"} <= kinds  # the SDK's events for the two deltas
    assert final.content == message.content


def test_thinking_disabled_and_thinking_sent_back(reasoning_server):
    client = sdk(reasoning_server)
    off = client.messages.create(model="", messages=HELLO, max_tokens=8,
                                 thinking={"type": "disabled"})
    assert [b.type for b in off.content] == ["text"] and off.content[0].text
    chat = reasoning_server.client().chat.completions.create(
        model="", messages=HELLO, max_tokens=8, temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.content[0].text == chat.choices[0].message.content
    unasked = client.messages.create(model="", messages=HELLO, max_tokens=8)
    assert [(b.type, b.text) for b in unasked.content] == [("text", off.content[0].text)]
    counted = {kind: client.messages.count_tokens(model="", messages=HELLO, thinking=thinking)
               .input_tokens for kind, thinking in (("on", THINK), ("off", {"type": "disabled"}))}
    assert counted["off"] > counted["on"]  # the closed block
    assert counted["off"] == off.usage.input_tokens + off.usage.cache_read_input_tokens
    reply = [{"type": "thinking", "thinking": "Colors, then.", "signature": "abc"},
             {"type": "redacted_thinking", "data": "opaque"}, {"type": "text", "text": "Red."}]
    turns = [*HELLO, {"role": "assistant", "content": reply},
             {"role": "user", "content": "Two more?"}]
    with_thinking = client.messages.count_tokens(model="", messages=turns)
    turns[1] = {"role": "assistant", "content": "Red."}
    assert with_thinking.input_tokens == client.messages.count_tokens(
        model="", messages=turns).input_tokens
