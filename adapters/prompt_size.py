"""A cheap bound checked before tokenizing: a prompt with more bytes than any prompt of
`max_model_len` tokens can have is refused without being tokenized.

Tokenizing costs time in proportion to the text (about 3 s of a core for 4 MiB here), on a core
the engine needs; a prompt that long can never fit the context anyway. The bound: every token
stands for at most `longest` bytes of (normalized) text, where `longest` is the longest vocabulary
entry in UTF-8 bytes, itself an over-estimate for byte-level BPE vocabularies, whose entries spell
one byte as one (often two-byte) character. A tokenizer with a normalizer may shrink text
(NFKC, accent stripping), so it gets four times the room.
"""

from __future__ import annotations

import weakref

from adapters.errors import ApiError

NORMALIZER_SLACK = 4

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


def check_prompt_size(text: str, tokenizer, max_model_len: int, param: str) -> None:
    """400 context_length_exceeded, without tokenizing, for a text that cannot fit."""
    limit = max_prompt_bytes(tokenizer, max_model_len)
    if len(text) <= limit // 4:  # at most 4 bytes a character: certainly within the bound
        return
    size = len(text.encode("utf-8"))
    if size > limit:
        raise ApiError(400, f"This model's maximum context length is {max_model_len} tokens. "
                       f"However, your prompt is {size} bytes, more than any prompt of "
                       f"{max_model_len} tokens can be ({limit} bytes). Please reduce the "
                       "prompt. (context_length_exceeded)", "context_length_exceeded", param)
