"""/v1/responses (OpenAI's Responses API) with the real clients against the live server: the
openai SDK's `responses`, the OpenAI Agents SDK and LangChain's ChatOpenAI(use_responses_api);
every body and event checked against OpenAI's schema. The store's bounds are unit-tested first,
without a server."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from msgspec import UNSET
from pydantic import BaseModel, Field

from adapters.errors import ApiError
from adapters.openai_chat import render_prompt
from adapters.responses_types import ResponseObject
from app.response_store import ResponseStore, StoredResponse, page_items
from tests.app.conftest import API_KEYS, THINK_THEN_ANSWER
from tests.app.schema import EVENT_SCHEMAS

WEATHER = {"type": "function", "name": "get_weather",
           "description": "Get the current weather in a city",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 40}}, "required": ["city"]}}
ASK = "What is the weather like in Paris today?"


# -- the store, without a server --------------------------------------------------------------

def _record(n: int, owner: str | None = None, text: str = "") -> StoredResponse:
    response = ResponseObject(
        id=f"resp_{n}", created_at=0, model="m", status="completed", output=[],
        usage=UNSET, instructions=text, max_output_tokens=None, previous_response_id=None,
        temperature=None, top_p=None, tools=[], tool_choice="auto", parallel_tool_calls=True,
        text={"format": {"type": "text"}}, metadata={}, user="u")
    return StoredResponse(response, [{"id": f"msg_{n}", "type": "message"}], owner, history=[])


def test_store_evicts_the_oldest_past_either_bound_and_reports_its_bytes():
    reported = []
    store = ResponseStore(3, 10_000, lambda n, b: reported.append((n, b)))
    for n in range(5):
        store.put(_record(n))
    assert len(store) == 3 and reported[-1] == (3, store.nbytes)
    with pytest.raises(ApiError) as missing:
        store.get("resp_0", None)
    assert missing.value.status == 404 and "resp_0" in missing.value.message
    assert store.get("resp_4", None).response.id == "resp_4"
    one = _record(9).measure()
    small = ResponseStore(100, 2 * one + one // 2)
    for n in range(4):
        small.put(_record(n))
    assert len(small) == 2 and small.nbytes <= small.max_bytes
    small.put(_record(7, text="x" * 3 * one))  # larger than the bound alone: not kept
    assert small.nbytes <= small.max_bytes
    with pytest.raises(ApiError):
        small.get("resp_7", None)


def test_store_owners_and_deletion():
    store = ResponseStore(10, 10**6)
    store.put(_record(1, owner="key-a"))
    assert store.get("resp_1", "key-a").owner == "key-a"
    for owner in ("key-b", None):
        with pytest.raises(ApiError) as other:
            store.get("resp_1", owner)
        assert other.value.status == 404
    store.delete("resp_1", "key-a")
    assert len(store) == 0 and store.nbytes == 0


def test_input_item_pages():
    items = [{"id": f"i{n}"} for n in range(5)]
    page = page_items(items, 2, "desc", None)
    assert [i["id"] for i in page.data] == ["i4", "i3"] and page.has_more
    page = page_items(items, 10, "asc", "i2")
    assert [i["id"] for i in page.data] == ["i3", "i4"] and not page.has_more
    with pytest.raises(ApiError) as bad:
        page_items(items, 0, "asc", None)
    assert bad.value.param == "limit"


# -- the live server --------------------------------------------------------------------------

live = pytest.mark.slow  # a live server with the real model


def chat_text(live_server, messages: list[dict], max_tokens: int) -> str:
    """What /v1/chat/completions answers to the same conversation (greedy)."""
    completion = live_server.client().chat.completions.create(
        model="", messages=messages, max_tokens=max_tokens, temperature=0)
    return completion.choices[0].message.content


def read_events(response: httpx.Response) -> list[dict]:
    """A Responses stream's events, each checked to be named after its type."""
    assert response.status_code == 200, response.read()
    events, name = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: "):
            event = json.loads(line[len("data: "):])
            assert event["type"] == name
            events.append(event)
    return events


def check_events(events: list[dict], schema_errors) -> None:
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for event in events:
        assert schema_errors(EVENT_SCHEMAS[event["type"]], event) == [], event


