"""The soak harness's pure parts: the request mix, the bad inputs, stream classification, the
/metrics and schemathesis parsers, and the report (no server, no model)."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from bench.scrape import parse
from bench.sharegpt import Request
from bench.soak import (
    abort_free,
    log_errors,
    parse_fuzz_output,
    prefix_cache_fill,
    request_outcomes,
    under_load,
    window_growth,
)
from bench.soak_report import (
    category,
    drain_ending,
    drain_summary,
    longest_silence,
    render,
    targets,
    traffic_summary,
)
from bench.soak_traffic import (
    BAD_INPUTS,
    CHAT_PATH,
    COMPLETIONS_PATH,
    COUNT_TOKENS_PATH,
    MESSAGES_PATH,
    RESPONSES_PATH,
    MixShares,
    Outcome,
    RequestMix,
    ServedModel,
    anthropic_error_problem,
    bad_request,
    classify_named_stream,
    classify_stream,
    envelope_problem,
    error_code,
)

SERVED = ServedModel("SmolLM2-135M-Instruct", 2048)


def _exchanges(n: int = 5) -> list[Request]:
    return [Request(f"<prompt {i}>", [{"role": "user", "content": f"question {i}"}], [1, 2, 3],
                    8 + i) for i in range(n)]


def _draw(count: int, seed: int = 0, **shares) -> list:
    mix = RequestMix(_exchanges(), SERVED, seed, MixShares(**shares))
    return [mix.next() for _ in range(count)]


def test_the_mix_is_reproducible_from_its_seed():
    assert _draw(50, seed=3) == _draw(50, seed=3)
    assert _draw(50, seed=3) != _draw(50, seed=4)


def test_the_mix_has_every_trait_in_about_its_share():
    reqs = _draw(4000)
    share = lambda pred: sum(map(pred, reqs)) / len(reqs)  # noqa: E731
    assert share(lambda r: r.bad) == pytest.approx(0.05, abs=0.015)
    good = [r for r in reqs if not r.bad]
    cut = [r for r in good if r.cut_after_events or r.cut_after_s]
    assert len(cut) / len(good) == pytest.approx(0.10, abs=0.02)
    assert all(r.stream == (r.cut_after_events is not None) for r in cut)
    bodies = [json.loads(r.body) for r in good]
    routes = [r.path for r in good]
    assert routes.count(COMPLETIONS_PATH) / len(good) == pytest.approx(0.25, abs=0.03)
    assert routes.count(RESPONSES_PATH) / len(good) == pytest.approx(0.15, abs=0.03)
    assert routes.count(MESSAGES_PATH) / len(good) == pytest.approx(0.10, abs=0.03)
    assert routes.count(CHAT_PATH) / len(good) == pytest.approx(0.50, abs=0.03)
    assert any(b.get("n") == 2 for b in bodies) and any("stop" in b for b in bodies)
    assert any("stop_sequences" in b for b in bodies)
    assert any(b.get("store") is False for b in bodies)
    assert any(b["temperature"] == 0 for b in bodies) and any("seed" in b for b in bodies)
    assert all(b["stream"] == r.stream for b, r in zip(bodies, good))
    assert all(b.get("max_tokens", b.get("max_output_tokens")) <= 12 for b in bodies)


def test_good_requests_fit_their_route():
    fields = {CHAT_PATH: ("messages", "max_tokens"), COMPLETIONS_PATH: ("prompt", "max_tokens"),
              RESPONSES_PATH: ("input", "max_output_tokens"),
              MESSAGES_PATH: ("messages", "max_tokens")}
    for r in _draw(300, bad=0.0):
        body = json.loads(r.body)
        assert all(f in body for f in fields[r.path]), r.kind
        assert {"prompt", "input"} & set(body) == {"prompt", "input"} & set(fields[r.path])
        assert body["model"] == SERVED.name
        assert r.kind.split("-")[0] == {CHAT_PATH: "chat", COMPLETIONS_PATH: "completion",
                                        RESPONSES_PATH: "responses",
                                        MESSAGES_PATH: "messages"}[r.path]
        if r.path == MESSAGES_PATH:  # Anthropic's API has neither n, seed nor stop
            assert not {"n", "seed", "stop"} & set(body) and body["temperature"] <= 1.0
        if r.path == RESPONSES_PATH:
            assert not {"n", "stop", "stream_options"} & set(body)
        assert r.stored == (r.path == RESPONSES_PATH and body.get("store") is not False)


def test_responses_continue_the_stored_ones_the_mix_was_told_of():
    mix = RequestMix(_exchanges(), SERVED, 0, MixShares(bad=0.0, responses=1.0, completions=0.0,
                                                         messages=0.0))
    assert all("previous_response_id" not in json.loads(mix.next().body) for _ in range(50))
    mix.remember(_o(response_id="resp_1"))
    mix.remember(_o(response_id=None))  # not stored: nothing to continue
    continued = [json.loads(r.body) for r in (mix.next() for _ in range(200))
                 if "continued" in r.kind]
    assert len(continued) == pytest.approx(60, abs=20)
    assert all(b["previous_response_id"] == "resp_1" for b in continued)


@pytest.mark.parametrize("name", sorted(BAD_INPUTS))
def test_every_bad_input_is_bad(name):
    req = bad_request(name, SERVED, random.Random(0))
    assert req.bad and not req.stream and req.kind == f"bad:{name}"
    assert (req.path in (MESSAGES_PATH, COUNT_TOKENS_PATH)) == name.startswith("anthropic-")
    assert (req.path == RESPONSES_PATH) == name.startswith("responses-")
    try:
        body = json.loads(req.body)
    except (ValueError, UnicodeDecodeError):
        assert name in ("malformed-json", "not-utf8", "anthropic-malformed-json")
        return
    assert name not in ("malformed-json", "not-utf8", "anthropic-malformed-json")
    if name == "huge-stop-strings":
        assert len(body["stop"]) == 2 and all(len(s) >= 1_000_000 for s in body["stop"])
    if name == "over-long-prompt":
        assert len(body["prompt"]) > SERVED.max_model_len
    if name == "too-many-logit-bias":
        assert len(body["logit_bias"]) > 1024
    if name == "negative-max-tokens":
        assert body["max_tokens"] < 0
    if name == "unknown-model":
        assert body["model"] != SERVED.name


def test_error_envelopes():
    good = {"error": {"message": "m", "type": "invalid_request_error", "param": None,
                      "code": "invalid_value"}}
    assert envelope_problem(json.dumps(good)) is None
    assert envelope_problem("Internal Server Error") == "error body is not JSON"
    assert envelope_problem('{"detail": "nope"}') == "error body has no `error` object"
    assert "param" in envelope_problem('{"error": {"message": "m", "type": "t", "code": "c"}}')
    assert envelope_problem('{"error": {"message": "m", "type": "t", "param": null, '
                            '"code": 400}}') is not None


def test_anthropic_error_shape():
    good = {"type": "error", "error": {"type": "invalid_request_error", "message": "m"}}
    assert anthropic_error_problem(json.dumps(good)) is None
    assert error_code(json.dumps(good)) == "invalid_request_error"
    assert "Anthropic" in anthropic_error_problem(json.dumps({"error": {"type": "x"}}))
    assert anthropic_error_problem(json.dumps({"type": "error", "error": {"type": 1,
                                                                        "message": "m"}}))
    # OpenAI's envelope is not Anthropic's shape, nor the other way round
    openai = {"error": {"message": "m", "type": "t", "param": None, "code": "c"}}
    assert anthropic_error_problem(json.dumps(openai)) is not None
    assert envelope_problem(json.dumps(good)) is not None


def test_named_event_streams():
    created = json.dumps({"type": "response.created", "response": {"id": "resp_1"}})
    done = json.dumps({"type": "response.completed", "response": {"id": "resp_1"}})
    end = classify_named_stream([created, done])
    assert (end.how, end.response_id) == ("done", "resp_1")
    failed = json.dumps({"type": "error", "code": "service_unavailable", "message": "m"})
    end = classify_named_stream([created, failed])
    assert (end.how, end.error_code) == ("error-then-done", "service_unavailable")
    overloaded = json.dumps({"type": "error", "error": {"type": "overloaded_error",
                                                        "message": "m"}})
    start = json.dumps({"type": "message_start", "message": {}})
    end = classify_named_stream([start, overloaded])
    assert (end.how, end.error_code) == ("error-then-done", "overloaded_error")
    assert classify_named_stream([start, json.dumps({"type": "message_stop"})]).how == "done"
    assert classify_named_stream([start, json.dumps({"type": "ping"})]).how == "truncated"
    # text that merely mentions an event's name is not that event
    delta = json.dumps({"type": "content_block_delta", "delta": {"text": '"message_stop"'}})
    assert classify_named_stream([start, delta]).how == "truncated"


def test_stream_classification():
    chunk = json.dumps({"choices": [{"delta": {"content": "hi"}}]})
    err = json.dumps({"error": {"message": "draining", "type": "server_error", "param": None,
                                "code": "service_unavailable"}})
    assert classify_stream([chunk, chunk, "[DONE]"]).how == "done"
    assert classify_stream([chunk, err, "[DONE]"]) == classify_stream([chunk, err, "[DONE]"])
    end = classify_stream([chunk, err, "[DONE]"])
    assert (end.how, end.error_code, end.events) == ("error-then-done", "service_unavailable", 3)
    assert classify_stream([chunk, err]).how == "error-no-done"
    assert classify_stream([chunk, chunk]).how == "truncated"
    assert classify_stream([]).how == "truncated"
    # content that merely mentions "error" is not an error event
    mention = json.dumps({"choices": [{"delta": {"content": '"error"'}}]})
    assert classify_stream([mention, "[DONE]"]).how == "done"


def _o(kind: str = "chat", started: float = 1.0, ended: float = 2.0, **fields) -> Outcome:
    return Outcome(kind, fields.pop("bad", False), fields.pop("stream", False), started, ended,
                   **fields)


def test_categories_and_drain_endings():
    assert category(_o(status=200)) == "ok"
    assert category(_o(cut=True)) == "client-disconnected"
    assert category(_o(status=None, problem="no answer")) == "no-answer"
    assert category(_o(status=400, code="invalid_json", bad=True)) == "4xx:invalid_json"
    assert category(_o(status=500, problem="HTTP 500")) == "5xx"
    assert category(_o(status=200, stream=True, stream_end="truncated")) == "stream-truncated"
    unavailable = _o(status=200, stream=True, stream_end="error-then-done",
                     code="service_unavailable")
    assert category(unavailable) == "503" and drain_ending(unavailable) == "service-unavailable"
    assert drain_ending(_o(status=200, stream=True, stream_end="done")) == "completed"
    assert drain_ending(_o(status=503, code="service_unavailable")) == "service-unavailable"
    overloaded = _o(status=200, stream=True, stream_end="error-then-done", code="overloaded_error")
    assert category(overloaded) == "503" and drain_ending(overloaded) == "service-unavailable"
    assert drain_ending(_o(status=400, bad=True, code="invalid_json")) == "refused-bad-input"
    assert drain_ending(_o(status=None, problem="no answer: ReadError")) == "other"


def test_metrics_parsers_and_their_absence():
    text = """\
