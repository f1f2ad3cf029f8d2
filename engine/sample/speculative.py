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
# Payoff: a step time, or a draft position's acceptance, is trusted once its decayed count
# reaches MIN_SEEN (about four recent steps); sums decay by DECAY at each observation; every
# EXPLORE-th step drafts the longest, so that the later positions' acceptance and the longer
# steps' times stay current (longer contexts, other prompts).
MIN_SEEN, DECAY, EXPLORE = 3.5, 0.95, 16


class Payoff:
    """How many tokens to draft, per number of rows decoding: the length whose expected output
    tokens per second is highest, from two things measured on this machine and this text:
    - the seconds of a decode-only step by rows and by columns fed per row (1 + the longest
      draft): a drafted column costs little where the weights' reads bound a step, and about a
      row's share of the arithmetic where the multiply-adds do (a CPU's few-row products: a
      five-column step's products cost 1.9 times a one-column step's on AVX2,
      docs/benchmarks/speed.md);
    - how often a draft's j-th token is kept when the ones before it were: later tokens are
      kept less often, so a shorter draft can pay where a longer one does not.
    - how many of the rows a step drafts for are fed a draft: a row whose context has no
      match has none, and a sub-batch feeds none unless all its rows have one. With several
      rows the step then often carries one row's draft: the longer step's cost, one row's gain.
    A fed row's draft of length L yields 1 + the sum over j <= L of the chance that its first j
    tokens are kept; a row not fed yields one token. A step feeding any draft takes the time of
    1 + L columns, one feeding none that of one column; no draft yields one token a row in a
    step of one column. Times of column counts not seen are drawn on the line through the
    nearest two seen. These are steadier than whole steps' yields (a step keeps 0 to L tokens),
    so the choice does not follow one lucky run of steps."""

    def __init__(self, k: int) -> None:
        self.k = k
        self._seconds: dict[tuple[int, int], list[float]] = {}  # (rows, columns) -> s, count
        # Per sub-batch size (0: all sizes) and draft position: drafts whose earlier tokens
        # were kept, and of those, the drafts that kept this one too. A sub-batch keeps what
        # all its rows agree with, so more rows keep less.
        self._reached: dict[int, list[float]] = {}
        self._kept: dict[int, list[float]] = {}
        self._asked: dict[int, int] = {}
        # Per row count, over steps that drafted: decayed steps, steps that fed any draft, and
        # the share of their rows fed.
        self._fed: dict[int, list[float]] = {}

    def observe(self, rows: int, columns: int, seconds: float) -> None:
        t = self._seconds.setdefault((rows, columns), [0.0, 0.0])
        t[0], t[1] = DECAY * t[0] + seconds, DECAY * t[1] + 1

    def observe_fed(self, rows: int, fed: int) -> None:
        """A step of `rows` rows (at least one) drafted for and fed drafts to `fed` of them."""
        f = self._fed.setdefault(rows, [0.0, 0.0, 0.0])
        f[0], f[1], f[2] = DECAY * f[0] + 1, DECAY * f[1] + (fed > 0), DECAY * f[2] + fed / rows

    def observe_draft(self, rows: int, drafted: int, kept: int) -> None:
        """A sub-batch of `rows` rows fed drafts of at least `drafted` tokens, kept `kept`."""
        for size in (rows, 0):
            reached = self._reached.setdefault(size, [0.0] * (self.k + 1))
            kept_ = self._kept.setdefault(size, [0.0] * (self.k + 1))
            for j in range(1, min(drafted, self.k) + 1):
                reached[j] = DECAY * reached[j] + (kept >= j - 1)
                kept_[j] = DECAY * kept_[j] + (kept >= j)

    def expected_tokens(self, length: int, rows: int = 0) -> float | None:
        """Tokens a row's step yields with a draft of `length` in a sub-batch of `rows` rows
        (all sizes pooled until that size has been seen); None before drafts were judged. A
        position seen fewer than MIN_SEEN times is taken to be kept as often as the one before
        it."""
        if self._reached.get(rows, [0.0, 0.0])[1] < MIN_SEEN:
            rows = 0
        reached, kept = self._reached.get(rows), self._kept.get(rows)
        if reached is None or reached[1] < MIN_SEEN:
            return None
        total = chance = rate = 1.0
        for j in range(1, length + 1):
            if reached[j] >= MIN_SEEN:
                rate = kept[j] / reached[j]
            chance *= rate
            total += chance
        return total

    def length(self, rows: int) -> int:
        """The draft length for the coming step of `rows` rows."""
        if self.expected_tokens(1) is None:
            return self.k  # learn what drafts keep
        seconds = {c: t[0] / t[1] for (r, c), t in self._seconds.items()
                   if r == rows and t[1] >= MIN_SEEN}
        if 1 not in seconds:
            return 0  # and what a step without one costs
        if len(seconds) < 2:
            return self.k  # and what a step with one costs
        self._asked[rows] = asked = self._asked.get(rows, 0) + 1
        if asked % EXPLORE == 0:
            return self.k
        any_fed, share = 1.0, 1.0  # until seen: every row fed
        fed = self._fed.get(rows)
        if fed is not None and fed[0] >= MIN_SEEN:
            any_fed, share = fed[1] / fed[0], fed[2] / fed[0]
        rates = {n: (1 + share * (self.expected_tokens(n, rows) - 1))
                 / (any_fed * _on_line(seconds, 1 + n) + (1 - any_fed) * seconds[1])
                 for n in range(1, self.k + 1)}
        rates[0] = 1.0 / seconds[1]
        return max(rates, key=lambda n: (rates[n], -n))  # the shorter where equal


