"""The app's long-lived state and the lifespan hook that owns the engine.

`GatewayState` sits on `app.state.gateway` and is the one readiness policy: every route that
needs the model asks it (`require_ready`), so loading, draining and failed start-ups answer the
same 503 everywhere.

The lifespan returns at once, so uvicorn binds its port while the model loads: clients and
orchestrators get 503 `service_unavailable` with `Retry-After` (and `/health` says "loading")
instead of "connection refused". The model loads in a daemon thread, bounded by
`model_loading_timeout`; the engine loop starts and answers one 1-token job, and only then does
`/health` turn 200. A load that fails or times out is recorded in `load_error` and `settled` is
set, so the CLI can exit non-zero. An engine passed in by the caller (tests) is started and
warmed before the lifespan returns, and left running at shutdown: its owner stops it.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import hashlib
import logging
import os
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

from litestar import Litestar
from litestar.di import NamedDependency

from adapters.errors import (
    draining_error,
    model_load_failed,
    model_loading,
)
from adapters.token_text import TokenText
from app.auth import KeyLimiter
from app.embeddings.service import EmbeddingService
from app.metrics import GatewayMetrics
from app.response_store import ResponseStore
from app.settings import Settings
from app.version import __version__
from engine import Engine, EngineClient, EngineConfig, SamplingParams
from engine.kv.host_memory import freeze_startup_objects
from engine.sample.grammar import Grammar

log = logging.getLogger("seqgate.app")

T = TypeVar("T")
# Threads that prepare requests. Two: one large body never blocks the small ones behind it, and
# more would only take cores from the engine. Niced, so they use what the engine leaves.
PREP_THREADS = 2
PREP_NICE = 19


@dataclass
class GatewayState:
    """What the controllers need: settings, the engine once loaded, metrics, readiness."""

    settings: Settings
    engine: EngineClient | None = None
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    owns_engine: bool = False
    ready: bool = False  # the model has answered; /health is 200
    draining: bool = False  # SIGTERM received: refuse new work, finish what runs
    token_text: TokenText | None = None
    load_error: str | None = None  # why the model could not be loaded; the server exits
    # Set once start-up has settled: ready, or failed (load_error).
    settled: asyncio.Event = field(default_factory=asyncio.Event)
    # How the lifespan builds the engine from the settings (tests hold the load on a gate).
    build_engine: Callable[[EngineConfig], EngineClient] = Engine
    # With engine replicas (app/replicas): each live replica's last report, by replica id.
    replica_report: Callable[[], dict[str, dict]] | None = None
    _prep_pool: ThreadPoolExecutor | None = None
    # The embedding model's service (app/embeddings), loaded with the engine when
    # settings.embeddings.model names one; /health waits for it too.
    embeddings: EmbeddingService | None = None
    owns_embeddings: bool = False
    key_limiter: KeyLimiter = field(init=False)
    responses: ResponseStore = field(init=False)  # the /v1/responses store

    def __post_init__(self) -> None:
        server = self.settings.server
        self.key_limiter = KeyLimiter(server.max_concurrent_per_key, server.api_keys)
        self.responses = ResponseStore(server.response_store_entries,
                                       server.response_store_bytes,
                                       self.metrics.report_response_store)

    @property
    def model_name(self) -> str:
        served = self.settings.server.served_model_name
        return served or (self.engine.model_name if self.engine else "seqgate")

    @property
    def system_fingerprint(self) -> str:
        cfg = self.settings.engine
        key = f"{__version__}:{self.model_name}:{cfg.dtype}:{cfg.decoding_strategy}"
        return "fp_" + hashlib.sha256(key.encode()).hexdigest()[:10]

    @property
    def request_timeout(self) -> float | None:
        return self.settings.server.request_timeout or None

    @property
    def accepting(self) -> bool:
        return self.ready and not self.draining and not (self.engine and self.engine.draining)

    @property
    def status(self) -> str:
        """ok | loading | draining | failed | no_replicas (every engine replica is down and
        Ray is restarting them), as /health reports it."""
        if self.draining or (self.engine is not None and self.engine.draining):
            return "draining"
        if self.load_error is not None:
            return "failed"
        if self.ready and self.replica_report is not None and not self.replica_report():
            return "no_replicas"
        return "ok" if self.ready else "loading"

    def require_ready(self) -> EngineClient:
        """The engine, or the 503 that says why there is none to use right now. While Ray
        restarts replicas, jobs wait in its router for one to come back."""
        status = self.status
        if status in ("ok", "no_replicas"):
            return self.engine
        if status == "draining":
            raise draining_error()
        if status == "failed":
            raise model_load_failed()
        raise model_loading()

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """Run request preparation (JSON decoding, chat templates, tokenization) on a small pool
        of low-priority threads: its cost grows with the body, and on the event loop a 4 MiB
        body would stall every open stream; at normal priority it would take the engine's cores.
        """
        if self._prep_pool is None:
            self._prep_pool = ThreadPoolExecutor(PREP_THREADS, "seqgate-prep", _lower_priority)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._prep_pool, functools.partial(fn, *args))

    def close(self) -> None:
        if self._prep_pool is not None:
            self._prep_pool.shutdown(wait=False, cancel_futures=True)
            self._prep_pool = None

    def use_engine(self, engine: EngineClient) -> None:
        self.engine = engine
        self.token_text = TokenText(engine.tokenizer)
        self.metrics.attach(engine)



def _lower_priority() -> None:
    """Nice a preparation thread: tokenizing a large body runs on a core the engine's threads
    need, and the streams come first (Linux: a thread's nice value is its own)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), PREP_NICE)
    except (AttributeError, OSError):  # not Linux, or not allowed: run at normal priority
        pass


# How controllers ask for the state: `gw: Gateway` (an explicit dependency, resolved by name).
Gateway = NamedDependency[GatewayState]


def _log_device_choice(settings: Settings) -> None:
    import torch

    dtype = settings.engine.dtype
    if dtype in ("fp16", "bf16") and not torch.cuda.is_available():
        if dtype == "fp16":
            log.warning("option.dtype=fp16 but no GPU is available: the model runs in fp32 on "
                        "the CPU (fp16 matmuls are slow or unsupported there)")
        else:
            log.warning("option.dtype=bf16 but no GPU is available: the model runs in bf16 on "
                        "the CPU (supported, but slower than fp32 on many CPUs)")


async def _warm_up(engine: EngineClient) -> None:
    """One token through the whole path, under a grammar: the grammar compiler's view of the
    tokenizer is built here (0.3 s for SmolLM2, holding the GIL), not on the first request that
    carries a schema while streams are running."""
    ids = engine.tokenizer.encode("Hello") or [0]
    grammar = await asyncio.to_thread(engine.grammars.compile, Grammar.json_object())
    handle = engine.submit(ids, SamplingParams(strategy="greedy", max_new_tokens=1,
                                               grammar=grammar))
    async for _ in handle:
        pass


async def _load_in_thread(state: GatewayState) -> EngineClient:
    """Build the engine in a daemon thread: a shutdown during a long load need not wait for it."""
    settings = state.settings
    loop = asyncio.get_running_loop()
    done: asyncio.Future[EngineClient] = loop.create_future()

    def settle(fn, value) -> None:
        if not done.done():
            fn(value)

    def load() -> None:
        try:
            engine = state.build_engine(settings.engine)
        except BaseException as exc:  # noqa: BLE001 - reported to the waiting loop
            loop.call_soon_threadsafe(settle, done.set_exception, exc)
        else:
            loop.call_soon_threadsafe(settle, done.set_result, engine)

    threading.Thread(target=load, name="seqgate-load", daemon=True).start()
    timeout = settings.server.model_loading_timeout
    try:
        return await asyncio.wait_for(done, timeout)
    except TimeoutError:
        raise RuntimeError(f"the model did not load within option.model_loading_timeout="
                           f"{timeout:g}s") from None


async def _start_embeddings(state: GatewayState) -> None:
    """Load the embedding model when one is asked for and none was passed in, and start its
    thread; before the engine's, so each sets its torch threads in turn (app/embeddings)."""
    if state.embeddings is None and state.settings.embeddings.model:
        state.embeddings = await asyncio.to_thread(EmbeddingService.from_settings,
                                                   state.settings)
        state.owns_embeddings = True
    if state.embeddings is not None:
        state.embeddings.start()


async def _start(state: GatewayState) -> None:
    await _start_embeddings(state)
    engine = state.engine
    engine.start()
    if state.settings.server.warmup:
        await _warm_up(engine)
    freeze_startup_objects()
    state.ready = True
    log.info("serving %s (max_model_len %d)", state.model_name, engine.max_model_len)


async def _load_and_start(state: GatewayState) -> None:
    _log_device_choice(state.settings)
    try:
        engine = await _load_in_thread(state)
        state.owns_engine = True
        state.use_engine(engine)
        await _start(state)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        state.load_error = f"{type(exc).__name__}: {exc}"
        log.error("start-up failed: %s", state.load_error)
    finally:
        state.settled.set()


@asynccontextmanager
async def engine_lifespan(app: Litestar) -> AsyncIterator[None]:
    state: GatewayState = app.state.gateway
    loading: asyncio.Task | None = None
    if state.engine is None:
        loading = asyncio.create_task(_load_and_start(state), name="seqgate-load")
    else:
        await _start(state)
        state.settled.set()
    try:
        yield
    finally:
        state.ready = False
        gc.unfreeze()  # the server's objects may be collected again once it is gone
        state.close()
        if loading is not None and not loading.done():
            loading.cancel()
        if state.owns_engine and state.engine is not None:
            await asyncio.to_thread(state.engine.stop, True, state.settings.server.drain_timeout)
        if state.owns_embeddings and state.embeddings is not None:
            await asyncio.to_thread(state.embeddings.stop)
