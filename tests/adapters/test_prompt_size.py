"""The size bound checked before tokenizing: never refuses a prompt that fits, refuses a text
that cannot, without tokenizing it."""

from __future__ import annotations

import pytest

from adapters.errors import ApiError
from adapters.prompt_size import check_prompt_size, max_prompt_bytes


def test_the_densest_prompt_that_fits_passes(tokenizer):
    # The vocabulary's longest entry (a run of spaces after a newline), repeated: the most bytes
    # a prompt of n tokens can carry.
    vocab = tokenizer.get_vocab()
    densest = max(vocab, key=lambda t: len(tokenizer.convert_tokens_to_string([t])))
    n = 64
    text = tokenizer.convert_tokens_to_string([densest]) * n
    assert len(tokenizer.encode(text, add_special_tokens=False)) <= n
    check_prompt_size(text, tokenizer, n, "prompt")  # no error


def test_a_text_over_the_bound_is_refused_without_tokenizing(tokenizer, monkeypatch):
    limit = max_prompt_bytes(tokenizer, 16)
    monkeypatch.setattr(tokenizer, "encode", lambda *a, **k: pytest.fail("tokenized"))
    with pytest.raises(ApiError) as err:
        check_prompt_size("x" * (limit + 1), tokenizer, 16, "messages")
    assert err.value.code == "context_length_exceeded" and err.value.param == "messages"
    assert "maximum context length is 16 tokens" in err.value.message
    check_prompt_size("x" * limit, tokenizer, 16, "messages")  # the bound itself passes
    # Characters of several bytes count as bytes.
    with pytest.raises(ApiError):
        check_prompt_size("é" * (limit // 2 + 1), tokenizer, 16, "messages")
