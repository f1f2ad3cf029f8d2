"""OpenAI `/v1/embeddings` ⇄ the embedding model: the request's inputs as rows of token ids,
checked against the model's limits, and the vectors as OpenAI's response (floats or base64).

Plain functions, no I/O: the model is described by what it knows (`EmbeddingModelInfo`), and
every check runs before anything is queued, so a bad input never reaches the model.
"""

from __future__ import annotations

import base64
from typing import Annotated, Any, Literal, Protocol

import numpy as np
from msgspec import Meta, Struct

from adapters.errors import ApiError

# OpenAI's limit on inputs per request.
MAX_INPUTS = 2048

# -- wire types -------------------------------------------------------------------------------


class EmbeddingRequest(Struct, kw_only=True):
    """A `/v1/embeddings` body. `input`: a string, a list of strings, a list of token ids, or a
    list of lists of token ids (the embedding model's own token ids, used as given)."""

    input: str | list[str | int | list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Meta(ge=1)] | None = None
    user: str | None = None


class Embedding(Struct):
    index: int
    # float: the vector; base64: its little-endian float32 bytes, as OpenAI sends them.
    embedding: list[float] | str
    object: Literal["embedding"] = "embedding"


class EmbeddingUsage(Struct):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(Struct):
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
    object: Literal["list"] = "list"


class EmbeddingModelInfo(Protocol):
    """What the checks need to know about the embedding model (app/embeddings/model.py)."""

    name: str
    max_tokens: int  # the longest input, special tokens included
    dimensions: Any  # .full, and .refusal(n): why n dimensions cannot be given, or None

    @property
    def vocab_size(self) -> int: ...

    def tokenize(self, texts: list[str]) -> list[list[int]]: ...


# -- request ----------------------------------------------------------------------------------


def no_embedding_model() -> ApiError:
    return ApiError(404, "This server has no embedding model: start it with --embedding-model "
                    "(option.embedding_model in serving.properties, SEQGATE_EMBEDDING_MODEL), "
                    "e.g. --embedding-model all-minilm-l6-v2.", "model_not_found", "model")


def check_embedding_model(requested: str | None, served: str) -> None:
    """404 model_not_found unless the request names the embedding model (or none)."""
    if requested and requested != served:
        raise ApiError(404, f"The model '{requested}' is not an embedding model on this server; "
                       f"embeddings come from '{served}'.", "model_not_found", "model")


def _invalid_input(message: str) -> ApiError:
    return ApiError.bad_request(message, param="input")


def _split_input(value: str | list) -> tuple[list[str], list[list[int]]]:
    """(texts, token-id rows): one of them empty, as OpenAI allows no mix."""
    items = [value] if isinstance(value, str) else value
    if not items:
        raise _invalid_input("'input' must not be an empty list.")
    if len(items) > MAX_INPUTS:
        raise _invalid_input(f"'input' has {len(items)} items; at most {MAX_INPUTS} per request.")
    if all(isinstance(x, str) for x in items):
        return items, []
    if all(isinstance(x, int) for x in items):
        return [], [items]
    if all(isinstance(x, list) for x in items):
        return [], items
    raise _invalid_input("'input' must be a string, a list of strings, a list of token ids or a "
                         "list of lists of token ids, not a mix of them.")


def _check_rows(rows: list[list[int]], model: EmbeddingModelInfo) -> None:
    for i, row in enumerate(rows):
        if not row:
            raise _invalid_input(f"input[{i}] is empty.")
        if len(row) > model.max_tokens:
            raise ApiError(400, f"input[{i}] is {len(row)} tokens; this embedding model's maximum "
                           f"context length is {model.max_tokens} tokens. Please shorten it. "
                           "(context_length_exceeded)", "context_length_exceeded", "input")
        bad = next((t for t in row if not 0 <= t < model.vocab_size), None)
        if bad is not None:
            raise _invalid_input(f"input[{i}] holds the token id {bad}, outside this embedding "
                                 f"model's vocabulary of {model.vocab_size} tokens.")


def embedding_rows(req: EmbeddingRequest, model: EmbeddingModelInfo) -> list[list[int]]:
    """The request's inputs as rows of token ids for the model: texts tokenized with its special
    tokens (as sentence-transformers' encode does), token ids as given; each checked."""
    texts, rows = _split_input(req.input)
    for i, text in enumerate(texts):
        if not text:  # as OpenAI: an empty string has nothing to embed
            raise _invalid_input(f"input[{i}] is an empty string.")
    if texts:
        rows = model.tokenize(texts)
    _check_rows(rows, model)
    return rows


def output_size(req: EmbeddingRequest, model: EmbeddingModelInfo) -> int:
    """The vector length to answer with: `dimensions`, where the model can give it."""
    if req.dimensions is None:
        return model.dimensions.full
    reason = model.dimensions.refusal(req.dimensions)
    if reason is not None:
        raise ApiError.bad_request(f"'dimensions'={req.dimensions} cannot be given: {reason}.",
                                   param="dimensions", code="unsupported_value")
    return req.dimensions


# -- response ---------------------------------------------------------------------------------


def _encoded(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


def embedding_response(vectors: Any, rows: list[list[int]], model: str,
                       encoding_format: str) -> EmbeddingResponse:
    """The response for `vectors` ([len(rows), size], anything numpy reads), in input order."""
    array = np.asarray(vectors, dtype=np.float32)
    tokens = sum(map(len, rows))
    return EmbeddingResponse(
        data=[Embedding(i, _encoded(v, encoding_format)) for i, v in enumerate(array)],
        model=model, usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))