@live
def test_text_input_matches_chat_and_conforms(live_server, schema_errors):
    client = live_server.client()
    raw = client.responses.with_raw_response.create(
        model=live_server.gateway.model_name, input="Name three colors.", max_output_tokens=8,
        temperature=0)
    body = raw.http_response.json()
    assert schema_errors("Response", body) == []
    response = raw.parse()
    assert response.id.startswith("resp_") and response.status in ("completed", "incomplete")
    assert response.output[0].type == "message" and response.output[0].role == "assistant"
    messages = [{"role": "user", "content": "Name three colors."}]
    assert response.output_text == chat_text(live_server, messages, 8)
    prompt = render_prompt(live_server.engine.tokenizer, messages)
    assert response.usage.input_tokens == len(prompt)
    assert 1 <= response.usage.output_tokens <= 8


@live
def test_instructions_and_an_item_list(live_server):
    items = [{"role": "user", "content": "My name is Ada."},
             {"type": "message", "role": "assistant",
              "content": [{"type": "output_text", "text": "Nice to meet you, Ada."}]},
             {"type": "message", "role": "user",
              "content": [{"type": "input_text", "text": "What is my name?"}]}]
    response = live_server.client().responses.create(
        model="", instructions="Answer in one short sentence.", input=items,
        max_output_tokens=6, temperature=0)
    messages = [{"role": "system", "content": "Answer in one short sentence."},
                {"role": "user", "content": "My name is Ada."},
                {"role": "assistant", "content": "Nice to meet you, Ada."},
                {"role": "user", "content": "What is my name?"}]
    assert response.usage.input_tokens == len(render_prompt(live_server.engine.tokenizer,
                                                            messages))
    assert response.output_text == chat_text(live_server, messages, 6)
    assert response.instructions == "Answer in one short sentence."


@live
def test_max_output_tokens_makes_it_incomplete(live_server, schema_errors):
    raw = live_server.client().responses.with_raw_response.create(
        model="", input="Write a long story about a dragon.", max_output_tokens=3,
        temperature=0)
    body = raw.http_response.json()
    assert schema_errors("Response", body) == []
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["usage"]["output_tokens"] == 3 and body["output"][0]["status"] == "incomplete"


