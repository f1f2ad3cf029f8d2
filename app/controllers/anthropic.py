"""Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens. Routing only: the
adapters translate (adapters/anthropic_messages.py, adapters/anthropic_output.py), the engine
generates, app/streaming.py moves the deltas, framed as Anthropic's named events.

Every error on these routes leaves in Anthropic's shape, `{"type": "error", "error": {"type",
"message"}}`: the app's exception handlers answer as usual and their envelope is rewritten here.
The key may come as `x-api-key` (app/auth.py); `anthropic-version` is accepted and not needed.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec
from litestar import Controller, Request, Response, post

from adapters.anthropic_messages import (
    MESSAGES_NAMES,
    anthropic_error,
    build_messages_job,
    count_tokens,
    error_body,
)
from adapters.anthropic_output import MessagesAssembler, MessagesChunker, message_id
from adapters.anthropic_thinking import thinking_enabled
from adapters.anthropic_types import (
    CountTokensRequest,
    CountTokensResponse,
    ErrorResponse,
    MessageResponse,
    MessagesRequest,
    MessageStart,
    Ping,
)
from adapters.openai_params import JobSpec
from app.api_docs import documented
from app.auth import require_api_key
from app.controllers.openai import decode, json_response, reasoning_parser
from app.exception_handlers import EXCEPTION_HANDLERS
from app.lifespan import Gateway
from app.streaming import SseFraming, collect, named_event, open_request, sse_response
from engine import EngineClient

Handler = Callable[[Request, Exception], Response]


def _in_anthropic_shape(handler: Handler) -> Handler:
    """One of the app's exception handlers, its OpenAI envelope rewritten as Anthropic's."""

    def handle(request: Request, exc: Exception) -> Response:
        response = handler(request, exc)
        error = response.content.get("error") if isinstance(response.content, dict) else None
        if isinstance(error, dict):
            body = error_body(response.status_code, error["message"], error.get("param"))
            response.content = msgspec.to_builtins(body)
        return response

    return handle


ANTHROPIC_HANDLERS = {kind: _in_anthropic_shape(h) for kind, h in EXCEPTION_HANDLERS.items()}


ANTHROPIC_FRAMING = SseFraming(event=named_event,
                               error=lambda err: named_event(anthropic_error(err)),
                               ping=named_event(Ping()))

_STREAM_NOTE = ("with stream=true: named events message_start, content_block_start, "
                "content_block_delta (text_delta, input_json_delta, thinking_delta, "
                "signature_delta), content_block_stop, message_delta, message_stop, ping, error")


class MessagesController(Controller):
    """POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the chat
    adapter (same template, tools and limits)."""

    path = "/v1/messages"
    guards = [require_api_key]
    tags = ["Anthropic"]
    exception_handlers = ANTHROPIC_HANDLERS

    @post("/", operation_id="createMessage", summary="Create a message (Anthropic Messages API)",
          status_code=200, operation_class=documented(
              MessagesRequest, MessageResponse, stream=MessageStart, stream_note=_STREAM_NOTE,
              error=ErrorResponse))
    async def create(self, request: Request, gw: Gateway) -> Response:
        def prepare(engine: EngineClient, body: bytes
                    ) -> tuple[tuple[MessagesRequest, JobSpec, object], list[JobSpec]]:
            req = decode(request, body, MessagesRequest, gw.model_name)
            spec = build_messages_job(req, engine.tokenizer, engine.max_model_len,
                                      gw.settings.server.max_tokens_limit, engine.grammars,
                                      gw.settings.server.schema_prompt,
                                      reasoning_parser(gw, engine))
            return (req, spec, engine.tokenizer), [spec]

        (req, spec, tokenizer), stream = await open_request(gw, request, self.path,
                                                            MESSAGES_NAMES, prepare)

        def decode_ids(ids: list[int]) -> str:  # to find the stop sequence that ended it
            return tokenizer.decode(ids, skip_special_tokens=True)

        stops, ident = spec.params.stop, message_id()
        shown = thinking_enabled(req.thinking)
        if req.stream:
            chunker = MessagesChunker(ident, gw.model_name, len(spec.prompt_ids), spec.tools,
                                      stops, decode_ids, spec.thinks, shown)
            return sse_response(stream, chunker.start(), chunker.on_delta, chunker.finish,
                                gw.settings.server.sse_ping_seconds, ANTHROPIC_FRAMING)
        assembler = MessagesAssembler(ident, gw.model_name, spec.tools, stops, decode_ids,
                                      spec.thinks, shown)
        await collect(stream, request, lambda _, d: assembler.add(d))
        return json_response(assembler.response())

    @post("/count_tokens", operation_id="countMessageTokens",
          summary="Count a message's input tokens (Anthropic Messages API)", status_code=200,
          operation_class=documented(CountTokensRequest, CountTokensResponse,
                                     errors=("400", "401", "404", "413", "503"),
                                     error=ErrorResponse))
    async def count(self, request: Request, gw: Gateway) -> Response:
        engine = gw.require_ready()
        body = await request.body()

        def prepare() -> int:
            req = decode(request, body, CountTokensRequest, gw.model_name)
            return count_tokens(req, engine.tokenizer, engine.max_model_len,
                                gw.settings.server.schema_prompt)

        return json_response(CountTokensResponse(await gw.off_loop(prepare)))
