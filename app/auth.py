"""Bearer API keys: the guard on the routes that reach the model."""

from __future__ import annotations

import hmac

from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler

from adapters.errors import ApiError


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
