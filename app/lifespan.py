"""The app's long-lived state and the lifespan hook that owns the engine.

`GatewayState` sits on `app.state.gateway`. The lifespan loads the model (in a thread, bounded
by `model_loading_timeout`), starts the engine loop, answers one 1-token job so `/health` turns
200 only once the model really answers, and on shutdown drains the engine it created. An engine
passed in by the caller (tests) is started if needed but left running: its owner stops it.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from litestar import Litestar
from litestar.di import NamedDependency

from adapters.token_text import TokenText
from app.metrics import GatewayMetrics
from app.settings import Settings
from app.version import __version__
from engine import Engine, SamplingParams

log = logging.getLogger("seqgate.app")


@dataclass
class GatewayState:
    """What the controllers need: settings, the engine once loaded, metrics, readiness."""

    settings: Settings
    engine: Engine | None = None
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    owns_engine: bool = False
    ready: bool = False  # the model has answered; /health is 200
    draining: bool = False  # SIGTERM received: refuse new work, finish what runs
    token_text: TokenText | None = None

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
    def accepting(self) -> bool:
        return self.ready and not self.draining and not (self.engine and self.engine.draining)

    def use_engine(self, engine: Engine) -> None:
        self.engine = engine
        self.token_text = TokenText(engine.tokenizer)
        self.metrics.attach(engine)


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


async def _warm_up(engine: Engine) -> None:
    ids = engine.tokenizer.encode("Hello") or [0]
    handle = engine.submit(ids, SamplingParams(strategy="greedy", max_new_tokens=1))
    async for _ in handle:
        pass


@asynccontextmanager
async def engine_lifespan(app: Litestar) -> AsyncIterator[None]:
    state: GatewayState = app.state.gateway
    settings = state.settings
    if state.engine is None:
        _log_device_choice(settings)
        timeout = settings.server.model_loading_timeout
        try:
            engine = await asyncio.wait_for(asyncio.to_thread(Engine, settings.engine), timeout)
        except TimeoutError:
            raise RuntimeError(f"the model did not load within option.model_loading_timeout="
                               f"{timeout:g}s") from None
        state.owns_engine = True
        state.use_engine(engine)
    engine = state.engine
    engine.start()
    if settings.server.warmup:
        await _warm_up(engine)
    state.ready = True
    log.info("serving %s (max_model_len %d)", state.model_name, engine.max_model_len)
    try:
        yield
    finally:
        state.ready = False
        if state.owns_engine:
            await asyncio.to_thread(engine.stop, True, settings.server.drain_timeout)
