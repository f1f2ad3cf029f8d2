"""Greedy agreement: do seqgate and the peer write the same text for the same prompt?

Both get the same non-streamed greedy chats with the same max_tokens. Texts are compared exactly;
for a difference the report gives the first differing character and token (the texts re-encoded
with the model's tokenizer) and a little context on both sides, which is usually enough to see
the cause (a near-tie between two tokens under different arithmetic, a stop handled differently,
a budget counted differently). seqgate is asked for its two likeliest tokens at every step, so a
difference also gets seqgate's logprob gap between them where the texts part: a gap of a few
hundredths is a near tie that rounding can tip either way.
"""

from __future__ import annotations

from collections.abc import Sequence

from bench.figures import RequestResult


def first_difference(a: Sequence, b: Sequence) -> int | None:
    """The first index where two sequences differ (the shorter one's length if one is a prefix
    of the other); None if they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _around(text: str, at: int, width: int = 40) -> str:
    return text[max(0, at - width):at + width]


def compare_pair(ours: RequestResult, theirs: RequestResult, tokenizer) -> dict:
    """One prompt's comparison: same text?, else where and how they part."""
    row = {"index": ours.index, "match": False, "ours_tokens": ours.output_tokens,
           "theirs_tokens": theirs.output_tokens, "ours_finish": ours.finish_reason,
           "theirs_finish": theirs.finish_reason}
    if ours.error or theirs.error:
        row["error"] = ours.error or theirs.error
        return row
    char = first_difference(ours.text, theirs.text)
    if char is None:
        row["match"] = True
        return row
    ids_a = tokenizer.encode(ours.text, add_special_tokens=False)
    ids_b = tokenizer.encode(theirs.text, add_special_tokens=False)
    row.update(first_diff_char=char, first_diff_token=first_difference(ids_a, ids_b),
               ours_context=_around(ours.text, char), theirs_context=_around(theirs.text, char))
    at = margin_at(ours.margins, char)
    if at is not None:
        row.update(ours_token=at[0], ours_runner_up=at[1], ours_margin=at[2])
    return row


def margin_at(margins: Sequence[tuple[str, str, float]] | None, char: int
              ) -> tuple[str, str, float] | None:
    """The (token, runner-up, gap) of the generated token whose text spans character `char`."""
    if not margins:
        return None
    end = 0
    for entry in margins:
        end += len(entry[0])
        if char < end:
            return tuple(entry)
    return None


def compare(ours: Sequence[RequestResult], theirs: Sequence[RequestResult], tokenizer) -> dict:
    """Every prompt's comparison and the number that match."""
    rows = [compare_pair(a, b, tokenizer) for a, b in zip(ours, theirs)]
    return {"prompts": len(rows), "matches": sum(r["match"] for r in rows), "rows": rows}
