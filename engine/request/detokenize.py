"""Incremental (token-by-token) detokenization for streaming output."""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

# How many prompt tokens prime the stream. Only the immediate left context affects how the first
# generated token decodes (leading-space stripping, merges), so a short tail keeps the first
# push O(1) instead of O(prompt length). Same value vLLM uses.
PRIME_TOKENS = 5

# Once the prefix before the current decode window grows past this, the ids behind it are
# dropped, so a long generation keeps a bounded id buffer (amortised O(1) per push).
_TRIM_AT = 1024

_REPLACEMENT = "\ufffd"


def backend_of(tokenizer: Any) -> Tokenizer:
    """The Rust `tokenizers.Tokenizer` behind a transformers tokenizer (or the object itself)."""
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    # transformers 5 exposes it as `backend_tokenizer`; older fast tokenizers as `_tokenizer`.
    for attr in ("backend_tokenizer", "_tokenizer"):
        backend = getattr(tokenizer, attr, None)
        if isinstance(backend, Tokenizer):
            return backend
    raise TypeError(f"{type(tokenizer).__name__} has no Rust (tokenizers) backend")


class IncrementalDetokenizer:
    """Turns one sequence's generated token ids into text, one token at a time.

    Owns the decode state of a single sequence: a `tokenizers` `DecodeStream` (the Rust
    prefix-offset algorithm), plus a short copy of the ids and offsets it has consumed so that
    `flush()` and the fallback below can work without the stream's private state.

    Guarantee: ``"".join(push(i) for i in ids) + flush() == tokenizer.decode(ids,
    skip_special_tokens=...)`` whenever the decoder's text for a window of tokens is a stable
    prefix of its text for that window extended, as for byte-level BPE (property-tested on
    SmolLM2, with and without a prompt, on arbitrary ids incl. byte fragments and special
    tokens). With a prompt, a SentencePiece-style first token keeps the word-start space it has
    in context (" Hello"), where ``decode(ids)`` of the generated ids alone would strip it.

    Known limits, by design:
    - `push` returns "" while the decoded text ends in U+FFFD (an incomplete multi-byte
      character). A genuine U+FFFD at the end is therefore held until the next token or
      `flush()`; a run of invalid byte tokens is re-decoded per token until it ends (quadratic in
      that run only, never in the whole sequence).
    - A decoder whose text for earlier tokens changes when later tokens arrive (a custom or
      context-dependent decoder; the stock byte-level, Metaspace and WordPiece ones work per
      token or per window and do not) makes `DecodeStream` raise. Emitted text cannot be taken
      back, so this sequence then switches to the vLLM/TGI offset method (emit the window's new
      text past the old prefix's length): streaming goes on, but may differ from `decode()`
      around the rewrite.
    - `tokenizer.decode`'s optional `clean_up_tokenization_spaces` post-pass (transformers skips
      it for BPE anyway) is not applied: streaming emits the Rust decoder's text.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_ids: list[int] | None = None,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tok = backend_of(tokenizer)
        self._skip = skip_special_tokens
        prime = list(prompt_ids[-PRIME_TOKENS:]) if prompt_ids else []
        prime_text = self._decode(prime) if prime else ""
        if prime_text.endswith(_REPLACEMENT):
            # The prompt ends inside a multi-byte character. DecodeStream would then take an
            # empty prefix and echo the prompt tail, and the character's completion belongs
            # half to the prompt anyway: decode the generated ids on their own instead.
            prime, prime_text = [], ""
        # _ids[_prefix:_read] is the window already emitted (its text is _prefix_text);
        # _ids[_read:] are tokens pushed but not yet emitted. Mirrors DecodeStream's state.
        self._ids: list[int] = prime
        self._prefix = 0
        self._read = len(prime)
        self._prefix_text = prime_text
        self._stream: DecodeStream | None = DecodeStream(
            ids=prime or None, skip_special_tokens=skip_special_tokens
        )

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def push(self, token_id: int) -> str:
        """Add one generated token; return the text it completes ("" if none yet)."""
        self._ids.append(token_id)
        if self._stream is not None:
            try:
                chunk = self._stream.step(self._tok, token_id)
            except Exception:
                # InvalidPrefix: the decoder rewrote already-emitted text (see class doc).
                self._stream = None
                self._prefix_text = self._decode(self._ids[self._prefix : self._read])
                return self._step_offsets()
            if chunk is None:
                return ""
            self._advance()
            return chunk
        return self._step_offsets()

    def _step_offsets(self) -> str:
        # vLLM/TGI prefix-offset method: decode the window with and without the unread ids and
        # emit the difference once it no longer ends in an incomplete character.
        new_text = self._decode(self._ids[self._prefix :])
        if len(new_text) <= len(self._prefix_text) or new_text.endswith(_REPLACEMENT):
            return ""
        chunk = new_text[len(self._prefix_text) :]
        self._advance()
        return chunk

    def _advance(self) -> None:
        # Same bookkeeping as DecodeStream: the tokens just emitted become the next prefix.
        self._prefix, self._read = self._read, len(self._ids)
        if self._stream is None:
            # Only the fallback reads _prefix_text per token; the stream keeps its own copy.
            self._prefix_text = self._decode(self._ids[self._prefix : self._read])
        if self._prefix >= _TRIM_AT:
            del self._ids[: self._prefix]
            self._read -= self._prefix
            self._prefix = 0

    def flush(self) -> str:
        """Text of tokens pushed but not yet emitted, as `decode()` renders them (U+FFFD for an
        unfinished character). Call once when the sequence ends; the detokenizer is done after."""
        if self._read == len(self._ids):
            return ""
        window = self._ids[self._prefix :]
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(window)
        self._ids, self._prefix, self._read, self._stream = [], 0, 0, None
        self._prefix_text = ""
        return text[len(prefix_text) :]
