"""Bearer API-key check, as a Litestar guard on the routes that reach the model."""

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


def require_api_key(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    """401 unless the request carries `Authorization: Bearer <one of the configured keys>`."""
    keys = connection.app.state.gateway.settings.server.api_keys
    if not keys:
        return
    header = connection.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise ApiError(401, "Missing API key: send it as 'Authorization: Bearer <key>'.",
                       "invalid_api_key")
    if not key_matches(token.strip(), keys):
        raise ApiError(401, "Incorrect API key provided.", "invalid_api_key")
