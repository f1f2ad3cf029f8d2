"""create_app(settings, engine=None) → the Litestar app.

Settings come in as an argument (never read from the environment at import), so tests and the
CLI build apps the same way; an engine may be passed in to share one model across apps.
"""

from __future__ import annotations

from litestar import Litestar
from litestar.config.cors import CORSConfig
from litestar.datastructures import MutableScopeHeaders, State
from litestar.di import Provide
from litestar.openapi import OpenAPIConfig
from litestar.openapi.plugins import JsonRenderPlugin, SwaggerRenderPlugin
from litestar.routes import HTTPRoute
from litestar.types import Message, Scope

from app.controllers.anthropic import MessagesController
from app.controllers.djl import DjlController
from app.controllers.embeddings import EmbeddingsController
from app.controllers.openai import (
    ChatCompletionsController,
    CompletionsController,
    ModelsController,
)
from app.controllers.ops import OpsController
from app.controllers.responses import ResponsesController
from app.embeddings.service import EmbeddingService
from app.exception_handlers import EXCEPTION_HANDLERS, watch_client
from app.lifespan import GatewayState, engine_lifespan
from app.settings import Settings
from app.version import __version__
from engine import EngineClient


def create_app(settings: Settings | None = None, engine: EngineClient | None = None,
               embeddings: EmbeddingService | None = None) -> Litestar:
    """Build the app. Without `engine`, the lifespan loads the configured model at start-up;
    without `embeddings`, the configured embedding model (if any) likewise."""
    settings = settings or Settings()
    gateway = GatewayState(settings, embeddings=embeddings)
    if engine is not None:
        gateway.use_engine(engine)

    def provide_gateway() -> GatewayState:
        return gateway

    async def count_response(message: Message, scope: Scope) -> None:
        if message["type"] == "http.response.start":
            route = scope.get("path_template") or "unmatched"
            gateway.metrics.count_response(route, message["status"])
            # With engine replicas: which replica(s) ran the request's jobs.
            if replicas := scope.get("state", {}).get("seqgate_replicas"):
                message["headers"] = [*message.get("headers", []),
                                      (b"x-seqgate-replica", replicas.encode())]

    server = settings.server
    return Litestar(
        route_handlers=[ChatCompletionsController, CompletionsController, ModelsController,
                        ResponsesController, MessagesController, EmbeddingsController,
                        DjlController, OpsController],
        dependencies={"gw": Provide(provide_gateway, use_cache=True, sync_to_thread=False)},
        lifespan=[engine_lifespan],
        state=State({"gateway": gateway}),
        exception_handlers=EXCEPTION_HANDLERS,
        before_send=[count_response, _AllowEveryMethod()],
        middleware=[watch_client],
        request_max_body_size=server.max_request_bytes,
        cors_config=CORSConfig(allow_origins=list(server.cors_origins))
        if server.cors_origins else None,
        openapi_config=OpenAPIConfig(
            title="seqgate",
            version=__version__,
            description="OpenAI-compatible gateway over the seq-scheduler (rolling batching "
                        "with max-sparsity splitting and a system-prompt KV cache).",
            path="/docs",
            render_plugins=[SwaggerRenderPlugin(path="/"), JsonRenderPlugin()],
        ),
    )


class _AllowEveryMethod:
    """Litestar 2's automatic OPTIONS answer names one handler's method where several share a
    path (GET and DELETE /v1/responses/{id}; litestar-org/litestar#4169, fixed in v3): its
    `Allow` is set to every method of the route."""

    def __init__(self) -> None:
        self.methods: dict[str, str] | None = None

    async def __call__(self, message: Message, scope: Scope) -> None:
        if message["type"] != "http.response.start" or scope.get("method") != "OPTIONS":
            return
        if self.methods is None:
            self.methods = {route.path: ", ".join(sorted(route.methods))
                            for route in scope["litestar_app"].routes
                            if isinstance(route, HTTPRoute)}
        for path in getattr(scope.get("route_handler"), "paths", ()):
            if path in self.methods:
                MutableScopeHeaders.from_message(message)["allow"] = self.methods[path]
