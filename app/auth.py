"""API keys (a bearer token, or `x-api-key`): the guard on the routes that reach the model, and
the cap on each key's open requests (`--max-concurrent-per-key`)."""

from __future__ import annotations

import hmac
from collections import Counter
from collections.abc import Callable

from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler

from adapters.errors import invalid_api_key, missing_api_key, too_many_for_key


def key_matches(presented: str, keys: tuple[str, ...]) -> bool:
    """Compare against every key in constant time (no early exit that would leak which)."""
    given = presented.encode()
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(given, key.encode())
    return matched


def presented_key(connection: ASGIConnection) -> str | None:
    """The key a request sent: its bearer token, else its `x-api-key` header (Anthropic's
    clients send the key there)."""
    scheme, _, token = connection.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer":
        return token.strip() or None
    return connection.headers.get("x-api-key", "").strip() or None


def is_authorized(connection: ASGIConnection) -> bool:
    """Whether the request may see what the keys protect (always, when no keys are set)."""
    keys = connection.app.state.gateway.settings.server.api_keys
    token = presented_key(connection)
    return not keys or (token is not None and key_matches(token, keys))


def require_api_key(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    """401 unless the request carries one of the configured keys (`presented_key`)."""
    keys = connection.app.state.gateway.settings.server.api_keys
    if not keys:
        return
    token = presented_key(connection)
    if token is None:
        raise missing_api_key()
    if not key_matches(token, keys):
        raise invalid_api_key()


class KeyLimiter:
    """Counts each API key's open requests and refuses one over `limit` with 429 + Retry-After.

    A request is open from the moment its handler admits it until its response is over: the
    caller gets a release function and calls it when the request's jobs are done (the request's
    `JobStream` does, when it closes), so the count follows the jobs rather than the ASGI call,
    which can return while a stream's last bytes still sit in socket buffers. Off when `limit`
    is 0 or no keys are configured. Event-loop only: no locking.
    """

    def __init__(self, limit: int, keys: tuple[str, ...]):
        self.limit, self.keys = limit, keys
        self.open: Counter[str] = Counter()

    def admit(self, connection: ASGIConnection) -> Callable[[], None]:
        """Count the request against its key; the returned function (idempotent) releases it.
        The guard has already checked the key, so the presented token is one of the keys."""
        key = presented_key(connection)
        if not self.limit or not self.keys or key is None:
            return _nothing
        if self.open[key] >= self.limit:
            raise too_many_for_key(self.limit)
        self.open[key] += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.open[key] -= 1
                if not self.open[key]:
                    del self.open[key]

        return release


def _nothing() -> None:
    pass
