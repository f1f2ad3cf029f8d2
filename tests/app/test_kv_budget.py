"""The KV budget through a real server: 32 concurrent requests under a budget of 8 rows answer
as an unbudgeted engine does, /metrics shows the peak within the budget, and a request too
large for the budget alone is a 400 naming the parameter to reduce."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine import EngineConfig
from tests.app.conftest import LiveServer, own_engine_server
from tests.engine.helpers import (
    BUDGET_NEW_TOKENS,
    budget_workload,
    eight_rows_budget,
    unbudgeted_outputs,
)

pytestmark = pytest.mark.slow


def metric(srv: LiveServer, name: str) -> float:
    text = httpx.get(srv.url + "/metrics").text
    return next(sample.value for family in text_string_to_metric_families(text)
                for sample in family.samples if sample.name == name)


@pytest.fixture(scope="module")
def budget_server(smollm2) -> Iterator[LiveServer]:
    budget = eight_rows_budget(smollm2, budget_workload(smollm2.tokenizer))
    yield from own_engine_server(smollm2, EngineConfig(max_rolling_batch_size=32,
                                                       kv_cache_bytes=budget))


def test_32_concurrent_requests_within_a_budget_of_8_rows(smollm2, budget_server):
    prompts = budget_workload(smollm2.tokenizer)
    want = unbudgeted_outputs(smollm2, prompts)

    def complete(ids: list[int]) -> str:
        r = httpx.post(budget_server.url + "/v1/completions", timeout=300,
                       json={"prompt": ids, "max_tokens": BUDGET_NEW_TOKENS, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(complete, prompts))
    assert got == [w["text"] for w in want]
    budget = budget_server.engine.kv_budget.batch
    assert metric(budget_server, "seqgate_kv_cache_budget_bytes") == budget
    assert 0 < metric(budget_server, "seqgate_kv_cache_peak_bytes") <= budget
    assert budget_server.engine.stats().peak_kv_bytes <= budget
    assert metric(budget_server, "seqgate_prompt_cache_budget_bytes") == \
        budget_server.engine.prefix_cache.capacity_bytes


def test_a_request_too_large_for_the_budget_is_a_400_naming_its_parameter(budget_server):
    limit = budget_server.engine.kv_budget.batch_tokens
    chat = httpx.post(budget_server.url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": limit})
    assert chat.status_code == 400
    error = chat.json()["error"]
    assert error["param"] == "max_tokens" and error["code"] == "context_length_exceeded"
    assert error["message"].startswith("max_tokens is too large for this server's KV cache")
    assert f"at most {limit} tokens" in error["message"]
    long = httpx.post(budget_server.url + "/v1/completions", timeout=60, json={
        "prompt": [1] * limit, "max_tokens": 1})
    assert long.status_code == 400 and long.json()["error"]["param"] == "prompt"
