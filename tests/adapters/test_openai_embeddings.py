"""adapters/openai_embeddings.py: inputs to rows, the output size, and the response, against a
model described by hand (the live route: tests/app/test_embeddings.py)."""

from __future__ import annotations

import base64
from dataclasses import dataclass, field

import numpy as np
import pytest

from adapters.errors import ApiError
from adapters.openai_embeddings import (
    EmbeddingRequest,
    embedding_response,
    embedding_rows,
    output_size,
)
from app.embeddings.model import Dimensions


@dataclass
class Model:
    """What the adapter asks of a model; tokenize() gives one id per character, plus 2 ends."""

    name: str = "enc"
    max_tokens: int = 8
    dimensions: Dimensions = field(default_factory=lambda: Dimensions(4, True, (2,)))
    vocab_size: int = 1000

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        return [[1, *(ord(c) for c in t), 2] for t in texts]


@pytest.mark.parametrize(("value", "rows"), [
    ("ab", [[1, 97, 98, 2]]),
    (["a", "b"], [[1, 97, 2], [1, 98, 2]]),
    ([5, 6], [[5, 6]]),
    ([[5], [6, 7]], [[5], [6, 7]]),
])
def test_every_input_shape_becomes_rows(value, rows):
    assert embedding_rows(EmbeddingRequest(input=value), Model()) == rows


def test_the_limit_counts_the_special_tokens():
    assert embedding_rows(EmbeddingRequest(input="abcdef"), Model()) == [
        [1, 97, 98, 99, 100, 101, 102, 2]]
    with pytest.raises(ApiError) as err:
        embedding_rows(EmbeddingRequest(input=["ok", "abcdefg"]), Model())
    assert err.value.param == "input" and "input[1] is 9 tokens" in err.value.message


def test_output_size_follows_the_models_dimensions():
    model = Model()
    assert output_size(EmbeddingRequest(input="a"), model) == 4
    assert output_size(EmbeddingRequest(input="a", dimensions=2), model) == 2
    with pytest.raises(ApiError) as err:
        output_size(EmbeddingRequest(input="a", dimensions=3), model)
    assert err.value.param == "dimensions" and "2 dimensions" in err.value.message


def test_response_in_floats_and_base64_with_usage():
    vectors = np.array([[0.5, -0.25], [1.0, 0.0]], dtype=np.float32)
    rows = [[1, 2, 3], [4, 5]]
    floats = embedding_response(vectors, rows, "enc", "float")
    assert [d.embedding for d in floats.data] == [[0.5, -0.25], [1.0, 0.0]]
    assert (floats.usage.prompt_tokens, floats.usage.total_tokens) == (5, 5)
    packed = embedding_response(vectors, rows, "enc", "base64")
    decoded = [np.frombuffer(base64.b64decode(d.embedding), "<f4") for d in packed.data]
    assert np.array_equal(np.stack(decoded), vectors)
    assert [d.index for d in packed.data] == [0, 1] and packed.model == "enc"
