"""The limits an operator sets: tokens per request, a deadline per request, open requests per API
key, what /version tells a caller without a key, the start-up warning, and the request outcomes
that /metrics counts."""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from app.__main__ import warn_if_exposed
from app.factory import create_app
from app.settings import ServerSettings, Settings
from tests.app.conftest import API_KEYS, LiveServer, settings, start_server
from tests.app.sse import read_stream

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
LONG = {"messages": [{"role": "user", "content": "Tell me about the sea."}], "max_tokens": 2000,
        "temperature": 0, "ignore_eos": True}


def error_of(r: httpx.Response) -> dict:
    return r.json()["error"]


def wait_idle(srv: LiveServer, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while srv.engine.stats().running or srv.engine.stats().queued:
        assert time.monotonic() < deadline, "the engine kept the aborted job"
        time.sleep(0.02)


def metric(srv: LiveServer, name: str, **labels: str) -> float:
    """One sample of the server's /metrics (0 when absent)."""
    text = httpx.get(srv.url + "/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


@pytest.fixture(scope="module")
def limited_server(gateway_engine) -> Iterator[LiveServer]:
    srv = start_server(create_app(settings(max_tokens_limit=5), engine=gateway_engine))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def timeout_server(gateway_engine) -> Iterator[LiveServer]:
    srv = start_server(create_app(settings(request_timeout=0.5), engine=gateway_engine))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def keyed_server(gateway_engine) -> Iterator[LiveServer]:
    srv = start_server(create_app(settings(api_keys=API_KEYS, max_concurrent_per_key=1),
                                  engine=gateway_engine))
    yield srv
    srv.stop()


def test_max_tokens_limit_caps_and_refuses(limited_server):
    with httpx.Client(base_url=limited_server.url, timeout=60) as c:
        r = c.post(CHAT, json={**LONG, "max_tokens": 6})
        assert r.status_code == 400 and error_of(r)["param"] == "max_tokens"
        assert "--max-tokens-limit" in error_of(r)["message"]
        r = c.post(CHAT, json={"messages": LONG["messages"], "temperature": 0,
                               "ignore_eos": True})  # no max_tokens: the limit, not the context
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 5
        assert r.json()["choices"][0]["finish_reason"] == "length"
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 50})
        assert r.status_code == 400 and error_of(r)["param"] == "max_tokens"
        r = c.post("/invocations", json={"inputs": "x", "parameters": {"max_new_tokens": 50}})
        assert r.status_code == 400
        assert error_of(r)["param"] == "parameters.max_new_tokens"


def test_request_timeout_cancels_the_job(timeout_server):
    """A request still generating at --request-timeout is aborted: JSON gets 408, a stream an
    error event then [DONE]; the slot is free and the outcome is counted as timed_out. (2,000
    tokens take tens of seconds here: the 0.5 s deadline always comes first.)"""
    srv = timeout_server
    before = metric(srv, "seqgate_request_outcomes_total", route=CHAT, outcome="timed_out")
    t0 = time.monotonic()
    r = httpx.post(srv.url + CHAT, json=LONG, timeout=60)
    assert time.monotonic() - t0 < 5
    assert r.status_code == 408, r.text
    assert error_of(r)["code"] == "request_timeout"
    assert r.headers["x-should-retry"] == "false"
    with httpx.stream("POST", srv.url + CHAT, json={**LONG, "stream": True}, timeout=60) as r:
        raw = read_stream(r)
    assert raw.done and raw.events[-1]["error"]["code"] == "request_timeout"
    wait_idle(srv)
    after = metric(srv, "seqgate_request_outcomes_total", route=CHAT, outcome="timed_out")
    assert after == before + 2


def test_open_requests_per_key_are_capped(keyed_server):
    """One open request per key: a second one from the same key gets 429 while the first streams,
    another key and a refused request are not counted, and the key is free again once the first
    stream has been cut by its client (every route counts against the same key)."""
    srv = keyed_server
    one, two = ({"Authorization": f"Bearer {k}"} for k in API_KEYS)
    short = {**LONG, "max_tokens": 2}
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        with c.stream("POST", CHAT, json={**LONG, "stream": True}, headers=one) as held:
            # Keep the line iterator alive: once it is collected, httpx closes the connection.
            lines = held.iter_lines()
            next(line for line in lines if line.startswith("data: {"))
            for route, body in ((CHAT, short), ("/invocations", {"inputs": "x"}),
                                ("/v1/completions", {"prompt": "x", "max_tokens": 2})):
                refused = c.post(route, json=body, headers=one)
                assert refused.status_code == 429, (route, refused.text)
                assert error_of(refused)["code"] == "rate_limit_exceeded"
                assert refused.headers["retry-after"] == "1"
            other = c.post(CHAT, json=short, headers=two)
            assert other.status_code == 200, other.text  # another key is not affected
            assert c.post(CHAT, json=short).status_code == 401  # no key: the guard answers
            bad = c.post(CHAT, json={**short, "temperature": "hot"}, headers=two)
            assert bad.status_code == 400  # a refused request releases its count at once
            assert c.post(CHAT, json=short, headers=two).status_code == 200
            assert srv.engine.stats().running  # the held stream is still generating
        wait_idle(srv)
        again = c.post(CHAT, json=short, headers=one)
        assert again.status_code == 200, again.text
    assert not srv.gateway.key_limiter.open  # nothing left counted


