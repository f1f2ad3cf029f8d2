"""Tokenizing untrusted prompts at a cost bounded by the context, not by the body.

Two checks before a prompt is tokenized whole. First a cheap bound: a prompt with more bytes than
any prompt of `max_model_len` tokens can have is refused without being tokenized. Then a probe: a
text much longer than a context's worth of ordinary text has its head tokenized first (cut at a
white-space, where byte-level BPE pre-tokenizers split anyway, so the head's tokens are the whole
text's first tokens); a head that alone holds more than the context is refused there. So the
largest body a client may send costs one head's tokenizing (~0.1 s of a core), not seconds.

Tokenizing costs time in proportion to the text (about 3 s of a core for 4 MiB here), on a core
the engine needs; a prompt that long can never fit the context anyway. The bound: every token
stands for at most `longest` bytes of (normalized) text, where `longest` is the longest vocabulary
entry in UTF-8 bytes, itself an over-estimate for byte-level BPE vocabularies, whose entries spell
one byte as one (often two-byte) character. A tokenizer with a normalizer may shrink text
(NFKC, accent stripping), so it gets four times the room.
"""

from __future__ import annotations

import weakref

from adapters.errors import prompt_too_long

NORMALIZER_SLACK = 4
# The probe's head: this many characters per token of context. Ordinary text runs 3 to 6
# characters a token, so a head this long overflows the context unless the text is unusually
# dense (long runs of spaces or digits compress), and then the whole text is tokenized.
PROBE_CHARS_PER_TOKEN = 16
# Tokens the head may hold beyond the context and still not be refused on the head alone: the
# cut can split the last pre-token differently from the whole text.
PROBE_SLACK = 16

_LONGEST: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _longest_token_bytes(tokenizer) -> int:
    try:
        return _LONGEST[tokenizer]
    except (KeyError, TypeError):
        pass
    vocab = tokenizer.get_vocab()
    longest = max((len(t.encode("utf-8")) for t in vocab), default=1)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.normalizer is not None:
        longest *= NORMALIZER_SLACK
    try:
        _LONGEST[tokenizer] = longest
    except TypeError:
        pass
    return longest


def max_prompt_bytes(tokenizer, max_model_len: int) -> int:
    """More UTF-8 bytes than this cannot be tokenized into `max_model_len` tokens or fewer."""
    return max_model_len * _longest_token_bytes(tokenizer)


def encode_bounded(tokenizer, text: str, max_model_len: int, param: str,
                   add_special_tokens: bool = True) -> list[int]:
    """`tokenizer.encode(text)`, after the two checks above: raises 400 context_length_exceeded
    (naming `param`) for a text that cannot fit, at a cost bounded by `max_model_len`."""
    check_prompt_size(text, tokenizer, max_model_len, param)
    probe = max_model_len * PROBE_CHARS_PER_TOKEN
    if len(text) > 2 * probe:
        cut = text.rfind(" ", probe // 2, probe)
        end = cut if cut > 0 else probe
        head = tokenizer.encode(text[:end], add_special_tokens=False)
        if len(head) > max_model_len + PROBE_SLACK:
            raise prompt_too_long(max_model_len, f"more than {len(head)} tokens (counted in its "
                                  f"first {end} characters of {len(text)})", param)
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def check_prompt_size(text: str, tokenizer, max_model_len: int, param: str) -> None:
    """400 context_length_exceeded, without tokenizing, for a text that cannot fit."""
    limit = max_prompt_bytes(tokenizer, max_model_len)
    if len(text) <= limit // 4:  # at most 4 bytes a character: certainly within the bound
        return
    size = len(text.encode("utf-8"))
    if size > limit:
        raise prompt_too_long(max_model_len, f"{size} bytes, more than any prompt of "
                              f"{max_model_len} tokens can be ({limit} bytes)", param)
