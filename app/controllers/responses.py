"""OpenAI's Responses API: POST /v1/responses, and the stored responses' GET, input items,
DELETE and cancel. Routing only: adapters/openai_responses.py turns the request into chat's job,
adapters/responses_output.py turns chat's answer into a response or typed events, and
app/response_store.py keeps responses for later requests.

Stream events are named after their `type` (`event: response.created`), as OpenAI sends them,
and the stream ends with its terminal event (no `[DONE]`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
from litestar import Controller, Request, Response, delete, get, post
from litestar.background_tasks import BackgroundTask, BackgroundTasks
from litestar.params import FromPath, FromQuery
from litestar.response.sse import ServerSentEventMessage

from adapters.errors import ApiError
from adapters.openai_chat import ChatAssembler, ChatChunker
from adapters.openai_params import JobSpec, ResponseMeta
from adapters.openai_responses import RESPONSES_NAMES, ResponsesJob, build_responses_job
from adapters.responses_events import ResponseEvents
from adapters.responses_output import Answer, ResponseDraft, from_chat
from adapters.responses_types import (
    DeletedResponse,
    LifecycleEvent,
    ResponseItemList,
    ResponseObject,
    ResponsesRequest,
)
from app.api_docs import documented
from app.auth import presented_key, require_api_key
from app.controllers.openai import decode, json_response, reasoning_parser
from app.lifespan import Gateway, GatewayState
from app.response_store import ResponseStore, StoredResponse, page_items
from app.streaming import OPENAI_FRAMING, JobStream, SseFraming, collect, open_request, sse_response
from engine import EngineClient

_STREAM_NOTE = ("with stream=true: named events response.created, response.in_progress, "
                "response.output_item.added, response.reasoning_text.delta, "
                "response.reasoning_text.done, response.content_part.added, "
                "response.output_text.delta, response.output_text.done, "
                "response.content_part.done, response.function_call_arguments.delta, "
                "response.function_call_arguments.done, response.output_item.done, then "
                "response.completed or response.incomplete (response.failed once cancelled), "
                "or error")


def _named(event: Any) -> ServerSentEventMessage:
    return ServerSentEventMessage(data=msgspec.json.encode(event).decode(), event=event.type,
                                  sep="\n")


def owner_of(request: Request, gw: GatewayState) -> str | None:
    """Whose responses a request may see: its API key's, when keys are set."""
    return presented_key(request) if gw.settings.server.api_keys else None


@dataclass
class ResponseRun:
    """One response while it runs: its store record (kept when `stored`), and how it ends:
    finished (completed or incomplete), failed, or cancelled (by the cancel route, or its
    client went away)."""

    store: ResponseStore
    draft: ResponseDraft
    record: StoredResponse
    history: list[dict[str, Any]]
    stored: bool
    stream: JobStream | None = None
    cancelled: bool = False

    def begin(self, stream: JobStream) -> None:
        self.stream, self.record.cancel = stream, self.cancel
        if self.stored:
            self.store.put(self.record)

    def cancel(self) -> None:
        self.cancelled = True
        self._end(self.draft.response("cancelled"))
        self.stream.close()  # aborts the job; the stream or collect then ends as cancelled

    def finish(self, answer: Answer) -> None:
        if answer.response.status in ("completed", "incomplete"):
            self.record.history = [*self.history, answer.turn]
        self._end(answer.response)

    def fail(self, err: ApiError) -> None:
        self._end(self.draft.response("failed", error=err))

    def closed(self) -> None:
        """The request is over: a response still running lost its client."""
        if self.record.running:
            self.cancelled = True
            self._end(self.draft.response("cancelled"))

    def _end(self, response: ResponseObject) -> None:
        self.record.response, self.record.cancel = response, None
        if self.stored:
            self.store.update(self.record)


