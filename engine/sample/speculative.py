"""Speculative decoding by prompt lookup (n-gram drafting, as vLLM's `ngram` method and
llama.cpp's lookup decoding): a row whose last few tokens occurred earlier in its prompt or
output proposes the tokens that followed them there; the next step feeds its pending token and
that draft together (causally, at consecutive positions) and keeps the longest prefix of the
draft that its own choices agree with, plus the choice after it. A greedy row's output is the
one plain greedy decoding gives, token for token; a step yields up to 1 + k tokens per row for
about the cost of one where the weights' reads bound it, and for a share more of the arithmetic
per drafted token where the multiply-adds do (few rows on a CPU): `Payoff` picks the length.

Sampled rows verify by rejection sampling (Leviathan et al. 2023; Chen et al. 2023), which keeps
their output distributed as plain sampling gives it (`sampled_choices`). Seeded rows do not
draft: how many tokens a step keeps depends on the rows beside them, and so would the draws
their seed is meant to fix.

A sub-batch's rows share one slab window, so a sub-batch keeps the drafted tokens that all its
rows accepted (`SpecOutcome.kept`): the rows stay right-aligned, with no columns to move. With
few rows, the case speculation is for, little is lost; with more than `speculative_max_rows`
no step speculates.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.request.job import Sequence
from engine.sample.draft_model import DraftModel
from engine.sample.sampling import filtered_probs
from engine.staging import to_device

# n-gram sizes matched, longest first: a longer match predicts better; 2 still finds copies.
MIN_NGRAM, MAX_NGRAM = 2, 4
# How far back a row's context is searched (its newest tokens; a Python scan per step).
SEARCH_TOKENS = 2048
# Acceptance below this (tokens kept per token proposed, over recent steps) pauses drafting
# for PAUSE_STEPS: a draft costs its columns' compute and a masked attention.
LOW_ACCEPTANCE, PAUSE_STEPS = 0.1, 32
# Payoff: each draft length (0: none) is judged after this many decode-only steps at a row
# count, over decayed sums; the lengths that lose are tried again in turn every EXPLORE-th step
# there, so that a change (longer contexts, other prompts) is seen.
MIN_STEPS, DECAY, EXPLORE = 4, 0.95, 16


def draft_lengths(k: int) -> tuple[int, ...]:
    """The draft lengths the payoff chooses among for at most `k` drafted tokens: none, the
    powers of two below k, and k (0, 1, 2, 4 for 4)."""
    return tuple(sorted({0, k, *(n for n in (1, 2, 4, 8, 16) if n < k)})) if k > 0 else (0,)


class Payoff:
    """How many tokens to draft, per number of rows decoding, judged by what each length
    yielded: output tokens per second of decode-only steps whose drafts were capped at it (0:
    none), the steps that found no draft included, since that is what the choice yields. A
    drafted column costs little where the weights' reads bound a step, and about a row's share
    of the arithmetic where the multiply-adds do (a CPU's few-row products: each more column
    added a fifth to a one-row step's products on AVX2, docs/benchmarks/speed.md), while each
    further drafted token is kept less often than the one before: a shorter draft can pay where
    a longer one does not. Which one depends on the machine, the model and the text, so it is
    measured rather than modelled."""

    def __init__(self, lengths: tuple[int, ...] = (0, 4)) -> None:
        self.lengths = lengths  # ascending, 0 first
        self._sums: dict[tuple[int, int], list[float]] = {}  # (rows, length) -> tokens, s, steps
        self._asked: dict[int, int] = {}

    def observe(self, rows: int, length: int, tokens: int, seconds: float) -> None:
        t = self._sums.setdefault((rows, length), [0.0, 0.0, 0.0])
        t[0], t[1], t[2] = DECAY * t[0] + tokens, DECAY * t[1] + seconds, t[2] + 1

    def _rate(self, rows: int, length: int) -> float | None:
        t = self._sums.get((rows, length))
        return t[0] / t[1] if t is not None and t[2] >= MIN_STEPS and t[1] > 0 else None

    def length(self, rows: int) -> int:
        """The draft length for the coming step of `rows` rows."""
        rates = {n: self._rate(rows, n) for n in self.lengths}
        unseen = [n for n in self.lengths if rates[n] is None]
        if unseen:
            return unseen[-1]  # learn what each yields, the longest first
        self._asked[rows] = asked = self._asked.get(rows, 0) + 1
        best = max(self.lengths, key=lambda n: rates[n])
        if asked % EXPLORE:
            return best
        others = [n for n in self.lengths if n != best]
        return others[(asked // EXPLORE - 1) % len(others)]


def propose(context: list[int], k: int) -> list[int]:
    """Up to `k` tokens that followed the most recent earlier occurrence of the longest of
    `context`'s final n-grams (MIN_NGRAM..MAX_NGRAM) in `context`; [] when none recurs."""
    window = context[-SEARCH_TOKENS:]
    end = len(window)
    for n in range(MAX_NGRAM, MIN_NGRAM - 1, -1):
        if end <= n:
            continue
        tail = window[-n:]
        first = tail[0]
        for start in range(end - n - 1, -1, -1):
            if window[start] == first and window[start : start + n] == tail:
                return window[start + n : start + n + k]
    return []


def plain(s: Sequence) -> bool:
    """Whether `s`'s next tokens come from its raw logits alone (what verification checks a
    draft against): greedy, or sampled without a seed, with nothing that changes its logits
    or wants their values."""
    p = s.params
    drawn = s.job.strategy == "sample" and s.generator is None
    return ((s.job.strategy == "greedy" or drawn) and s.matcher is None and not p.logit_bias
            and not p.logprobs and len(s.generated) >= p.min_new_tokens
            and not p.presence_penalty and not p.frequency_penalty
            and p.repetition_penalty == 1.0 and s.candidates is None)


@dataclass
class SpecOutcome:
    """A speculative sub-batch's verification: per row, the tokens it accepts in order."""

    kept: int  # drafted tokens every row accepted (the slab keeps 1 + kept new columns)
    tokens: list[list[int]]  # per row: its first `kept` draft tokens, then its own choice


def verify(drafts: list[list[int]], choices: list[list[int]]) -> SpecOutcome:
    """Given each row's draft and its choice after each fed token (pending token, then the
    draft's: a greedy row's argmax, a sampled row's `sampled_choices`), what the sub-batch
    keeps."""
    agreed = []
    for draft, chosen in zip(drafts, choices):
        n = 0
        while n < len(draft) and draft[n] == chosen[n]:
            n += 1
        agreed.append(n)
    kept = min(agreed)
    return SpecOutcome(kept, [d[:kept] + [c[kept]] for d, c in zip(drafts, choices)])


def sampled_choices(logits: torch.Tensor, firsts: list[int], drafts: list[list[int]],
                    seqs: list[Sequence], generator: torch.Generator) -> list[list[int]]:
    """Each sampled row's verification: its draft's tokens it keeps, then one it draws.

    A prompt-lookup draft is a point mass (q(d) = 1), so rejection sampling keeps the draft's
    token d_j with probability p_j(d_j), the row's filtered distribution after the tokens
    before it; at the first it refuses, the row draws from p_j without d_j (the residual
    max(0, p - q), renormalised), and when it keeps them all, from the distribution after the
    last. Every position's token is then distributed as p_j given those before it, so a row cut
    to fewer kept tokens (its sub-batch's) is still distributed as plain sampling.
    """
    dev = logits.device
    starts, rows, p = [], [], []  # each row's first position among `rows`; logits rows; params
    for f, d, s in zip(firsts, drafts, seqs):
        starts.append(len(rows))
        rows += range(f, f + 1 + len(d))
        p += [s.params] * (1 + len(d))
    probs = filtered_probs(logits[to_device(rows, dev)], p)
    # Each draft token's probability where it was proposed, against one uniform draw each.
    at = to_device([[a + j for a, d in zip(starts, drafts) for j in range(len(d))],
                    [t for d in drafts for t in d]], dev)
    kept = (torch.rand(at.shape[1], generator=generator, device=dev)
            < probs[at[0], at[1]]).tolist()
    ends, i = [], 0  # per row: the position it draws at (its first refusal, or after its draft)
    for a, d in zip(starts, drafts):
        ends.append(a + next((j for j, ok in enumerate(kept[i : i + len(d)]) if not ok), len(d)))
        i += len(d)
    residual = probs[to_device(ends, dev)]
    refused = [(r, d[e - a]) for r, (a, e, d) in enumerate(zip(starts, ends, drafts))
               if e - a < len(d)]
    if refused:
        gone = to_device(list(zip(*refused)), dev)
        residual[gone[0], gone[1]] = 0.0
    # A refusal needs a draw u >= p(d) with u < 1, so some other token keeps mass.
    picks = torch.multinomial(residual, 1, generator=generator).squeeze(1).tolist()
    return [d[: e - a] + [x] for a, e, d, x in zip(starts, ends, drafts, picks)]


class Speculator:
    """Proposes drafts before each step, within what the rows may still generate, and counts
    what verification kept; drafting pauses where it does not pay. Drafts come from prompt
    lookup, or from `draft_model` where one is configured."""

    def __init__(self, config: EngineConfig, max_model_len: int,
                 draft_model: DraftModel | None = None):
        self.k = config.num_speculative_tokens
        self.max_rows = config.speculative_max_rows
        self.max_model_len = max_model_len
        self.proposed = 0  # draft tokens fed
        self.accepted = 0  # of those, kept
        self._recent = [0.0, 0.0]  # decayed (proposed, accepted)
        self._paused = 0
        self.payoff = Payoff(draft_lengths(self.k))
        self._length = 0  # the draft length of the step under way
        self.draft_model = draft_model

    def draft(self, rows: list[Sequence]) -> None:
        """Set each running row's draft for the coming step ([] where none is proposed)."""
        self._length = (self.payoff.length(len(rows))
                        if self.k and 0 < len(rows) <= self.max_rows and not self._pause()
                        else 0)
        if self.draft_model is not None and self.draft_model.rows:
            self.draft_model.keep_only({(s.job.job_id, s.index) for s in rows})
        for s in rows:
            s.draft = self._propose(s, self._length) if self._length else []

    def step_done(self, rows: int, tokens: int, seconds: float) -> None:
        """A decode-only step of `rows` rows made `tokens` tokens in `seconds`: what drafting
        (or not) yielded there."""
        if 0 < rows <= self.max_rows and self.k:
            self.payoff.observe(rows, self._length, tokens, seconds)

    def _propose(self, s: Sequence, length: int) -> list[int]:
        if not plain(s) or s.status.finished:
            return []
        # Within the job's reservation and the context: the pending token, the draft and the
        # choice after it must all fit.
        room = min(length, s.tokens_left - 1, self.max_model_len - s.kv_len - 2)
        if room <= 0:
            return []
        context = s.job.prompt_ids + s.generated
        if self.draft_model is not None:
            return self.draft_model.propose((s.job.job_id, s.index), context, room)
        return propose(context, room)

    def _pause(self) -> bool:
        if self._paused:
            self._paused -= 1
            return True
        proposed, accepted = self._recent
        if proposed >= 4 * max(self.k, 1) and accepted < LOW_ACCEPTANCE * proposed:
            self._paused, self._recent = PAUSE_STEPS, [0.0, 0.0]
            return True
        return False

    def record(self, proposed: int, accepted: int) -> None:
        self.proposed += proposed
        self.accepted += accepted
        self._recent = [0.9 * self._recent[0] + proposed, 0.9 * self._recent[1] + accepted]
