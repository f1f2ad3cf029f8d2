"""The openai SDK (sync and async) against a live server with the real model."""

from __future__ import annotations

import asyncio
import uuid

import httpx
import pytest

from adapters.openai_chat import render_prompt
from engine import SamplingParams
from tests.app.schema import conforms_as_completion_chunk, without_echo_nulls
from tests.app.sse import read_stream

pytestmark = pytest.mark.slow  # a live server with the real model

HELLO = [{"role": "user", "content": "Name three colors."}]
LONG_SYSTEM = ("You are a meticulous assistant for a hardware store. Answer in one short "
               "sentence, mention a product when it helps, and never invent prices.")


def engine_greedy_text(engine, prompt_ids: list[int], max_tokens: int) -> str:
    """The engine's own greedy output, submitted from a plain thread (no event loop)."""
    handle = engine.submit(prompt_ids, SamplingParams(strategy="greedy", max_new_tokens=max_tokens))
    return "".join(d.text for d in handle.iter_sync(timeout=120))


def test_chat_matches_the_engine_and_conforms(live_server, schema_errors):
    client = live_server.client()
    raw = client.chat.completions.with_raw_response.create(
        model=live_server.gateway.model_name, messages=HELLO, max_tokens=12, temperature=0)
    body = raw.http_response.json()
    assert schema_errors("CreateChatCompletionResponse", body) == []
    completion = raw.parse()
    assert completion.id.startswith("chatcmpl-") and completion.object == "chat.completion"
    choice = completion.choices[0]
    assert choice.message.role == "assistant" and choice.message.refusal is None
    assert choice.logprobs is None and choice.finish_reason in ("stop", "length")
    assert completion.usage.completion_tokens <= 12 and completion.system_fingerprint
    ids = render_prompt(live_server.engine.tokenizer, HELLO)
    assert completion.usage.prompt_tokens == len(ids)
    assert choice.message.content == engine_greedy_text(live_server.engine, ids, 12)


def test_chat_stream_via_sdk_equals_non_stream(live_server):
    client = live_server.client()
    full = client.chat.completions.create(messages=HELLO, model="", max_tokens=12,
                                          temperature=0).choices[0].message.content
    chunks = list(client.chat.completions.create(messages=HELLO, model="", max_tokens=12,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full
    assert [c.choices[0].finish_reason for c in chunks][-1] in ("stop", "length")
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert all(c.usage is None for c in chunks)  # not asked for


def test_raw_chat_stream_every_chunk_conforms_with_usage(live_server, schema_errors):
    # A long prompt seen nowhere before (the nonce comes first, so no cached prefix shortens it):
    # its prefill keeps the stream idle for far longer than the test server's 50 ms ping
    # interval on any machine, so the keep-alive comments below do not depend on its speed.
    long_prompt = f"{uuid.uuid4()} " + "Tell me about the sea. " * 250
    body = {"messages": [{"role": "user", "content": long_prompt}], "max_tokens": 10,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", live_server.base_url + "/chat/completions", json=body,
                      timeout=60) as response:
        stream = read_stream(response)
    assert stream.done and not stream.after_done
    for event in stream.events:
        assert schema_errors("CreateChatCompletionStreamResponse", event) == [], event
    assert len({e["id"] for e in stream.events}) == 1
    last = stream.events[-1]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] >= 1
    assert last["usage"]["total_tokens"] == (last["usage"]["prompt_tokens"]
                                             + last["usage"]["completion_tokens"])
    assert stream.comments >= 1  # keep-alive pings, skipped by every client


def test_async_client_concurrent_requests_match_sequential(live_server):
    prompts = [[{"role": "user", "content": q}] for q in
               ("What is 2+2?", "Write a haiku about rain.", "Say hi.")]
    sync = live_server.client()
    expected = [sync.chat.completions.create(messages=m, model="", max_tokens=10, temperature=0)
                .choices[0].message.content for m in prompts]

    async def run():
        client = live_server.async_client()

        async def one(m, stream):
            if not stream:
                r = await client.chat.completions.create(messages=m, model="", max_tokens=10,
                                                         temperature=0)
                return r.choices[0].message.content
            parts = []
            async for chunk in await client.chat.completions.create(
                    messages=m, model="", max_tokens=10, temperature=0, stream=True):
                parts.append(chunk.choices[0].delta.content or "")
            return "".join(parts)

        return await asyncio.gather(*(one(m, i % 2 == 1) for i, m in enumerate(prompts)))

    assert asyncio.run(run()) == expected


def test_n_two_and_seed_reproducibility(live_server):
    client = live_server.client()
    kw = dict(messages=HELLO, model="", max_tokens=10, temperature=1.0, seed=1234, n=2)
    first = client.chat.completions.create(**kw)
    again = client.chat.completions.create(**kw)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]
    assert 2 <= first.usage.completion_tokens <= 20  # both sequences counted


