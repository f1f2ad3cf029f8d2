"""The size bound checked before tokenizing: never refuses a prompt that fits, refuses a text
that cannot, without tokenizing it."""

from __future__ import annotations

import pytest

from adapters.errors import ApiError
from adapters.prompt_size import (
    PROBE_CHARS_PER_TOKEN,
    check_prompt_size,
    encode_bounded,
    max_prompt_bytes,
)


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


class CountingTokenizer:
    """The real tokenizer, counting the characters it was asked to encode."""

    def __init__(self, tokenizer):
        self.tokenizer, self.encoded_chars = tokenizer, 0

    def encode(self, text, **kw):
        self.encoded_chars += len(text)
        return self.tokenizer.encode(text, **kw)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def test_a_long_ordinary_text_is_refused_after_tokenizing_only_its_head(tokenizer):
    n = 256
    text = "the quick brown fox jumps over the lazy dog " * 2000  # 88,000 chars, ~18,000 tokens
    counting = CountingTokenizer(tokenizer)
    with pytest.raises(ApiError) as err:
        encode_bounded(counting, text, n, "prompt")
    assert err.value.code == "context_length_exceeded" and err.value.param == "prompt"
    assert "maximum context length is 256 tokens" in err.value.message
    assert counting.encoded_chars <= n * PROBE_CHARS_PER_TOKEN  # the head, not the 88,000


@pytest.mark.parametrize("text", [
    "the quick brown fox " * 300,  # ordinary
    " " * 100_000 + "x",  # dense (~64 characters a token), longer than the probe's head
    "\n" + " " * 15 + "\n" + "0" * 3 + " " * 70_000,
    "short",
])
def test_whatever_fits_is_tokenized_exactly_as_encode_does(tokenizer, text):
    n = 2048
    expected = tokenizer.encode(text, add_special_tokens=False)
    assert len(expected) <= n
    assert encode_bounded(tokenizer, text, n, "prompt", add_special_tokens=False) == expected


def test_the_head_holds_the_whole_texts_first_tokens(tokenizer):
    """Why the probe is sound: cut at a space, the head's ids are a prefix of the text's ids (up
    to its last pre-token), so a head over the context means the text is over it too."""
    text = "Lorem ipsum dolor sit amet, consectetur adipiscing elit. " * 400
    for cut in (1000, 4097, 12_345):
        cut = text.rfind(" ", 0, cut)
        head = tokenizer.encode(text[:cut], add_special_tokens=False)
        whole = tokenizer.encode(text, add_special_tokens=False)
        assert whole[: len(head) - 1] == head[:-1]
