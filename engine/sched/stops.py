"""Stops decided on token ids alone, beside the scheduler: the end-of-sequence token, the
request's stop token ids and the length limits. Stop strings need the text, and live with the
detokenizer (engine.request.stops)."""

from __future__ import annotations

from engine.request.job import SeqStatus, Sequence


def token_stop(s: Sequence, token: int, eos_ids: list[int]) -> SeqStatus | None:
    """The status `token` ends `s` with, if it ends it by its id."""
    if token in eos_ids and not s.params.ignore_eos:
        return SeqStatus.EOS
    if token in s.params.stop_token_ids:
        return SeqStatus.STOP_TOKEN
    return None


def at_length(s: Sequence, max_model_len: int) -> bool:
    """`s` has all the tokens it asked for, or its next one would not fit the context."""
    return len(s.generated) >= s.params.max_new_tokens or s.kv_len + 1 >= max_model_len