def test_stop_string_cuts_before_the_stop_and_reports_stop(live_server):
    client = live_server.client()
    base = client.chat.completions.create(messages=HELLO, model="", max_tokens=16,
                                          temperature=0).choices[0].message.content
    words = base.split()
    assert len(words) >= 3, base
    stop = words[2]
    cut = client.chat.completions.create(messages=HELLO, model="", max_tokens=16, temperature=0,
                                         stop=[stop, "unlikely-stop"])
    choice = cut.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.content == base[: base.index(stop)]
    assert stop not in choice.message.content


def test_logprobs_greedy_top_is_the_choice(live_server):
    r = live_server.client().chat.completions.create(
        messages=HELLO, model="", max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)
        assert entry.logprob <= 0 and bytes(entry.bytes).decode("utf-8", "replace")
    assert "".join(e.token for e in content) == r.choices[0].message.content


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_repeated_system_prompt_reports_cached_tokens(live_server):
    client = live_server.client()
    tok = live_server.engine.tokenizer
    messages = [{"role": "system", "content": LONG_SYSTEM}]
    first = [*messages, {"role": "user", "content": "Hammers?"}]
    second = [*messages, {"role": "user", "content": "Do you sell nails?"}]
    shared = _common_prefix(render_prompt(tok, first), render_prompt(tok, second))
    assert shared >= live_server.engine.config.prompt_cache_min_tokens
    client.chat.completions.create(messages=first, model="", max_tokens=4, temperature=0)
    answer = client.chat.completions.create(messages=second, model="", max_tokens=4,
                                            temperature=0)
    # At least the shared head (system prompt and the user turn's header) came from the cache.
    cached = answer.usage.prompt_tokens_details.cached_tokens
    assert shared <= cached < answer.usage.prompt_tokens


def test_the_next_turn_of_a_conversation_reuses_the_whole_first_turn(live_server):
    client = live_server.client()
    tok = live_server.engine.tokenizer
    turn1 = [{"role": "system", "content": LONG_SYSTEM},
             {"role": "user", "content": "Which glue holds ceramic best?"}]
    r1 = client.chat.completions.create(messages=turn1, model="", max_tokens=8, temperature=0)
    turn2 = [*turn1, {"role": "assistant", "content": r1.choices[0].message.content},
             {"role": "user", "content": "And for glass?"}]
    r2 = client.chat.completions.create(messages=turn2, model="", max_tokens=8, temperature=0)
    first_prompt = render_prompt(tok, turn1)
    shared = _common_prefix(first_prompt, render_prompt(tok, turn2))
    assert shared >= len(first_prompt) - 3  # the first turn, up to its generation prompt
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert shared <= cached < r2.usage.prompt_tokens


