"""Start-up as clients see it: the port answers while the model loads (503 + Retry-After, never
"connection refused"), turns ready once the model has answered, and reports a failed load."""

from __future__ import annotations

import gc
import threading
import time

import httpx
import pytest

from adapters.errors import LOADING_RETRY_AFTER
from app.factory import create_app
from engine import Engine, EngineConfig
from engine.errors import ModelLoadError
from tests.app.conftest import settings, start_server

pytestmark = pytest.mark.slow

CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}


def wait_for(predicate, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_port_answers_503_while_the_model_loads(smollm2):
    """The load is held on a gate so the loading window is as long as the test needs; what is
    loaded behind it is the real model."""
    gate = threading.Event()

    def slow_engine(config: EngineConfig) -> Engine:
        assert gate.wait(60)
        return Engine(config, loaded=smollm2)

    app = create_app(settings())
    app.state.gateway.build_engine = slow_engine
    srv = start_server(app)
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            health = c.get("/health")
            assert health.status_code == 503 and health.json() == {"status": "loading"}
            assert health.headers["retry-after"] == str(LOADING_RETRY_AFTER)
            for method, path, body in (("POST", "/v1/chat/completions", CHAT),
                                       ("POST", "/v1/completions", {"prompt": "x"}),
                                       ("GET", "/v1/models", None),
                                       ("POST", "/invocations", {"inputs": "x"}),
                                       ("POST", "/tokenize", {"prompt": "x"})):
                r = c.request(method, path, json=body)
                assert r.status_code == 503, (path, r.text)
                assert r.json()["error"]["code"] == "service_unavailable"
                assert "loading" in r.json()["error"]["message"]
                assert r.headers["retry-after"]
            assert c.get("/ping").status_code == 503
            assert c.get("/metrics").status_code == 200  # operators can watch the load
            gate.set()
            wait_for(lambda: c.get("/health").status_code == 200)
            r = c.post("/v1/chat/completions", json=CHAT)
            assert r.status_code == 200, r.text
    finally:
        gate.set()
        srv.stop()
    assert srv.gateway.engine.draining  # the lifespan stopped the engine it loaded


def test_a_failed_load_is_reported_and_settles():
    def broken(config: EngineConfig) -> Engine:
        raise ModelLoadError("no such model: /nowhere")

    app = create_app(settings())
    app.state.gateway.build_engine = broken
    srv = start_server(app)
    try:
        wait_for(srv.gateway.settled.is_set)
        assert "no such model" in srv.gateway.load_error
        health = httpx.get(srv.url + "/health")
        assert health.status_code == 503 and health.json() == {"status": "failed"}
        r = httpx.post(srv.url + "/v1/chat/completions", json=CHAT)
        assert r.status_code == 503 and "failed to load" in r.json()["error"]["message"]
    finally:
        srv.stop()


def test_a_serving_server_keeps_its_objects_out_of_full_collections(gateway_engine):
    """Once ready, the server freezes what start-up left alive (`gc.freeze`): a full collection
    no longer walks the model's objects (0.2 s holding the GIL, a stall for every stream).
    Stopping it unfreezes them, so a process that outlives it can collect them again."""
    srv = start_server(create_app(settings(), engine=gateway_engine))
    try:
        tracked = {id(o) for o in gc.get_objects()}  # frozen objects are not listed
        model = gateway_engine.loaded.model
        assert id(model) not in tracked and id(gateway_engine) not in tracked
        assert gc.get_freeze_count() > 10_000
    finally:
        srv.stop()
    assert gc.get_freeze_count() == 0
    assert any(o is gateway_engine for o in gc.get_objects())

