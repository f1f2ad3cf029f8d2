"""DJL-serving's /invocations and /ping, as the seed's curl calls them."""

from __future__ import annotations

import json

import httpx
import pytest

pytestmark = pytest.mark.slow  # a live server with the real model

SEED_REQUEST = {
    "inputs": "The new movie that got Oscar this year",
    "parameters": {"max_new_tokens": 8, "do_sample": False},
    "cached_prompt": "This is a prompt that will be cached and appended to the front of the "
                     "inputs strings.",
}


def test_ping(http):
    assert http.get("/ping").json() == {"status": "Healthy"}


def test_json_output_and_prompt_cache(http, live_server):
    engine = live_server.engine
    first = http.post("/invocations", json=SEED_REQUEST)
    assert first.status_code == 200, first.text
    assert set(first.json()) == {"generated_text"} and first.json()["generated_text"]
    hits = engine.stats().cache_hits
    again = http.post("/invocations", json={**SEED_REQUEST,
                                            "parameters": {**SEED_REQUEST["parameters"],
                                                           "details": True}}).json()
    assert engine.stats().cache_hits == hits + 1  # the cached_prompt's KV was reused
    assert again["generated_text"] == first.json()["generated_text"]  # greedy, cache or not
    details = again["details"]
    assert details["inputs"] == SEED_REQUEST["inputs"]
    assert details["finish_reason"] in ("length", "eos_token", "stop_sequence")
    assert details["generated_tokens"] == len(details["tokens"]) <= 8
    assert "".join(t["text"] for t in details["tokens"]) == again["generated_text"]
    assert all(set(t) == {"id", "text", "log_prob"} and t["log_prob"] <= 0
               for t in details["tokens"])


def test_list_inputs_give_a_list(http):
    r = http.post("/invocations", json={"inputs": ["Hello", "Goodbye"],
                                        "parameters": {"max_new_tokens": 4}})
    assert r.status_code == 200 and len(r.json()) == 2
    assert all("generated_text" in x for x in r.json())


def check_jsonlines(response: httpx.Response, details: bool) -> list[dict]:
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("application/jsonlines")
    lines = [json.loads(line) for line in response.iter_lines() if line]
    assert all("token" in line and set(line["token"]) == {"id", "text", "log_prob"}
               for line in lines)
    last = lines[-1]
    assert last["generated_text"] == "".join(line["token"]["text"] for line in lines)
    assert ("details" in last) == details
    assert all("generated_text" not in line for line in lines[:-1])
    return lines


def test_jsonlines_output_formatter(jsonlines_server):
    body = {**SEED_REQUEST, "parameters": {"max_new_tokens": 6, "details": True}}
    with httpx.stream("POST", jsonlines_server.url + "/invocations", json=body,
                      timeout=60) as r:
        lines = check_jsonlines(r, details=True)
    assert lines[-1]["details"]["generated_tokens"] == len(lines)


def test_stream_field_selects_jsonlines(http):
    with http.stream("POST", "/invocations", json={"inputs": "Hi", "stream": True,
                                                   "parameters": {"max_new_tokens": 4}}) as r:
        check_jsonlines(r, details=False)
