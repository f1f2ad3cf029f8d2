"""OpenAI endpoints: /v1/chat/completions, /v1/completions, /v1/models. Routing only: the
adapters translate, the engine generates, app/streaming.py moves the deltas."""

from __future__ import annotations

import logging
import time

import msgspec
from litestar import Controller, Request, Response, get, post
from litestar.params import FromPath

from adapters.errors import CHAT_NAMES, COMPLETION_NAMES, ApiError
from adapters.openai_chat import ChatAssembler, ChatChunker, build_chat_job
from adapters.openai_completions import (
    CompletionAssembler,
    CompletionChunker,
    Prompt,
    build_completion_jobs,
)
from adapters.openai_params import JobSpec, ResponseMeta, check_model
from adapters.openai_types import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    T,
    decode_request,
)
from adapters.reasoning import parser_name
from app.api_docs import documented
from app.auth import require_api_key
from app.lifespan import Gateway, GatewayState
from app.streaming import collect, open_request, sse_response
from engine import EngineClient

log = logging.getLogger("seqgate.app.openai")

# When the model card says the model was "created": the process start is the honest answer.
_STARTED = int(time.time())


def json_response(obj: object, status: int = 200) -> Response:
    return Response(content=msgspec.json.encode(obj), status_code=status,
                    media_type="application/json")


def decode(request: Request, body: bytes, type_: type[T], served: str) -> T:
    """Decode a body (unknown fields logged only) and check its model. Runs off the loop."""
    req, unknown = decode_request(body, type_)
    if unknown:
        log.info("%s: ignoring unknown fields %s", request.url.path, unknown)
    check_model(getattr(req, "model", None), served)
    return req


def reasoning_parser(gw: GatewayState, engine: EngineClient) -> str:
    """The reasoning parser the server's setting means for this model's chat template."""
    return parser_name(gw.settings.server.reasoning_parser,
                       getattr(engine.tokenizer, "chat_template", None))


class ChatCompletionsController(Controller):
    """POST /v1/chat/completions: chat template, tools and structured outputs, stream or
    JSON."""

    path = "/v1/chat/completions"
    guards = [require_api_key]
    tags = ["OpenAI"]

    @post("/", operation_id="createChatCompletion", summary="Create a chat completion",
          status_code=200, operation_class=documented(
              ChatCompletionRequest, ChatCompletionResponse, stream=ChatCompletionChunk))
    async def create(self, request: Request, gw: Gateway) -> Response:
        def prepare(engine: EngineClient, body: bytes
                    ) -> tuple[tuple[ChatCompletionRequest, JobSpec], list[JobSpec]]:
            req = decode(request, body, ChatCompletionRequest, gw.model_name)
            server = gw.settings.server
            spec = build_chat_job(req, engine.tokenizer, engine.max_model_len,
                                  server.max_tokens_limit, engine.grammars,
                                  schema_prompt=server.schema_prompt,
                                  reasoning_parser=reasoning_parser(gw, engine))
            return (req, spec), [spec]

        (req, spec), stream = await open_request(gw, request, self.path, CHAT_NAMES, prepare)
        n = spec.params.n
        meta = ResponseMeta.new("chatcmpl", gw.model_name, gw.system_fingerprint)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            chunker = ChatChunker(meta, n, gw.token_text, include_usage, spec.tools, spec.thinks)
            return sse_response(stream, chunker.start(), lambda _, d: chunker.on_delta(d),
                                chunker.finish, gw.settings.server.sse_ping_seconds)
        assembler = ChatAssembler(meta, n, gw.token_text, bool(req.logprobs), spec.tools,
                                  spec.thinks)
        await collect(stream, request, lambda _, d: assembler.add(d))
        return json_response(assembler.response())


class CompletionsController(Controller):
    """POST /v1/completions: text or token-id prompts, one choice per prompt × n."""

    path = "/v1/completions"
    guards = [require_api_key]
    tags = ["OpenAI"]

    @post("/", operation_id="createCompletion", summary="Create a completion", status_code=200,
          operation_class=documented(CompletionRequest, CompletionResponse,
                                     stream=CompletionResponse))
    async def create(self, request: Request, gw: Gateway) -> Response:
        def prepare(engine: EngineClient, body: bytes
                    ) -> tuple[tuple[CompletionRequest, list[Prompt], int], list[JobSpec]]:
            req = decode(request, body, CompletionRequest, gw.model_name)
            specs, prompts = build_completion_jobs(req, engine.tokenizer, engine.max_model_len,
                                                   gw.settings.server.max_tokens_limit,
                                                   engine.grammars)
            return (req, prompts, specs[0].params.n), specs

        (req, prompts, n), stream = await open_request(gw, request, self.path, COMPLETION_NAMES,
                                                       prepare)
        meta = ResponseMeta.new("cmpl", gw.model_name, gw.system_fingerprint)
        echo, logprobs = bool(req.echo), req.logprobs is not None
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            chunker = CompletionChunker(meta, prompts, n, echo, gw.token_text, logprobs,
                                        include_usage, req.logprobs, req.prompt_logprobs)
            return sse_response(stream, chunker.start(), chunker.on_delta, chunker.finish,
                                gw.settings.server.sse_ping_seconds)
        assembler = CompletionAssembler(meta, prompts, n, echo, gw.token_text, logprobs,
                                        req.logprobs, req.prompt_logprobs)
        await collect(stream, request, assembler.add)
        return json_response(assembler.response())


class ModelsController(Controller):
    """GET /v1/models and /v1/models/{id}: the chat model, and the embedding model if any."""

    path = "/v1/models"
    guards = [require_api_key]
    tags = ["OpenAI"]

    def _cards(self, gw: GatewayState) -> list[ModelCard]:
        limit = gw.engine.max_model_len if gw.engine else 0
        cards = [ModelCard(id=gw.model_name, created=_STARTED, owned_by="seqgate",
                           max_model_len=limit)]
        if gw.embeddings is not None:
            model = gw.embeddings.model
            cards.append(ModelCard(id=model.name, created=_STARTED, owned_by="seqgate",
                                   max_model_len=model.max_tokens))
        return cards

    @get("/", operation_id="listModels", summary="List the served models",
         operation_class=documented(None, ModelList, errors=("401", "503")))
    async def list_models(self, gw: Gateway) -> Response:
        gw.require_ready()
        return json_response(ModelList(data=self._cards(gw)))

    @get("/{model_id:path}", operation_id="retrieveModel", summary="Describe a model",
         operation_class=documented(None, ModelCard, errors=("401", "404", "503")))
    async def retrieve(self, model_id: FromPath[str], gw: Gateway) -> Response:
        gw.require_ready()
        model_id = model_id.lstrip("/")
        card = next((c for c in self._cards(gw) if c.id == model_id), None)
        if card is None:
            raise ApiError.model_not_found(model_id, gw.model_name)
        return json_response(card)