class ResponsesController(Controller):
    """POST /v1/responses (text, items, tools, text.format, streaming, previous_response_id)
    and the stored responses' routes."""

    path = "/v1/responses"
    guards = [require_api_key]
    tags = ["OpenAI"]

    @post("/", operation_id="createResponse", summary="Create a model response",
          status_code=200, operation_class=documented(
              ResponsesRequest, ResponseObject, stream=LifecycleEvent, stream_note=_STREAM_NOTE))
    async def create(self, request: Request, gw: Gateway) -> Response:
        owner = owner_of(request, gw)

        def prepare(engine: EngineClient, body: bytes
                    ) -> tuple[tuple[ResponsesRequest, ResponsesJob, bool], list[JobSpec]]:
            req = decode(request, body, ResponsesRequest, gw.model_name)
            previous = (gw.responses.history(req.previous_response_id, owner)
                        if req.previous_response_id else None)
            job = build_responses_job(req, previous, engine.tokenizer, engine.max_model_len,
                                      gw.settings.server.max_tokens_limit, engine.grammars,
                                      gw.settings.server.schema_prompt,
                                      reasoning_parser(gw, engine))
            caching = engine.stats().prefix_cache_capacity_bytes > 0
            return (req, job, caching), [job.spec]

        (req, job, caching), stream = await open_request(gw, request, self.path,
                                                         RESPONSES_NAMES, prepare)
        draft = ResponseDraft.of(req, gw.model_name, caching)
        run = ResponseRun(gw.responses, draft, StoredResponse(draft.response(), job.input_items,
                                                              owner),
                          job.history, stored=req.store is not False)
        run.begin(stream)
        meta, spec = ResponseMeta.new("chatcmpl", gw.model_name, gw.system_fingerprint), job.spec
        if req.stream:
            return self._stream(gw, stream, run, ChatChunker(meta, 1, gw.token_text, True,
                                                             spec.tools, spec.thinks))
        assembler = ChatAssembler(meta, 1, gw.token_text, False, spec.tools, spec.thinks)
        try:
            await collect(stream, request, lambda _, d: assembler.add(d))
        except ApiError as err:
            run.fail(err)
            raise
        except BaseException:  # the request itself was cancelled
            run.closed()
            raise
        answer = from_chat(draft, assembler.response(), assembler.finish[0], run.cancelled)
        run.finish(answer)
        return json_response(answer.response)

    @staticmethod
    def _stream(gw: GatewayState, stream: JobStream, run: ResponseRun,
                chunker: ChatChunker) -> Response:
        events = ResponseEvents(run.draft)

        def on_delta(_: int, delta) -> list:
            return [e for chunk in chunker.on_delta(delta) for e in events.on_chunk(chunk)]

        def finish() -> list:
            out = [e for chunk in chunker.finish() for e in events.on_chunk(chunk)]
            out += events.close(run.cancelled)
            run.finish(events.answer)
            return out

        def error(err: ApiError) -> ServerSentEventMessage:
            run.fail(err)
            return _named(events.error(err)[0])

        framing = SseFraming(event=_named, error=error, ping=OPENAI_FRAMING.ping)
        response = sse_response(stream, events.start(), on_delta, finish,
                                gw.settings.server.sse_ping_seconds, framing)
        # Also when the client leaves mid-stream: the stored response then ends as cancelled.
        response.background = BackgroundTasks([response.background,
                                               BackgroundTask(run.closed)])
        return response

    @get("/{response_id:str}", operation_id="getResponse", summary="Retrieve a stored response",
         operation_class=documented(None, ResponseObject, errors=("401", "404")))
    async def retrieve(self, response_id: FromPath[str], request: Request,
                       gw: Gateway) -> Response:
        return json_response(gw.responses.get(response_id, owner_of(request, gw)).response)

    @get("/{response_id:str}/input_items", operation_id="listInputItems",
         summary="List a stored response's input items",
         operation_class=documented(None, ResponseItemList, errors=("400", "401", "404")))
    async def input_items(self, response_id: FromPath[str], request: Request, gw: Gateway,
                          limit: FromQuery[int] = 20, order: FromQuery[str] = "desc",
                          after: FromQuery[str | None] = None) -> Response:
        record = gw.responses.get(response_id, owner_of(request, gw))
        return json_response(page_items(record.input_items, limit, order, after))

    @delete("/{response_id:str}", operation_id="deleteResponse",
            summary="Delete a stored response", status_code=200,
            operation_class=documented(None, DeletedResponse, errors=("401", "404")))
    async def remove(self, response_id: FromPath[str], request: Request,
                     gw: Gateway) -> Response:
        gw.responses.delete(response_id, owner_of(request, gw))
        return json_response(DeletedResponse(response_id))

    @post("/{response_id:str}/cancel", operation_id="cancelResponse",
          summary="Cancel a running response", status_code=200,
          operation_class=documented(None, ResponseObject, errors=("400", "401", "404")))
    async def cancel(self, response_id: FromPath[str], request: Request,
                     gw: Gateway) -> Response:
        record = gw.responses.get(response_id, owner_of(request, gw))
        if record.cancel is None:
            raise ApiError.bad_request(f"Only a running response can be cancelled; "
                                       f"'{response_id}' is {record.response.status}.",
                                       param="response_id")
        record.cancel()
        return json_response(record.response)
