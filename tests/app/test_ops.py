"""Operations routes: health, version, metrics, tokenizer, the OpenAPI document."""

from __future__ import annotations

import pytest
from openapi_spec_validator import validate

pytestmark = pytest.mark.slow  # a live server with the real model


def test_health_and_version(http, live_server):
    assert http.get("/health").json() == {"status": "ok"}
    version = http.get("/version").json()
    assert version["model"] == live_server.gateway.model_name
    assert version["engine"]["max_rolling_batch_size"] == 8 and version["torch"]
    # the paths this host's engine chose, as the engine reports them
    kernels, engine = version["engine"]["kernels"], live_server.engine
    assert kernels["decode_attention_layers"] == engine.decode_kernel_layers
    # not quantised: the KV in the model's dtype
    assert kernels["kv_cache_dtype"] == str(engine.loaded.dtype).removeprefix("torch.") \
        == str(engine.kv_dtype).removeprefix("torch.")
    blocks = engine.linear_blocks
    assert kernels["linear"] == {"mode": blocks.mode, "q4_layers": blocks.q4_layers,
                                 "q8_layers": blocks.q8_layers, "h16_layers": blocks.h16_layers,
                                 "int8_rows": blocks.int8_rows, "max_rows": blocks.max_rows,
                                 "ms_per_pass_kernel_vs_torch": blocks.timings}
    assert kernels["w8a8"] is None and engine.int8_layers.layers == 0  # only where asked
    native = engine.native_layers
    assert kernels["native_layers"] == ({
        "layers": native.layers, "max_rows": native.max_rows,
        "ms_per_pass_blocks_vs_dense": native.timings} if native.layers else None)
    assert native.layers in (0, engine.lean_layers)
    assert version["engine"]["speculative"] == {
        "method": "ngram", "model": None,
        "num_speculative_tokens": engine.config.num_speculative_tokens,
        "speculative_max_rows": engine.config.speculative_max_rows}


def test_tokenize_detokenize_round_trip(http, live_server):
    tok = live_server.engine.tokenizer
    r = http.post("/tokenize", json={"prompt": "Hello world"}).json()
    assert r["tokens"] == tok.encode("Hello world") and r["count"] == len(r["tokens"])
    assert http.post("/detokenize", json={"tokens": r["tokens"]}).json() == {
        "prompt": "Hello world"}
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert tok.decode(chat["tokens"]).endswith("<|im_start|>assistant\n")
    assert http.post("/tokenize", json={}).status_code == 400
    assert http.post("/detokenize", json={"tokens": [10**9]}).json()["error"]["param"] == "tokens"


def test_metrics_cover_requests_engine_and_latency(http, live_server):
    http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                            "max_tokens": 3, "temperature": 0, "stream": True})
    http.post("/v1/chat/completions", json={"messages": []})
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    for name in ("seqgate_http_requests_total", "seqgate_queue_depth",
                 "seqgate_running_sequences", "seqgate_step_sub_batches_bucket",
                 "seqgate_step_sparsity_bucket", "seqgate_prompt_cache_hits_total",
                 "seqgate_prompt_cache_cached_tokens_total",
                 "seqgate_prompt_cache_misses_total", "seqgate_prompt_cache_evictions_total",
                 "seqgate_prompt_cache_entries", "seqgate_prompt_tokens_total",
                 "seqgate_generated_tokens_total", "seqgate_time_to_first_token_seconds_bucket",
                 "seqgate_time_per_output_token_seconds_bucket", "seqgate_kv_cache_bytes",
                 "seqgate_kv_cache_peak_bytes"):
        assert name in text, name
    lines = text.splitlines()
    peak = next(line for line in lines if line.startswith("seqgate_kv_cache_peak_bytes"))
    assert float(peak.split()[-1]) > 0  # the streamed request ran in the batch
    budget = next(line for line in lines
                  if line.startswith("seqgate_prompt_cache_budget_bytes"))
    assert float(budget.split()[-1]) == live_server.engine.prefix_cache.capacity_bytes > 0
    assert 'route="/v1/chat/completions",status="400"' in text
    assert 'route="/v1/chat/completions",status="200"' in text


def test_openapi_document_is_served_and_valid(http):
    doc = http.get("/docs/openapi.json").json()
    validate(doc)
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/invocations", "/health",
            "/metrics", "/tokenize", "/detokenize", "/version", "/ping"} <= set(doc["paths"])
    op = doc["paths"]["/v1/chat/completions"]["post"]
    assert op["operationId"] == "createChatCompletion"
    assert "messages" in op["requestBody"]["content"]["application/json"]["schema"]["properties"]
    assert http.get("/docs").status_code == 200
