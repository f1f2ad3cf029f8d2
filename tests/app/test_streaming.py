"""A client that leaves aborts its job: the batch slot is free within a few engine steps."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from tests.app.sse import read_stream

pytestmark = pytest.mark.slow  # a live server with the real model

LONG = {"messages": [{"role": "user", "content": "Write a long story about a lighthouse."}],
        "max_tokens": 2000, "temperature": 0, "ignore_eos": True}


def wait_until_idle(engine, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.stats().running or engine.stats().queued:
        assert time.monotonic() < deadline, f"engine still busy: {engine.stats()}"
        time.sleep(0.01)


def running_after_leaving(engine, leave) -> tuple[int, float]:
    """Steps and seconds between the client leaving and the engine's batch being empty."""
    steps = engine.stats().steps
    left = time.monotonic()
    leave()
    wait_until_idle(engine)
    return engine.stats().steps - steps, time.monotonic() - left


def wait_for_aborts(engine, count: int) -> None:
    """Aborts are counted when the step that freed the slot publishes, at its end: after the
    batch is already empty."""
    deadline = time.monotonic() + 10
    while engine.stats().finished_by_reason.get("abort", 0) < count:
        assert time.monotonic() < deadline, "the abort was never counted"
        time.sleep(0.01)
    assert engine.stats().finished_by_reason.get("abort", 0) == count


def test_stream_disconnect_aborts_the_job(live_server):
    engine = live_server.engine
    wait_until_idle(engine)
    r = httpx.Client(timeout=60).send(
        httpx.Request("POST", live_server.base_url + "/chat/completions",
                      json={**LONG, "stream": True}), stream=True)
    lines = r.iter_lines()
    got = [line for _, line in zip(range(40), lines) if line.startswith("data: {")]
    assert got and engine.stats().running == 1
    finished_before = dict(engine.stats().finished_by_reason)
    steps, _ = running_after_leaving(engine, r.close)
    assert steps <= 5, f"the slot took {steps} steps to free"
    wait_for_aborts(engine, finished_before.get("abort", 0) + 1)


def test_non_stream_disconnect_aborts_the_job(live_server):
    engine = live_server.engine
    wait_until_idle(engine)
    aborted = engine.stats().finished_by_reason.get("abort", 0)
    # A raw socket, so the test decides the exact moment the client goes away.
    body = json.dumps(LONG).encode()
    host, port = live_server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                 b"application/json\r\nContent-Length: " + str(len(body)).encode() +
                 b"\r\n\r\n" + body)
    deadline = time.monotonic() + 10
    while not engine.stats().running:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    joined = engine.stats().steps
    while engine.stats().steps < joined + 3:  # a few decode steps in
        assert time.monotonic() < deadline
        time.sleep(0.01)
    steps, _ = running_after_leaving(engine, sock.close)
    assert steps <= 5, f"the slot took {steps} steps to free"
    wait_for_aborts(engine, aborted + 1)


def test_stream_after_an_abort_is_unaffected(live_server):
    body = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 6,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", live_server.base_url + "/chat/completions", json=body) as r:
        stream = read_stream(r)
    assert stream.done and stream.text