# TYPE seqgate_abort_free_steps histogram
seqgate_abort_free_steps_bucket{le="1.0"} 5.0
seqgate_abort_free_steps_bucket{le="3.0"} 9.0
seqgate_abort_free_steps_bucket{le="10.0"} 10.0
seqgate_abort_free_steps_bucket{le="+Inf"} 10.0
seqgate_abort_free_steps_count 10.0
seqgate_abort_free_steps_sum 21.0
# TYPE seqgate_request_outcomes counter
seqgate_request_outcomes_total{route="chat",outcome="finished"} 40.0
seqgate_request_outcomes_total{route="chat",outcome="client_disconnected"} 4.0
seqgate_request_outcomes_total{route="completions",outcome="shutdown"} 2.0
"""
    samples = parse(text)
    assert abort_free(samples) == {"within": 9.0, "count": 10.0, "fraction": 0.9, "le": 3.0}
    assert request_outcomes(samples) == {"chat": {"finished": 40.0, "client_disconnected": 4.0},
                                         "completions": {"shutdown": 2.0}}
    assert abort_free({}) is None and request_outcomes({}) is None
    assert prefix_cache_fill({}) is None
    cache = parse("seqgate_prompt_cache_budget_bytes 1024.0\nseqgate_prompt_cache_bytes 1000.0\n"
                  "seqgate_prompt_cache_evictions_total 3.0\n")
    assert prefix_cache_fill(cache) == {"budget": 1024.0, "bytes": 1000.0, "evictions": 3.0}


def test_fuzz_output_parsing():
    text = """\
