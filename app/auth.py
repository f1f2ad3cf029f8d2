"""Bearer API keys: the guard on the routes that reach the model, and the per-key cap on open
requests (`--max-concurrent-per-key`)."""

from __future__ import annotations

import hmac
from collections import Counter
from collections.abc import Callable

from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler
from litestar.types import ASGIApp, Receive, Scope, Send

from adapters.errors import QUEUE_FULL_RETRY_AFTER, ApiError
from app.settings import ServerSettings


def key_matches(presented: str, keys: tuple[str, ...]) -> bool:
    """Compare against every key in constant time (no early exit that would leak which)."""
    given = presented.encode()
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(given, key.encode())
    return matched


def presented_key(connection: ASGIConnection) -> str | None:
    """The bearer token of a request, if it sent one."""
    scheme, _, token = connection.headers.get("authorization", "").partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


def is_authorized(connection: ASGIConnection) -> bool:
    """Whether the request may see what the keys protect (always, when no keys are set)."""
    keys = connection.app.state.gateway.settings.server.api_keys
    token = presented_key(connection)
    return not keys or (token is not None and key_matches(token, keys))


def require_api_key(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    """401 unless the request carries `Authorization: Bearer <one of the configured keys>`."""
    keys = connection.app.state.gateway.settings.server.api_keys
    if not keys:
        return
    token = presented_key(connection)
    if token is None:
        raise ApiError(401, "Missing API key: send it as 'Authorization: Bearer <key>'.",
                       "invalid_api_key")
    if not key_matches(token, keys):
        raise ApiError(401, "Incorrect API key provided.", "invalid_api_key")


def per_key_concurrency(settings: ServerSettings) -> Callable[[ASGIApp], ASGIApp]:
    """Middleware: at most `max_concurrent_per_key` open requests per API key; one more gets 429
    with Retry-After. A request stays open until its response (a whole stream) is sent. Requests
    without a valid key are left to the guard (401), never counted. One count per app, shared by
    its routes."""
    open_requests: Counter[str] = Counter()
    limit, keys = settings.max_concurrent_per_key, settings.api_keys

    def wrap(app: ASGIApp) -> ASGIApp:
        async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http" or not limit or not keys:
                await app(scope, receive, send)
                return
            token = presented_key(ASGIConnection(scope))
            key = next((k for k in keys if token is not None and key_matches(token, (k,))), None)
            if key is None:
                await app(scope, receive, send)
                return
            if open_requests[key] >= limit:
                raise ApiError(429, f"Too many concurrent requests for this API key (at most "
                               f"{limit} at a time); retry when one has finished.",
                               "rate_limit_exceeded",
                               headers={"Retry-After": str(QUEUE_FULL_RETRY_AFTER)})
            open_requests[key] += 1
            try:
                await app(scope, receive, send)
            finally:
                open_requests[key] -= 1

        return middleware

    return wrap
