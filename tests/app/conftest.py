"""Live servers for the app tests: real uvicorn on free loopback ports, one real SmolLM2
(`smollm2`, loaded once per session by tests/conftest.py).

`live_server` is the main one (session-wide). Others share its engine or at least its weights:
`auth_server` (API keys), `jsonlines_server` and `thinking_server` (a reasoning parser) share
the engine; `tiny_server` has its own engine with one batch slot and no queue, to reach 429 on
demand.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest
import uvicorn
from litestar import Litestar

from app.factory import create_app
from app.lifespan import GatewayState
from app.settings import ServerSettings, Settings
from engine import Engine, EngineConfig
from tests.app.schema import load_schema_errors

API_KEYS = ("sk-test-one", "sk-test-two")
MAX_REQUEST_BYTES = 256 * 1024


@dataclass
class LiveServer:
    """A running app: its URL, the app, its gateway state and engine."""

    url: str
    app: Litestar
    server: uvicorn.Server
    thread: threading.Thread

    @property
    def gateway(self) -> GatewayState:
        return self.app.state.gateway

    @property
    def engine(self) -> Engine:
        return self.gateway.engine

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key=kw.pop("api_key", "unused"),
                             max_retries=0, timeout=120, **kw)

    def async_client(self, **kw) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.base_url, api_key=kw.pop("api_key", "unused"),
                                  max_retries=0, timeout=120, **kw)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def start_server(app: Litestar) -> LiveServer:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("test server did not start")
        time.sleep(0.02)
    return LiveServer(f"http://127.0.0.1:{port}", app, server, thread)


def settings(**server) -> Settings:
    # Short keep-alive pings, so every stream in the tests carries comment lines that the clients
    # must skip, as they would behind a slow prefill.
    defaults = {"max_request_bytes": MAX_REQUEST_BYTES, "sse_ping_seconds": 0.05}
    return Settings(server=ServerSettings(**{**defaults, **server}),
                    engine=EngineConfig(max_rolling_batch_size=8))


@pytest.fixture(scope="session")
def gateway_engine(smollm2) -> Iterator[Engine]:
    engine = Engine(EngineConfig(max_rolling_batch_size=8), loaded=smollm2)
    engine.start()
    yield engine
    engine.stop(drain=False)


@pytest.fixture(scope="session")
def live_server(gateway_engine) -> Iterator[LiveServer]:
    srv = start_server(create_app(settings(), engine=gateway_engine))
    yield srv
    srv.stop()


# A grammar that writes a think block before the answer, for a model that does not think.
THINK_THEN_ANSWER = r"<think>[a-z ]{4,30}</think>\n\n[A-Z][a-z ]{4,30}\."


@pytest.fixture(scope="session")
def thinking_server(gateway_engine) -> Iterator[LiveServer]:
    """A server that splits `<think>` blocks (--reasoning-parser think) over the shared engine;
    a `guided_regex` of THINK_THEN_ANSWER forces its answers through a think block."""
    srv = start_server(create_app(settings(reasoning_parser="think"), engine=gateway_engine))
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def auth_server(gateway_engine) -> Iterator[LiveServer]:
    srv = start_server(create_app(settings(api_keys=API_KEYS), engine=gateway_engine))
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def jsonlines_server(gateway_engine) -> Iterator[LiveServer]:
    srv = start_server(create_app(settings(output_formatter="jsonlines"), engine=gateway_engine))
    yield srv
    srv.stop()


def own_engine_server(loaded, config: EngineConfig) -> Iterator[LiveServer]:
    """A server over an engine of its own with `config` (for a fixture to yield from)."""
    engine = Engine(config, loaded=loaded)
    engine.start()
    srv = start_server(create_app(Settings(server=ServerSettings(), engine=config),
                                  engine=engine))
    yield srv
    srv.stop()
    engine.stop(drain=False)


@pytest.fixture(scope="module")
def tiny_server(smollm2) -> Iterator[LiveServer]:
    yield from own_engine_server(smollm2, EngineConfig(max_rolling_batch_size=1,
                                                       job_queue_size=0))


@pytest.fixture(scope="session")
def schema_errors():
    return load_schema_errors()


@pytest.fixture
def http(live_server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live_server.url, timeout=120) as client:
        yield client