@live
def test_stream_events_in_order_and_the_sdk_reassembles_them(live_server, schema_errors):
    body = {"input": "Name three colors.", "max_output_tokens": 8, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", live_server.base_url + "/responses", json=body,
                      timeout=120) as response:
        events = read_events(response)
    check_events(events, schema_errors)
    kinds = [e["type"] for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", kinds[-1]]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    final = events[-1]["response"]
    assert final["output"][0]["content"][0]["text"] == deltas
    with live_server.client().responses.stream(model="", input="Name three colors.",
                                               max_output_tokens=8, temperature=0) as stream:
        streamed = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        if kinds[-1] == "response.completed":
            assert stream.get_final_response().output_text == deltas
    assert streamed == deltas


THINKING = {"input": "What is the capital of France?", "max_output_tokens": 40,
            "temperature": 0, "reasoning": {"effort": "low"}}


@live
def test_thinking_is_a_reasoning_item_whole_and_streamed(thinking_server, schema_errors):
    """Under a reasoning parser the think block (forced by a guided_regex) is a reasoning item
    before the message, as chat splits it; the stream sends its text first."""
    client = thinking_server.client()
    forced = {"guided_regex": THINK_THEN_ANSWER}
    raw = client.responses.with_raw_response.create(model="", **THINKING, extra_body=forced)
    body = raw.http_response.json()
    assert schema_errors("Response", body) == []
    assert body["reasoning"] == {"effort": "low", "summary": None}
    response = raw.parse()
    thought, message = response.output
    assert thought.type == "reasoning" and message.type == "message"
    assert thought.status == "completed" and thought.summary == []
    chat = client.chat.completions.create(
        model="", messages=[{"role": "user", "content": THINKING["input"]}], max_tokens=40,
        temperature=0, reasoning_effort="low", extra_body=forced)
    assert thought.content[0].text == chat.choices[0].message.reasoning_content
    assert response.output_text == chat.choices[0].message.content
    assert "think>" not in response.output_text and response.output_text.endswith(".")
    reasoning_tokens = response.usage.output_tokens_details.reasoning_tokens
    assert reasoning_tokens == chat.usage.completion_tokens_details.reasoning_tokens
    assert 0 < reasoning_tokens < response.usage.output_tokens == chat.usage.completion_tokens

    with httpx.stream("POST", thinking_server.base_url + "/responses", timeout=120,
                      json={**THINKING, **forced, "stream": True}) as streamed:
        events = read_events(streamed)
    check_events(events, schema_errors)
    kinds = [e["type"] for e in events]
    first_text = kinds.index("response.content_part.added")
    assert kinds[2] == "response.output_item.added" and events[2]["item"]["type"] == "reasoning"
    assert kinds[first_text - 3:first_text] == [
        "response.reasoning_text.done", "response.output_item.done",
        "response.output_item.added"]
    said = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert said == thought.content[0].text
    final = events[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["reasoning", "message"]
    assert final["usage"]["output_tokens_details"] == {"reasoning_tokens": reasoning_tokens}
    with client.responses.stream(model="", **THINKING, extra_body=forced) as stream:
        sdk_final = stream.get_final_response()
    assert [i.type for i in sdk_final.output] == ["reasoning", "message"]
    assert sdk_final.output[0].content[0].text == thought.content[0].text
    assert sdk_final.output_text == response.output_text


@live
def test_a_continued_conversation_leaves_the_thinking_out(thinking_server):
    """Both ways of continuing (previous_response_id, or the output items sent back) run the
    prompt of the conversation without its thinking; a bad effort is refused by name."""
    client = thinking_server.client()
    first = client.responses.create(model="", **THINKING,
                                    extra_body={"guided_regex": THINK_THEN_ANSWER})
    assert first.output[0].type == "reasoning"
    follow = "And of Spain?"
    by_id = client.responses.create(model="", input=follow, previous_response_id=first.id,
                                    max_output_tokens=2, temperature=0)
    sent_back = client.responses.create(
        model="", max_output_tokens=2, temperature=0,
        input=[{"role": "user", "content": THINKING["input"]},
               *[item.model_dump(exclude_none=True) for item in first.output],
               {"role": "user", "content": follow}])
    prompt = render_prompt(thinking_server.engine.tokenizer, [
        {"role": "user", "content": THINKING["input"]},
        {"role": "assistant", "content": first.output_text}, {"role": "user", "content": follow}])
    assert by_id.usage.input_tokens == sent_back.usage.input_tokens == len(prompt)
    items = client.responses.input_items.list(sent_back.id, order="asc")
    assert [i.type for i in items.data] == ["message", "reasoning", "message", "message"]
    with pytest.raises(openai.BadRequestError) as bad:
        client.responses.create(model="", input="Hi", reasoning={"effort": "extreme"})
    assert bad.value.body["param"] == "reasoning.effort"


class City(BaseModel):
    """A city and its country (bounded strings: the small model rambles otherwise)."""

    name: str = Field(max_length=30)
    country: str = Field(max_length=30)


@live
def test_parse_returns_the_pydantic_model(live_server, schema_errors):
    response = live_server.client().responses.parse(
        model="", input="Tell me about Paris.", text_format=City, max_output_tokens=40,
        temperature=0)
    assert response.status == "completed"
    assert isinstance(response.output_parsed, City)
    assert City.model_validate_json(response.output_text) == response.output_parsed
    assert response.text.format.type == "json_schema"


@live
def test_forced_tool_streamed_then_the_answer_to_its_output(live_server, schema_errors):
    body = {"input": ASK, "tools": [WEATHER], "temperature": 0, "max_output_tokens": 40,
            "tool_choice": {"type": "function", "name": "get_weather"},
            "parallel_tool_calls": False, "stream": True}
    with httpx.stream("POST", live_server.base_url + "/responses", json=body,
                      timeout=120) as response:
        events = read_events(response)
    check_events(events, schema_errors)
    first = events[-1]["response"]
    assert events[-1]["type"] == "response.completed"
    assert [item["type"] for item in first["output"]] == ["function_call"]
    call = first["output"][0]
    assert call["name"] == "get_weather" and call["call_id"].startswith("call_")
    jsonschema.validate(json.loads(call["arguments"]), WEATHER["parameters"])
    done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    deltas = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert [d["arguments"] for d in done] == ["".join(deltas)] == [call["arguments"]]
    # The stored conversation holds the call, so its output's call_id matches it.
    answer = live_server.client().responses.create(
        model="", previous_response_id=first["id"], tools=[WEATHER], temperature=0,
        max_output_tokens=12, input=[{"type": "function_call_output",
                                      "call_id": call["call_id"], "output": "22 and sunny"}])
    assert answer.output[0].type == "message" and answer.output_text
    assert answer.usage.input_tokens > first["usage"]["input_tokens"]


@live
def test_previous_response_id_over_three_turns_reuses_the_cache(live_server, schema_errors):
    client = live_server.client()
    turns, previous = [], None
    for question in ("Name a fruit.", "Name a color.", "Name an animal."):
        response = client.responses.create(model="", input=question, max_output_tokens=5,
                                           temperature=0, previous_response_id=previous,
                                           instructions="Answer with one word.")
        turns.append(response)
        previous = response.id
    inputs = [t.usage.input_tokens for t in turns]
    cached = [t.usage.input_tokens_details.cached_tokens for t in turns]
    assert inputs[0] < inputs[1] < inputs[2]
    assert cached[0] < cached[1] < cached[2], cached
    # Each turn's prompt starts with the whole previous turn, answer included.
    assert cached[2] >= inputs[1] + turns[1].usage.output_tokens - 2
    items = client.responses.input_items.list(turns[2].id)
    assert [i.content[0].text for i in items.data] == ["Name an animal."]


@live
def test_retrieve_input_items_delete(live_server, http, schema_errors):
    client = live_server.client()
    created = client.responses.create(model="", input=[
        {"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi!"}],
        max_output_tokens=4, temperature=0, metadata={"case": "store"})
    got = http.get(f"/v1/responses/{created.id}").json()
    assert schema_errors("Response", got) == []
    assert got["id"] == created.id and got["metadata"] == {"case": "store"}
    assert got["output"][0]["content"][0]["text"] == created.output_text
    listed = http.get(f"/v1/responses/{created.id}/input_items", params={"order": "asc"}).json()
    assert schema_errors("ResponseItemList", listed) == []
    assert [i["role"] for i in listed["data"]] == ["developer", "user"]
    assert client.responses.input_items.list(created.id, limit=1).data[0].role == "user"
    metrics = http.get("/metrics").text
    stored = live_server.gateway.responses.nbytes
    assert f"seqgate_response_store_bytes {float(stored)}" in metrics and stored > 0
    client.responses.delete(created.id)
    for path in (created.id, f"{created.id}/input_items"):
        missing = http.get(f"/v1/responses/{path}")
        assert missing.status_code == 404 and created.id in missing.json()["error"]["message"]
    unstored = client.responses.create(model="", input="Hi!", max_output_tokens=2, store=False)
    assert http.get(f"/v1/responses/{unstored.id}").status_code == 404


def test_options_names_every_method_of_a_stored_response(http):
    """GET and DELETE share the path: OPTIONS names both (Litestar 2 named one)."""
    for path, allowed in (("/v1/responses/resp_x", "DELETE, GET, OPTIONS"),
                          ("/v1/responses/resp_x/input_items", "GET, OPTIONS"),
                          ("/v1/chat/completions", "OPTIONS, POST")):
        reply = http.options(path)
        assert (reply.status_code, reply.headers["allow"]) == (204, allowed), path


@live
def test_cancel_a_running_stream(live_server, http, schema_errors):
    body = {"input": "Count from one to one hundred.", "max_output_tokens": 400,
            "temperature": 0, "stream": True, "ignore_eos": True}
    events: list[dict] = []
    with httpx.stream("POST", live_server.base_url + "/responses", json=body,
                      timeout=120) as response:
        lines = response.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
            if events and events[-1]["type"] == "response.output_text.delta":
                break
        rid = events[0]["response"]["id"]
        cancelled = http.post(f"/v1/responses/{rid}/cancel")
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
        events += [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    check_events(events, schema_errors)
    assert events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["status"] == "cancelled"
    assert events[-1]["response"]["usage"]["output_tokens"] < 400
    assert http.get(f"/v1/responses/{rid}").json()["status"] == "cancelled"
    again = http.post(f"/v1/responses/{rid}/cancel")
    assert again.status_code == 400 and again.json()["error"]["param"] == "response_id"


BAD = [
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, 400, "input[0].type"),
    ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]}, 400,
     "input[0].call_id"),
    ({"input": "hi", "previous_response_id": "resp_missing"}, 404, "previous_response_id"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, 400, "tools[0].type"),
    ({"input": "hi", "background": True}, 400, "background"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400,
     "input[0].content[0].type"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "schema": {}}}}, 400,
     "text.format.name"),
    ({"input": "hi", "tools": [{"type": "function", "name": "bad name!"}]}, 400,
     "tools[0].name"),
    ({"input": [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": "[1]"}]},
     400, "input[0].arguments"),
    ({"input": [{"role": "tool", "content": "x"}]}, 400, "input[0].role"),
    ({"instructions": "hi"}, 400, "input"),
]


@live
def test_bad_input_is_refused_by_name_before_the_engine(live_server, http):
    before = live_server.engine.stats().prompt_tokens
    for body, status, param in BAD:
        r = http.post("/v1/responses", json=body)
        error = r.json()["error"]
        assert (r.status_code, error["param"]) == (status, param), (body, error)
        assert (param if status == 400 else body[param]) in error["message"], error
        assert isinstance(error["code"], str) and error["type"]
    # Over the context: named as chat names it (the prompt), the message says by how much.
    r = http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 10**7})
    error = r.json()["error"]
    assert (r.status_code, error["code"], error["param"]) == (400, "context_length_exceeded",
                                                              "input")
    assert f"{10**7} for the completion" in error["message"]
    missing = http.get("/v1/responses/resp_nope")
    assert missing.status_code == 404 and "resp_nope" in missing.json()["error"]["message"]
    assert http.delete("/v1/responses/resp_nope").status_code == 404
    assert http.post("/v1/responses/resp_nope/cancel").status_code == 404
    assert live_server.engine.stats().prompt_tokens == before