.............                                                            [100%]
--------------------------- schemathesis: 1068 cases ---------------------------
     10  document: GET /health
  document responses by status: 200: 27, 204: 11, 400: 916
  generation responses by status: 200: 28, 400: 2
1 failed, 12 passed in 20.02s
"""
    parsed = parse_fuzz_output(text)
    assert parsed == {"cases": 1068, "passed": 12, "failed": 1,
                      "statuses": {"document": {"200": 27, "204": 11, "400": 916},
                                   "generation": {"200": 28, "400": 2}}}
    assert parse_fuzz_output("ERROR: no server")["cases"] == 0


def _data(outcomes: list[Outcome], sigterm_at: float = 50.0, **metrics) -> dict:
    return {
        "meta": {"command": "python -m bench.soak --duration 60", "started": "t0",
                 "finished": "t1",
                 "machine": {"cpu": "cpu", "cores_available": 2, "memory_gib": 8, "os": "Linux",
                             "load_avg_1m_at_start": 0.1},
                 "versions": {"seqgate": "0.1.0", "seqgate_git_sha": "abcdef0123456"},
                 "args": {"concurrency": 16, "duration": 60.0, "drain_timeout": 5.0, "seed": 0}},
        "server": {"exit_code": 0, "exit_seconds": 3.2, "killed": False, "exit_deadline": 20.0,
                   "log_errors": []},
        "rss": {"start": 400 * 2**20, "warm": 500 * 2**20, "end": 510 * 2**20,
                "warmup_seconds": 6.0, "growth": 0.02},
        "metrics": {"abort_free": None, "request_outcomes": None, **metrics},
        "traffic": traffic_summary(outcomes, sigterm_at),
        "drain": drain_summary(outcomes, sigterm_at),
        "fuzz": None,
    }


def test_a_clean_run_passes_and_absent_metrics_read_na():
    steady = [_o(started=t, ended=t + 1.0, status=200) for t in range(0, 50, 5)]
    outcomes = [*steady, _o(cut=True), _o("bad:malformed-json", bad=True, status=400,
                                          code="invalid_json"),
                _o(started=49.0, ended=51.0, status=200, stream=True, stream_end="done"),
                _o("probe", 50.3, 50.4, status=503, code="service_unavailable", probe=True)]
    data = _data(outcomes)
    data["rss"]["response_store"] = [(5.0, 3.0, 1000.0), (10.0, 4.0, 2048.0)]
    data["server"]["response_store_bytes"] = 2048
    verdicts = {t.figure: t.passed for t in targets(data)}
    assert verdicts["/v1/responses store: peak bytes of the readings"] is True
    assert verdicts["drain probes answered 503 service_unavailable"] is True
    assert verdicts["aborted slots freed within 3 engine steps"] is None
    assert all(v is not False for v in verdicts.values())
    assert data["traffic"]["requests"] == 13 and data["drain"]["in_flight"] == 1
    text = render(data)
    assert "python -m bench.soak --duration 60" in text and "FAIL" not in text
    assert "`seqgate_request_outcomes_total`: n/a" in text and "## Findings\n\nNone." in text
    data["rss"]["prefix_cache"] = {"budget": 2**29, "bytes": 2**29 - 2**20, "evictions": 1.0,
                                   "full": True, "seconds": 41.6}
    assert ("went on 42 s past its fixed part, while the prefix cache filled up to its budget "
            "of 512.0 MiB, until it first evicted (full): 511.0 MiB held then.") in render(data)


def test_findings_fail_their_targets_and_are_quoted():
    outcomes = [_o(status=500, problem="HTTP 500", body="Internal Server Error"),
                _o(status=None, problem="no answer: ConnectError"),
                _o("bad:huge-stop-strings", bad=True, status=200,
                   problem="bad input accepted (200)"),
                _o(started=49.0, ended=55.0, status=None, problem="no answer: ReadError"),
                _o("bad:json-array", 10.0, 19.0, bad=True, status=400, code="invalid_type")]
    step = {"count": 6.0, "sum": 12.0, "mean": 2.0, "buckets": {}, "max_le": 10.0}
    data = _data(outcomes, abort_free={"within": 3.0, "count": 4.0, "fraction": 0.75},
                 request_outcomes={"/v1/chat/completions": {"client_disconnected": 6.0}},
                 engine_steps=6.0, step_seconds=step, prompt_cache_bytes=2.0**20)
    data["rss"].update(growth=0.25, median_growth=0.2, window_seconds=15.0)
    data["rss"]["series"] = [(0.0, 512 * 2**20), (5.0, 520 * 2**20)]
    data["rss"]["response_store"] = [(0.0, 3.0, 1000.0), (5.0, 9.0, 2049.0), (10.0, 8.0, 2000.0)]
    data["server"]["response_store_bytes"] = 2048
    failed = {t.figure for t in targets(data) if t.passed is False}
    store = {t.figure: t for t in targets(data)}["/v1/responses store: peak bytes of the readings"]
    assert (store.value, store.passed) == ("2 KiB (9 responses)", False)
    assert {"5xx answers (other than 503)", "requests with no HTTP answer",
            "bad inputs not refused with a 4xx error envelope",
            "RSS growth after warm-up (median of the first and last 15 s of load)",
            "in flight at SIGTERM: ended otherwise than completed / 503",
            "aborted slots freed within 3 engine steps",
            "slowest 4xx refusal of bad input"} <= failed
    text = render(data)
    assert "Internal Server Error" in text and "### 5xx answers (1)" in text
    assert "(s: MiB): 0: 512, 5: 520" in text and "prompt cache 1.0 MiB" in text
    assert "### Targets missed" in text
    assert "- RSS growth after warm-up (median of the first and last 15 s of load): 20.00%" in text
    assert "75.00%" in text and "mean 2.000 s over 6 steps, longest <= 10 s" in text
    assert "6 requests counted as client_disconnected, but only 4 aborts" in text


def test_every_bad_input_comes_up_once_per_round():
    reqs = _draw(2 * len(BAD_INPUTS), bad=1.0)
    first, second = reqs[:len(BAD_INPUTS)], reqs[len(BAD_INPUTS):]
    assert {r.kind for r in first} == {r.kind for r in second} == {f"bad:{n}" for n in BAD_INPUTS}


def test_server_log_errors_name_the_exception():
    log = """\