def test_version_shows_settings_only_to_key_holders(keyed_server):
    anonymous = httpx.get(keyed_server.url + "/version").json()
    assert set(anonymous) == {"version"}
    full = httpx.get(keyed_server.url + "/version",
                     headers={"Authorization": f"Bearer {API_KEYS[0]}"}).json()
    assert full["engine"]["max_rolling_batch_size"] == 8 and full["model"]


def test_outcomes_and_abort_latency_are_counted(live_server):
    srv = live_server
    finished = metric(srv, "seqgate_request_outcomes_total", route=CHAT, outcome="finished")
    gone = metric(srv, "seqgate_request_outcomes_total", route=CHAT,
                  outcome="client_disconnected")
    aborts = metric(srv, "seqgate_abort_free_steps_count")
    ok = httpx.post(srv.url + CHAT, json={**LONG, "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200
    with httpx.stream("POST", srv.url + CHAT, json={**LONG, "stream": True}, timeout=60) as r:
        next(line for line in r.iter_lines() if line.startswith("data: {"))
    wait_idle(srv)
    assert metric(srv, "seqgate_request_outcomes_total", route=CHAT,
                  outcome="finished") == finished + 1
    assert metric(srv, "seqgate_request_outcomes_total", route=CHAT,
                  outcome="client_disconnected") == gone + 1
    # The step that drops the job records it when the step ends, a moment after the job
    # stops counting as running: poll briefly.
    deadline = time.monotonic() + 10
    while metric(srv, "seqgate_abort_free_steps_count") == aborts:
        assert time.monotonic() < deadline, "the abort was never recorded"
        time.sleep(0.02)
    assert metric(srv, "seqgate_abort_free_steps_count") == aborts + 1
    assert metric(srv, "seqgate_abort_free_steps_bucket", le="3.0") == aborts + 1


def test_a_client_gone_mid_upload_is_not_a_server_error(live_server, caplog):
    """Litestar raises a 500 when the body stops short; the server logs it at INFO and counts
    499, so neither the log nor /metrics shows a server error that was the client's doing."""
    srv = live_server
    caplog.set_level(logging.INFO, logger="seqgate")
    errors = metric(srv, "seqgate_http_requests_total", route=CHAT, status="500")
    gone = metric(srv, "seqgate_http_requests_total", route=CHAT, status="499")
    host, port = srv.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST " + CHAT.encode() + b" HTTP/1.1\r\nHost: seqgate\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 4096\r\n\r\n"
                     b'{"messages": [{"role": "user", "content": "Hel')
        time.sleep(0.2)  # the server is waiting for the rest of the body
    deadline = time.monotonic() + 10
    while metric(srv, "seqgate_http_requests_total", route=CHAT, status="499") == gone:
        assert time.monotonic() < deadline, "the cut upload was never counted"
        time.sleep(0.02)
    assert metric(srv, "seqgate_http_requests_total", route=CHAT, status="500") == errors
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert "client disconnected before the request" in caplog.text
    # The server still answers.
    assert httpx.post(srv.url + CHAT, json={**LONG, "max_tokens": 1}, timeout=60).status_code \
        == 200


@pytest.mark.parametrize(("host", "keys", "warned"), [
    ("0.0.0.0", (), True), ("192.0.2.7", (), True), ("example.org", (), True),
    ("0.0.0.0", ("k",), False), ("127.0.0.1", (), False), ("::1", (), False),
    ("localhost", (), False)])
def test_warning_when_listening_beyond_loopback_without_keys(caplog, host, keys, warned):
    caplog.set_level(logging.WARNING, logger="seqgate")
    warn_if_exposed(Settings(server=ServerSettings(host=host, api_keys=keys)))
    assert ("without API keys" in caplog.text) == warned
