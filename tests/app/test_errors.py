"""Every error the API answers, in OpenAI's envelope, and that none of them disturbs the jobs
already running."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from tests.app.conftest import API_KEYS, MAX_REQUEST_BYTES
from tests.app.sse import read_stream

pytestmark = pytest.mark.slow  # a live server with the real model

HELLO = [{"role": "user", "content": "Count from one to ten in words."}]
CHAT = "/v1/chat/completions"
RESPONSES = "/v1/responses"


def chat(**kw) -> dict:
    return {"messages": HELLO, "max_tokens": 8, "temperature": 0, **kw}


# (name, method, path, body (dict = JSON, bytes = raw), status, code, param)
CASES = [
    ("malformed JSON", "POST", CHAT, b'{"messages": [', 400, "invalid_json", None),
    ("not an object", "POST", CHAT, b"[]", 400, "invalid_json", None),
    ("not UTF-8", "POST", CHAT, b'{"messages": "\xff\xfe"}', 400, "invalid_json", None),
    ("not UTF-8, DJL", "POST", "/invocations", b'{"inputs": "\xff"}', 400, "invalid_json",
     None),
    ("wrong type", "POST", CHAT, chat(max_tokens="ten"), 400, "invalid_type", "max_tokens"),
    ("nested wrong type", "POST", CHAT, {"messages": [{"role": 1, "content": "x"}]}, 400,
     "invalid_type", "messages[0].role"),
    ("missing messages", "POST", CHAT, {"model": "x"}, 400, "missing_required_parameter",
     "messages"),
    ("out of range", "POST", CHAT, chat(temperature=5), 400, "invalid_value", "temperature"),
    ("n over the batch", "POST", CHAT, chat(n=9), 400, "invalid_value", "n"),
    ("context overflow", "POST", CHAT, chat(max_tokens=9000), 400, "context_length_exceeded",
     "messages"),
    ("unknown model", "POST", CHAT, chat(model="gpt-4o"), 404, "model_not_found", "model"),
    # Tools and structured outputs: each malformed piece named, nothing reaches the engine.
    ("malformed schema", "POST", CHAT, chat(response_format={"type": "json_schema", "json_schema":
        {"name": "x", "schema": {"type": "objectx"}}}), 400, "invalid_value", "response_format"),
    ("json_schema without its body", "POST", CHAT, chat(response_format={"type": "json_schema"}),
     400, "missing_required_parameter", "response_format.json_schema"),
    ("unknown response_format", "POST", CHAT, chat(response_format={"type": "yaml"}), 400,
     "invalid_value", "response_format.type"),
    ("tools that are not functions", "POST", CHAT, chat(tools=[{"type": "retrieval"}]), 400,
     "invalid_value", "tools[0].type"),
    ("a tool schema that does not compile", "POST", CHAT, chat(tools=[{"type": "function",
        "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {
            "type": "string", "pattern": "(("}}}}}]), 400, "invalid_value",
     "tools[0].function.parameters"),
    ("tool_choice naming a missing tool", "POST", CHAT, chat(tools=[{"type": "function",
        "function": {"name": "f"}}], tool_choice={"type": "function", "function": {
            "name": "g"}}), 400, "invalid_value", "tool_choice"),
    ("call arguments that are not JSON", "POST", CHAT, {"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "f", "arguments": "{city: Paris"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]}, 400, "invalid_value",
     "messages[1].tool_calls[0].function.arguments"),
    ("a bad guided regex", "POST", "/v1/completions", {"prompt": "x", "guided_regex": "(("},
     400, "invalid_value", "guided_regex"),
    ("a regex too costly per token", "POST", "/v1/completions", {
        "prompt": "x", "guided_regex": "(a{1000}){1000}"}, 400, "invalid_value", "guided_regex"),
    ("a schema nested 100 deep", "POST", CHAT, chat(response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": json.loads(
            '{"items": ' * 100 + "{}" + "}" * 100)}}), 400, "invalid_value",
     "response_format.json_schema.schema"),
    ("a body nested 100,000 deep", "POST", CHAT, b'{"messages": ' + b"[" * 100_000
     + b"]" * 100_000 + b"}", 400, "invalid_json", None),
    ("image part", "POST", CHAT, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400,
     "unsupported_parameter", "messages[0].content[0].type"),
    ("suffix", "POST", "/v1/completions", {"prompt": "def f(", "suffix": "return"}, 400,
     "unsupported_parameter", "suffix"),
    ("bad prompt", "POST", "/v1/completions", {"prompt": [1, "a"]}, 400, "invalid_type",
     "prompt"),
    ("completion overflow", "POST", "/v1/completions", {"prompt": "x", "max_tokens": 9000}, 400,
     "context_length_exceeded", "prompt"),
    # Today's models and tools (issue 32's list): each refused by name.
    ("echo on chat", "POST", CHAT, chat(echo=True, logprobs=True), 400, "unsupported_parameter",
     "echo"),
    ("an unknown reasoning parser", "POST", CHAT, chat(reasoning_parser="magic"), 400,
     "invalid_value", "reasoning_parser"),
    ("prompt_logprobs over 20", "POST", "/v1/completions", {"prompt": "x", "prompt_logprobs": 21},
     400, "invalid_value", "prompt_logprobs"),
    ("djl missing inputs", "POST", "/invocations", {"parameters": {}}, 400,
     "missing_required_parameter", "inputs"),
    ("djl bad parameter", "POST", "/invocations", {"inputs": "x", "parameters": {
        "max_new_tokens": 0}}, 400, "invalid_value", "parameters.max_new_tokens"),
    ("unknown model id", "GET", "/v1/models/gpt-4o", None, 404, "model_not_found", "model"),
    ("unknown route", "GET", "/v1/nothing", None, 404, "not_found", None),
    ("wrong method", "GET", CHAT, None, 405, "method_not_allowed", None),
    # Sizes a client controls: each bounded, each refused by name before anything is tokenized.
    ("two 100k-char stop strings", "POST", CHAT, chat(stop=["ab" * 50_000, "cd" * 50_000]), 400,
     "invalid_value", "stop"),
    ("17 stop strings", "POST", CHAT, chat(stop=[f"s{i}" for i in range(17)]), 400,
     "invalid_value", "stop"),
    ("2,000 logit_bias entries", "POST", CHAT, chat(logit_bias={str(i): 1 for i in range(2000)}),
     400, "invalid_value", "logit_bias"),
    ("300 stop_token_ids", "POST", CHAT, chat(stop_token_ids=list(range(300))), 400,
     "invalid_value", "stop_token_ids"),
    ("stop token outside the vocabulary", "POST", CHAT, chat(stop_token_ids=[10**9]), 400,
     "invalid_value", "stop_token_ids"),
    ("seed beyond 64 bits", "POST", CHAT, chat(seed=2**64), 400, "invalid_value", "seed"),
    ("contrastive top_k", "POST", CHAT, chat(decoding_strategy="contrastive", top_k=1000), 400,
     "invalid_value", "top_k"),
    ("4,097 messages", "POST", CHAT, {"messages": [{"role": "user", "content": ""}] * 4097}, 400,
     "invalid_value", "messages"),
    ("300 content parts", "POST", CHAT, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "x"}] * 300}]}, 400, "invalid_value", "messages[0].content"),
    ("prompts × n", "POST", "/v1/completions", {"prompt": ["a"] * 9, "n": 8}, 400,
     "invalid_value", "n"),
    ("65 prompts", "POST", "/v1/completions", {"prompt": ["a"] * 65}, 400, "invalid_value",
     "prompt"),
    ("65 DJL inputs", "POST", "/invocations", {"inputs": ["a"] * 65}, 400, "invalid_value",
     "inputs"),
    ("DJL long stop", "POST", "/invocations", {"inputs": "a", "parameters": {
        "stop_sequences": ["x" * 2000]}}, 400, "invalid_value", "parameters.stop"),
    ("body over the limit", "POST", CHAT, {"messages": HELLO, "user": "x" * MAX_REQUEST_BYTES},
     413, "request_too_large", None),
    ("responses: unknown item type", "POST", RESPONSES, {"input": [{"type": "computer_call"}]},
     400,
     "invalid_value", "input[0].type"),
    ("responses: output of no call", "POST", RESPONSES, {"input": [
        {"type": "function_call_output", "call_id": "call_1", "output": "x"}]}, 400,
     "invalid_value", "input[0].call_id"),
    ("responses: built-in tool", "POST", RESPONSES, {"input": "hi", "tools": [
        {"type": "file_search"}]}, 400, "unsupported_parameter", "tools[0].type"),
    ("responses: image part", "POST", RESPONSES, {"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "x"}]}]}, 400, "unsupported_parameter",
     "input[0].content[0].type"),
    ("responses: unknown previous id", "POST", RESPONSES, {"input": "hi",
                                                           "previous_response_id": "resp_x"},
     404, "response_not_found", "previous_response_id"),
]


def send(client: httpx.Client, method: str, path: str, body) -> httpx.Response:
    if isinstance(body, bytes):
        return client.request(method, path, content=body,
                              headers={"content-type": "application/json"})
    return client.request(method, path, json=body)


def check_envelope(response: httpx.Response, status: int, code: str, param: str | None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["code"], error["param"]) == (code, param), error
    assert isinstance(error["message"], str) and error["message"]
    if status in (400, 404, 405, 413):
        assert response.headers["x-should-retry"] == "false"
    return error


@pytest.mark.parametrize(("name", "method", "path", "body", "status", "code", "param"), CASES,
                         ids=[c[0] for c in CASES])
def test_error_envelope(http, name, method, path, body, status, code, param):
    check_envelope(send(http, method, path, body), status, code, param)


def test_context_overflow_message_says_it(http):
    error = http.post(CHAT, json=chat(max_tokens=9000)).json()["error"]
    assert "maximum context length" in error["message"]
    assert "context_length_exceeded" in error["message"]


def test_sdk_sees_the_error_classes(live_server):
    client = live_server.client()
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(messages=HELLO, model="", max_tokens=9000)
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(messages=HELLO, model="gpt-4o", max_tokens=4)
    assert info.value.code == "model_not_found"


def test_unknown_fields_and_nulls_are_accepted(http):
    r = http.post(CHAT, json=chat(logprobs=None, seed=None, stream_options=None, tools=None,
                                  frobnicate={"x": 1}, user=None))
    assert r.status_code == 200, r.text


def test_errors_do_not_disturb_jobs_in_flight(live_server, http):
    body = chat(max_tokens=24, stream=True)
    with httpx.stream("POST", live_server.url + CHAT, json=body, timeout=60) as r:
        alone = read_stream(r).text
    engine = live_server.engine
    with httpx.stream("POST", live_server.url + CHAT, json=body, timeout=60) as r:
        lines = r.iter_lines()
        # The role chunk can precede the prefill; a content chunk cannot.
        seen = []
        for line in lines:
            if line.startswith("data: {"):
                seen.append(line)
                if json.loads(line[6:])["choices"][0]["delta"].get("content"):
                    break
        before = engine.stats().prompt_tokens
        for _, method, path, payload, status, code, param in CASES:
            check_envelope(send(http, method, path, payload), status, code, param)
        assert engine.stats().prompt_tokens == before  # none of them reached the engine
        seen += [line for line in lines if line.startswith("data: ")]
    assert seen[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in seen[:-1]]
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
    # The stream interleaved with the errors produced exactly what it produces alone.
    assert text == alone and events[-1]["choices"][0]["finish_reason"] == "length"


def test_api_keys(auth_server):
    url = auth_server.url
    with httpx.Client(base_url=url, timeout=60) as c:
        check_envelope(c.post(CHAT, json=chat()), 401, "invalid_api_key", None)
        check_envelope(c.post(CHAT, json=chat(), headers={"Authorization": "Bearer nope"}), 401,
                       "invalid_api_key", None)
        check_envelope(c.get("/v1/models", headers={"Authorization": "Basic x"}), 401,
                       "invalid_api_key", None)
        for key in API_KEYS:
            r = c.post(CHAT, json=chat(max_tokens=2), headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200, r.text
        assert c.get("/health").status_code == 200  # stays open
        assert c.post("/invocations", json={"inputs": "x"}).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        auth_server.client(api_key="wrong").models.list()
    assert auth_server.client(api_key=API_KEYS[1]).models.list().data


def test_queue_full_is_429_with_retry_after(tiny_server):
    url = tiny_server.url
    long_job = {"messages": HELLO, "max_tokens": 400, "temperature": 0, "stream": True,
                "ignore_eos": True}
    with httpx.stream("POST", url + CHAT, json=long_job, timeout=60) as r:
        lines = r.iter_lines()  # kept alive: once collected, httpx closes the connection
        next(line for line in lines if line.startswith("data: {"))
        refused = httpx.post(url + CHAT, json=chat(), timeout=60)
        error = check_envelope(refused, 429, "rate_limit_exceeded", None)
        assert refused.headers["retry-after"] == "1" and error["type"] == "rate_limit_error"
        with pytest.raises(openai.RateLimitError):
            tiny_server.client().chat.completions.create(messages=HELLO, model="", max_tokens=2)
    # Leaving the stream freed the slot: the next request runs.
    deadline = time.monotonic() + 10
    while tiny_server.engine.stats().running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert httpx.post(url + CHAT, json=chat(max_tokens=2), timeout=60).status_code == 200


def test_engine_failure_mid_stream_is_an_error_event_then_done(tiny_server, monkeypatch):
    """A forward pass that fails cannot be produced on demand by a healthy model, so one is
    injected into the (real) engine's runner."""
    def broken(*args, **kwargs):
        raise RuntimeError("injected forward failure")

    monkeypatch.setattr(tiny_server.engine.runner, "decode", broken)
    body = chat(max_tokens=8, stream=True)
    with httpx.stream("POST", tiny_server.url + CHAT, json=body, timeout=60) as r:
        stream = read_stream(r)
    assert stream.done
    error = stream.events[-1]["error"]
    assert error["code"] == "generation_failed" and "injected" in error["message"]
    r = httpx.post(tiny_server.url + CHAT, json=chat(max_tokens=8), timeout=60)
    check_envelope(r, 500, "generation_failed", None)