INFO:     127.0.0.1:1 - "POST /v1/chat/completions HTTP/1.1" 200 OK
ERROR - 2026-11-23 13:24:16,944 - seqgate.app.errors - unhandled error on POST /v1/chat/completions
Traceback (most recent call last):
  File "adapters/openai_types.py", line 277, in decode_request
    raw = msgspec.json.decode(body)
UnicodeDecodeError: 'utf-8' codec can't decode byte 0xff in position 0
INFO:     127.0.0.1:1 - "POST /v1/chat/completions HTTP/1.1" 500 Internal Server Error
"""
    errors = log_errors(log)
    assert len(errors) == 2 and "unhandled error" in errors[0]
    assert errors[1].strip().startswith("UnicodeDecodeError")


def test_a_stalled_server_is_a_long_silence():
    steady = [_o(started=t, ended=t + 1.0, status=200) for t in range(0, 50, 2)]
    assert longest_silence(steady, 50.0) == pytest.approx(2.0)
    stalled = steady[:3] + [_o(started=5.0, ended=8.0, cut=True)]
    assert longest_silence(stalled, 50.0) == pytest.approx(45.0)
    verdicts = {t.figure: t.passed for t in targets(_data(stalled))}
    assert verdicts["longest time without any answer (before SIGTERM)"] is False
    assert longest_silence([], 10.0) == 10.0


def test_the_load_stops_when_the_server_dies():
    """A crashed server ends the run at once (the clients would otherwise spin on refused
    connections) and fails the first target."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
    t0 = time.perf_counter()
    assert asyncio.run(under_load(SimpleNamespace(proc=proc), 30.0)) is False
    assert time.perf_counter() - t0 < 5.0
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
    try:
        assert asyncio.run(under_load(SimpleNamespace(proc=alive), 0.6)) is True
    finally:
        alive.kill()
        alive.wait()
    data = _data([_o(started=t, ended=t + 1.0, status=200) for t in range(0, 10, 2)])
    data["server"].update(died_at=12.5, exit_code=-11)
    verdicts = {t.figure: (t.value, t.passed) for t in targets(data)}
    assert verdicts["server ran until SIGTERM"] == ("no: exited with code -11 at 12.5 s", False)
    data["server"]["died_at"] = None
    assert {t.figure: t.passed for t in targets(data)}["server ran until SIGTERM"] is True


def test_rss_growth_compares_window_medians():
    # A flat 1,000 with ±100 of noise (the live KV at each instant): the medians see no growth,
    # where the sample right after the warm-up (900) and the last one (1,100) would say 22%.
    noise = (-100, 0, 100)
    series = [(float(t), 1000 + noise[(t // 5 + 2) % 3]) for t in range(0, 200, 5)]
    assert series[4] == (20.0, 900) and series[-1] == (195.0, 1100)
    got = window_growth(series, 20.0, 200.0)
    assert got["window_seconds"] == 27.0
    assert got["warm_median"] == got["end_median"] == 1000 and got["median_growth"] == 0.0
    rising = [(float(t), 1000 + 2 * t) for t in range(0, 200, 5)]
    assert window_growth(rising, 20.0, 200.0)["median_growth"] > 0.2
    assert window_growth(rising, 20.0, 40.0) == {}  # the two windows would overlap
