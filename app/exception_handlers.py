"""Every error leaves in OpenAI's envelope, whoever raised it: our adapters (ApiError), Litestar
(unknown route, wrong method, body over the limit), or a bug (500, logged with its traceback).

A client that hangs up before its body is read is not a server error, though Litestar raises one
(500 "client disconnected prematurely"): `watch_client` marks the request when the server sees
the disconnect, and the handler logs it at INFO and counts it as 499 (nginx's "client closed
request"), a status no client ever receives."""

from __future__ import annotations

import logging

from litestar import Request, Response
from litestar.exceptions import HTTPException
from litestar.types import ASGIApp, Message, Receive, Scope, Send

from adapters.errors import ApiError

log = logging.getLogger("seqgate.app.errors")

# Litestar's own HTTP errors → our codes.
_CODES = {
    400: "invalid_request",
    401: "invalid_api_key",
    404: "not_found",
    405: "method_not_allowed",
    413: "request_too_large",
    429: "rate_limit_exceeded",
    503: "service_unavailable",
}

CLIENT_GONE = "seqgate_client_gone"  # scope key set once the server has seen the disconnect
CLIENT_CLOSED_REQUEST = 499


def watch_client(app: ASGIApp) -> ASGIApp:
    """ASGI middleware: mark the scope when the client's disconnect arrives."""

    async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
        async def watched() -> Message:
            message = await receive()
            if message["type"] == "http.disconnect":
                scope[CLIENT_GONE] = True  # type: ignore[typeddict-unknown-key]
            return message

        await app(scope, watched, send)

    return middleware


def api_error_response(err: ApiError) -> Response:
    return Response(content=err.body(), status_code=err.status, headers=err.headers,
                    media_type="application/json")


def handle_api_error(_: Request, exc: ApiError) -> Response:
    return api_error_response(exc)


def handle_http_exception(request: Request, exc: HTTPException) -> Response:
    status = exc.status_code
    if status >= 500 and request.scope.get(CLIENT_GONE):
        log.info("client disconnected before the request on %s was read", request.url.path)
        return Response(content=b"", status_code=CLIENT_CLOSED_REQUEST)
    if status == 413:
        limit = request.app.state.gateway.settings.server.max_request_bytes
        message = f"The request body is larger than the limit of {limit} bytes."
    elif status == 404:
        message = f"No route {request.method} {request.url.path}."
    else:
        message = exc.detail
    if status >= 500:
        log.error("HTTP %d on %s: %s", status, request.url.path, exc.detail)
    return api_error_response(ApiError(status, message, _CODES.get(status, "http_error"),
                                       headers=dict(exc.headers or {})))


def handle_internal_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return api_error_response(ApiError(500, f"Internal server error: {type(exc).__name__}",
                                       "internal_error"))


EXCEPTION_HANDLERS = {
    ApiError: handle_api_error,
    HTTPException: handle_http_exception,
    Exception: handle_internal_error,
}