def _on_line(seconds: dict[int, float], c: int) -> float:
    """Seconds of a step of `c` columns (more than one column seen, the first among them): as
    seen, else on the line through the nearest two column counts seen, and never less than
    the largest count seen below it took (noise can tilt the line down)."""
    if c in seconds:
        return seconds[c]
    seen = sorted(seconds)
    below, above = [x for x in seen if x < c], [x for x in seen if x > c]
    a, b = (below[-1], above[0]) if above else (below[-2], below[-1])
    line = seconds[a] + (seconds[b] - seconds[a]) * (c - a) / (b - a)
    return max(line, seconds[below[-1]])


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
        self.payoff = Payoff(self.k)
        self._columns = 1  # columns the step under way feeds per row
        self._length = 0  # the draft length chosen for it
        self._fed_rows = 0  # and the rows it fed drafts to
        self.draft_model = draft_model

    def draft(self, rows: list[Sequence]) -> None:
        """Set each running row's draft for the coming step ([] where none is proposed)."""
        length = (self.payoff.length(len(rows))
                  if self.k and 0 < len(rows) <= self.max_rows and not self._pause() else 0)
        if self.draft_model is not None and self.draft_model.rows:
            self.draft_model.keep_only({(s.job.job_id, s.index) for s in rows})
        for s in rows:
            s.draft = self._propose(s, length) if length else []
        self._length = length
        # Until `record` sees drafts fed: a sub-batch drops them unless all of its rows have
        # one (engine.model.decode_inputs).
        self._columns, self._fed_rows = 1, 0

    def step_done(self, rows: int, seconds: float) -> None:
        """A decode-only step of `rows` rows took `seconds`: what its columns cost."""
        if 0 < rows <= self.max_rows and self.k:
            self.payoff.observe(rows, self._columns, seconds)
            if self._length:
                self.payoff.observe_fed(rows, self._fed_rows)

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

    def record(self, drafts: list[list[int]], kept: int) -> None:
        """A sub-batch verified `drafts` (one per row) and kept the first `kept` of each."""
        proposed, accepted = sum(map(len, drafts)), kept * len(drafts)
        self._columns = max(self._columns, 1 + max(map(len, drafts)))
        self._fed_rows += len(drafts)
        self.payoff.observe_draft(len(drafts), min(map(len, drafts)), kept)
        self.proposed += proposed
        self.accepted += accepted
        self._recent = [0.9 * self._recent[0] + proposed, 0.9 * self._recent[1] + accepted]
