"""POST /v1/embeddings: routing only. adapters/openai_embeddings.py checks and translates; the
embedding service (app/embeddings) batches and runs the model on its own thread."""

from __future__ import annotations

import asyncio
import logging

import msgspec
import torch
from litestar import Controller, Request, Response, post

from adapters.errors import QUEUE_FULL_RETRY_AFTER, ApiError, draining_error, request_timeout_error
from adapters.openai_embeddings import (
    EmbeddingRequest,
    EmbeddingResponse,
    check_embedding_model,
    embedding_response,
    embedding_rows,
    no_embedding_model,
    output_size,
)
from adapters.openai_types import decode_request
from app.api_docs import documented
from app.auth import require_api_key
from app.embeddings.model import EmbeddingModel, truncate
from app.embeddings.service import EmbeddingQueueFull, EmbeddingService, EmbeddingStopped
from app.lifespan import Gateway, GatewayState

log = logging.getLogger("seqgate.app.embeddings")


def embedding_service(gw: GatewayState) -> EmbeddingService:
    """The service, or the error that says why there is none: 404 when the server was started
    without an embedding model, else the readiness 503s that every route answers."""
    if gw.embeddings is None and not gw.settings.embeddings.model:
        raise no_embedding_model()
    gw.require_ready()
    return gw.embeddings


def prepare(path: str, body: bytes, model: EmbeddingModel
            ) -> tuple[EmbeddingRequest, list[list[int]], int]:
    """Decode, check and tokenize (off the event loop): the request, its rows, the output size."""
    req, unknown = decode_request(body, EmbeddingRequest)
    if unknown:
        log.info("%s: ignoring unknown fields %s", path, unknown)
    check_embedding_model(req.model, model.name)
    return req, embedding_rows(req, model), output_size(req, model)


def encode(vectors: torch.Tensor, size: int, req: EmbeddingRequest, rows: list[list[int]],
           model: EmbeddingModel) -> bytes:
    """The response body: vectors cut to `size` where asked, then floats or base64."""
    vectors = truncate(vectors, size, model.normalized)
    return msgspec.json.encode(embedding_response(vectors, rows, model.name,
                                                  req.encoding_format))


async def run(service: EmbeddingService, rows: list[list[int]],
              timeout: float | None) -> torch.Tensor:
    """The rows' vectors, within the request's timeout; refusals as API errors."""
    try:
        return await asyncio.wait_for(service.embed(rows), timeout)
    except EmbeddingQueueFull as exc:
        raise ApiError(429, f"The embedding model is at capacity: {exc}.", "rate_limit_exceeded",
                       headers={"Retry-After": str(QUEUE_FULL_RETRY_AFTER)}) from None
    except EmbeddingStopped:
        raise draining_error() from None
    except TimeoutError:
        raise request_timeout_error(timeout) from None


class EmbeddingsController(Controller):
    """POST /v1/embeddings: vectors from the embedding model served beside the chat model."""

    path = "/v1/embeddings"
    guards = [require_api_key]
    tags = ["OpenAI"]

    @post("/", operation_id="createEmbedding", summary="Create embeddings", status_code=200,
          operation_class=documented(EmbeddingRequest, EmbeddingResponse))
    async def create(self, request: Request, gw: Gateway) -> Response:
        service = embedding_service(gw)
        release = gw.key_limiter.admit(request)
        try:
            body = await request.body()
            req, rows, size = await gw.off_loop(prepare, self.path, body, service.model)
            vectors = await run(service, rows, gw.request_timeout)
            content = await gw.off_loop(encode, vectors, size, req, rows, service.model)
        finally:
            release()
        return Response(content=content, status_code=200, media_type="application/json")