def test_completions_prompt_shapes_and_choice_order(live_server, schema_errors):
    client = live_server.client()
    tok = live_server.engine.tokenizer
    raw = client.completions.with_raw_response.create(
        model="", prompt=["The capital of France is", "One, two,"], max_tokens=5, n=2,
        temperature=0)
    body = raw.http_response.json()
    assert schema_errors("CreateCompletionResponse", body) == []
    r = raw.parse()
    assert r.id.startswith("cmpl-") and [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text and r.choices[2].text == r.choices[3].text
    by_ids = client.completions.create(model="", prompt=tok.encode("One, two,"), max_tokens=5,
                                       temperature=0)
    assert by_ids.choices[0].text == r.choices[2].text
    batch_ids = client.completions.create(model="", prompt=[tok.encode("One, two,")] * 2,
                                          max_tokens=5, temperature=0)
    assert [c.text for c in batch_ids.choices] == [r.choices[2].text] * 2
    assert r.usage.prompt_tokens == len(tok.encode("The capital of France is")) + len(
        tok.encode("One, two,"))


def test_completions_echo_and_logprobs(live_server):
    client = live_server.client()
    echo = client.completions.create(model="", prompt="Roses are red,", max_tokens=4,
                                     temperature=0, echo=True)
    assert echo.choices[0].text.startswith("Roses are red,")
    lp = client.completions.create(model="", prompt="Roses are red,", max_tokens=4,
                                   temperature=0, logprobs=2)
    logprobs = lp.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 4
    assert "".join(logprobs.tokens) == lp.choices[0].text
    assert all(len(t) >= 2 for t in logprobs.top_logprobs)
    assert echo.choices[0].text == "Roses are red," + lp.choices[0].text


def test_completions_echo_with_logprobs_scores_the_prompt(live_server, http, schema_errors):
    """What lm-evaluation-harness's log-likelihood tasks send: token ids, echo, logprobs=1,
    max_tokens=1; and vLLM's prompt_logprobs extra, which agrees with it."""
    ids = live_server.engine.tokenizer.encode("Roses are red, violets are blue,")
    body = {"prompt": ids, "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 1}
    reply = http.post("/v1/completions", json=body).json()
    assert schema_errors("CreateCompletionResponse", without_echo_nulls(reply)) == []
    lp = reply["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(ids) + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(v <= 0 for v in lp["token_logprobs"][1:])
    assert all(len(top) in (1, 2) for top in lp["top_logprobs"][1:])  # the top one, and ours
    sdk = live_server.client().completions.create(model="", prompt=ids, max_tokens=1,
                                                  temperature=0, echo=True, logprobs=1)
    assert sdk.choices[0].logprobs.token_logprobs == lp["token_logprobs"]
    vllm = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 1,
                                              "prompt_logprobs": 2}).json()
    entries = vllm["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    for i in range(1, len(ids)):
        assert entries[i][str(ids[i])]["logprob"] == pytest.approx(lp["token_logprobs"][i])
    refused = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "echo": True, "logprobs": True})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "echo"


def test_completions_stream_sdk_and_raw(live_server, schema_errors):
    client = live_server.client()
    full = client.completions.create(model="", prompt="Once upon a time", max_tokens=8,
                                     temperature=0).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="", prompt="Once upon a time", max_tokens=8, temperature=0, stream=True)
        if c.choices)
    assert streamed == full
    body = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", live_server.base_url + "/completions", json=body,
                      timeout=60) as response:
        stream = read_stream(response)
    assert stream.done
    for event in stream.events[:-1]:
        assert conforms_as_completion_chunk(schema_errors, event), event
    assert stream.events[-2]["choices"][0]["finish_reason"] in ("stop", "length")
    assert stream.events[-1]["choices"] == [] and stream.events[-1]["usage"]["completion_tokens"]


def test_async_completions(live_server):
    async def run():
        client = live_server.async_client()
        r = await client.completions.create(model="", prompt="1, 2, 3,", max_tokens=6,
                                            temperature=0)
        return r.choices[0].text

    sync = live_server.client().completions.create(model="", prompt="1, 2, 3,", max_tokens=6,
                                                   temperature=0).choices[0].text
    assert asyncio.run(run()) == sync


def test_models(live_server, schema_errors):
    client = live_server.client()
    raw = client.models.with_raw_response.list()
    assert schema_errors("ListModelsResponse", raw.http_response.json()) == []
    models = raw.parse().data
    name = live_server.gateway.model_name
    assert [m.id for m in models] == [name]
    assert client.models.retrieve(name).id == name
