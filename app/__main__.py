"""The `seqgate` command: `seqgate serve [flags]` and `seqgate openapi [PATH]`.

Shutdown: the first SIGTERM or SIGINT drains — new requests get 503 and /health turns 503 while
running and queued jobs finish (up to `drain_timeout`), then uvicorn closes its connections and
exits. A second signal exits at once.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path

import uvicorn

from app.factory import create_app
from app.lifespan import GatewayState
from app.properties import PropertiesError
from app.settings import Settings, SettingsError, add_arguments, load_settings

log = logging.getLogger("seqgate")

SWITCH_INTERVAL_S = 0.001
KERNEL_CACHE_CAPACITY = 32

class DrainingServer(uvicorn.Server):
    """uvicorn, with a drain before exit and a ready banner once the socket listens."""

    def __init__(self, config: uvicorn.Config, gateway: GatewayState):
        super().__init__(config)
        self.gateway = gateway
        self._drain_started = False
        self._watcher: asyncio.Task | None = None

    def handle_exit(self, sig: int, frame) -> None:
        if self._drain_started:  # second signal: stop now
            self.force_exit = True
            self.should_exit = True
            return
        self._drain_started = True
        self.gateway.draining = True
        log.info("received %s: draining (new requests get 503; running jobs finish; "
                 "signal again to exit now)", signal.Signals(sig).name)
        threading.Thread(target=self._drain_then_exit, name="seqgate-drain", daemon=True).start()

    def _drain_then_exit(self) -> None:
        engine = self.gateway.engine
        if engine is not None:
            engine.stop(drain=True, timeout=self.gateway.settings.server.drain_timeout)
        # uvicorn now waits for open responses to finish sending, then runs the lifespan end.
        self.should_exit = True

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and not self.should_exit:
            # The port is open while the model loads (/health: 503 "loading"); the banner waits
            # for readiness, and a failed load ends the process.
            print(f"seqgate is listening at {server_url(self)}; loading the model (GET /health "
                  "answers 503 until it is ready)", flush=True)
            self._watcher = asyncio.create_task(self._when_settled())

    async def _when_settled(self) -> None:
        await self.gateway.settled.wait()
        if self.gateway.load_error is not None:
            self.should_exit = True
        elif not self.should_exit:
            print_banner(self)


def server_url(server: uvicorn.Server) -> str:
    host, port = server.config.host, server.config.port
    for s in server.servers:
        for sock in s.sockets:
            host, port = sock.getsockname()[:2]
            break
    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    return f"http://{shown}:{port}"


def print_banner(server: uvicorn.Server) -> None:
    url = server_url(server)
    gw: GatewayState = server.gateway
    auth = ' -H "Authorization: Bearer $SEQGATE_API_KEY"' if gw.settings.server.api_keys else ""
    body = json.dumps({"model": gw.model_name, "max_tokens": 32,
                       "messages": [{"role": "user", "content": "Say hello in five words."}]})
    print(f"seqgate is serving {gw.model_name} at {url}  (OpenAI base_url: {url}/v1, docs: "
          f"{url}/docs)\n"
          f"try:  curl -s {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} "
          f"-d '{body}'", flush=True)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


def warn_if_exposed(settings: Settings) -> None:
    server = settings.server
    if not server.api_keys and not is_loopback(server.host):
        log.warning("listening on %s without API keys: anyone who can reach this port can use "
                    "the model (set SEQGATE_API_KEYS, or listen on 127.0.0.1)", server.host)


def use_replicas(settings: Settings, gateway: GatewayState) -> None:
    """`--replicas N`: join or start Ray now (main thread, before uvicorn takes the signals),
    and let the lifespan deploy the replicas where it would load the model."""
    try:
        from app.replicas import cluster
        from app.replicas.metrics import ReplicaCollector, replica_report
    except ImportError as exc:
        raise SettingsError(f"--replicas={settings.replicas.replicas} runs the engines on Ray "
                            f"Serve, which is not installed ({exc}): pip install "
                            "'seqgate[ray]'") from None
    started_ray = cluster.connect_ray()
    cluster.replica_gpus(settings)  # GPUs that cannot hold the replicas: refused before serving
    gateway.build_engine = lambda _config: cluster.deploy_replicas(settings, started_ray)
    gateway.replica_report = replica_report
    gateway.metrics.registry.register(ReplicaCollector())


def serve(settings: Settings) -> int:
    warn_if_exposed(settings)
    app = create_app(settings)
    if settings.replicas.enabled:
        try:
            use_replicas(settings, app.state.gateway)
        except SettingsError as exc:
            print(f"seqgate: error: {exc}", file=sys.stderr)
            return 2
    config = uvicorn.Config(app, host=settings.server.host, port=settings.server.port,
                            log_level=settings.server.log_level, lifespan="on",
                            # uvicorn would pick uvloop and httptools once installed (the ray
                            # extra brings both): the server stays on asyncio and h11 either way.
                            loop="asyncio", http="h11",
                            proxy_headers=True,
                            forwarded_allow_ips=settings.server.forwarded_allow_ips,
                            timeout_graceful_shutdown=max(settings.server.drain_timeout, 1))
    server = DrainingServer(config, app.state.gateway)
    server.run()
    if app.state.gateway.load_error is not None:
        print(f"seqgate: error: {app.state.gateway.load_error}", file=sys.stderr)
        return 1
    return 0 if server.started else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="seqgate", description="OpenAI-compatible LLM gateway "
                                     "over the seq-scheduler")
    sub = parser.add_subparsers(dest="command", required=True)
    serve_p = sub.add_parser("serve", help="serve a model (default: the embedded SmolLM2)",
                             description="Settings: flags > SEQGATE_* environment > "
                             "--config serving.properties > defaults.")
    add_arguments(serve_p)
    api_p = sub.add_parser("openapi", help="write the OpenAPI document")
    api_p.add_argument("path", nargs="?", type=Path, default=None,
                       help="where to write it (default: the committed openapi/openapi.json)")
    return parser


def bound_native_memory() -> None:
    """Cap the two caches of compiled matmul kernels, one entry per shape, 1,024 each by
    default: oneDNN's (`ONEDNN_PRIMITIVE_CACHE_CAPACITY`) and ideep's, which torch's CPU matmuls
    go through (`LRU_CACHE_CAPACITY`). A rolling batch makes new shapes at almost every step;
    under load the caches took hundreds of MiB, filling for minutes before resident memory
    levelled off (docs/reliability.md). Left as they are when the environment sets them; both
    are read when the first matmul runs, after this."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(KERNEL_CACHE_CAPACITY))
    os.environ.setdefault("LRU_CACHE_CAPACITY", str(KERNEL_CACHE_CAPACITY))


def main(argv: list[str] | None = None) -> int:
    # One prompt is tokenized on the calling (low-priority) thread; tokenizers' own thread pool
    # would take the engine's cores at normal priority for no gain on one text.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # The engine thread takes the GIL back after every torch op; while a preparation thread
    # runs Python (a large chat template, a long token list), each of those waits up to the
    # switch interval. 1 ms instead of 5 keeps the streams' steps short
    # (bench/studies/large_body.py).
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        bound_native_memory()
    if args.command == "openapi":
        # One writer for the document, so `seqgate openapi` and the staleness check agree.
        from openapi.generate import DOCUMENT, write

        print(write(args.path or DOCUMENT))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: "
                        "%(message)s")
    try:
        settings = load_settings(args)
    except (SettingsError, PropertiesError) as exc:
        print(f"seqgate: error: {exc}", file=sys.stderr)
        return 2
    logging.getLogger().setLevel(settings.server.log_level.upper())
    return serve(settings)


if __name__ == "__main__":
    sys.exit(main())
