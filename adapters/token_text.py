"""A single token's text and UTF-8 bytes, for logprobs and DJL token lists.

Decoding one token alone turns a piece of a multi-byte character into U+FFFD, losing the bytes
that OpenAI's `bytes` field exists to carry. Byte-level BPE vocabularies (GPT-2 style, SmolLM2's)
spell each byte as one printable character, so the exact bytes are recovered from the vocabulary
string; other vocabularies fall back to decoding the token.
"""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    # GPT-2's bytes_to_unicode table, inverted: printable stand-in character -> byte.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class TokenText:
    """Maps token ids to (text, bytes) for one tokenizer, caching what it has looked up."""

    def __init__(self, tokenizer) -> None:
        self._tok = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}
        self._special = set(getattr(tokenizer, "all_special_ids", []) or [])

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._cache[token_id] = self._lookup(token_id)
        return hit

    def text(self, token_id: int) -> str:
        return self(token_id)[0]

    def _lookup(self, token_id: int) -> tuple[str, list[int]]:
        piece = self._tok.convert_ids_to_tokens(token_id)
        decoder = _byte_decoder()
        if token_id not in self._special and isinstance(piece, str) and piece and all(
                ch in decoder for ch in piece):
            raw = bytes(decoder[ch] for ch in piece)
            return raw.decode("utf-8", errors="replace"), list(raw)
        text = self._tok.decode([token_id], skip_special_tokens=False)
        return text, list(text.encode("utf-8"))