@live
def test_a_key_sees_only_its_own_responses(auth_server):
    one, two = (auth_server.client(api_key=k) for k in API_KEYS)
    created = one.responses.create(model="", input="Hi!", max_output_tokens=2)
    assert one.responses.retrieve(created.id).id == created.id
    with pytest.raises(openai.NotFoundError):
        two.responses.retrieve(created.id)
    with pytest.raises(openai.NotFoundError):
        two.responses.create(model="", input="Hi!", previous_response_id=created.id,
                             max_output_tokens=2)


# -- the OpenAI Agents SDK and LangChain ------------------------------------------------------

@live
def test_agents_sdk_runs_a_tool_loop_to_a_final_answer(live_server):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    seen: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        seen.append(city)
        return f"22 degrees and sunny in {city}"

    model = agents.OpenAIResponsesModel(model=live_server.gateway.model_name,
                                        openai_client=live_server.async_client())
    agent = agents.Agent(name="weather", instructions="Answer the user's question.",
                         tools=[get_weather], model=model,
                         model_settings=agents.ModelSettings(
                             temperature=0, max_tokens=40, parallel_tool_calls=False,
                             tool_choice="required", extra_args={"store": False}),
                         reset_tool_choice=True)
    result = agents.Runner.run_sync(agent, ASK, max_turns=3)
    assert seen, "the tool was never called"
    assert isinstance(result.final_output, str) and result.final_output.strip()


@live
def test_langchain_responses_invoke_stream_tools_and_structured_output(live_server):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        return f"22 degrees and sunny in {city}"

    model = ChatOpenAI(base_url=live_server.base_url, api_key="unused", model="",
                       temperature=0, max_tokens=6, max_retries=0, timeout=120,
                       use_responses_api=True)
    answer = model.invoke("Name a fruit.")
    assert answer.text and answer.usage_metadata["output_tokens"] >= 1
    assert "".join(chunk.text for chunk in model.stream("Name a fruit.")) == answer.text
    model = model.model_copy(update={"max_tokens": 40})  # room for a whole call
    bound = model.bind_tools([get_weather], tool_choice="get_weather", parallel_tool_calls=False)
    question = HumanMessage(ASK)
    call = bound.invoke([question])
    assert call.tool_calls and call.tool_calls[0]["name"] == "get_weather"
    result = ToolMessage(get_weather.invoke(call.tool_calls[0]["args"]),
                         tool_call_id=call.tool_calls[0]["id"])
    final = model.bind_tools([get_weather]).invoke([question, call, result])
    assert final.text and not final.tool_calls
    city = model.with_structured_output(City).invoke("Tell me about Paris.")
    assert isinstance(city, City) and city.name

