"""TokenDecoder: turns a sub-batch's logits into each row's next token and applies stop rules.

Rows of one sub-batch may use different strategies (greedy, sample, contrastive); each group is
handled with batched tensor code, and a row whose choice raises fails alone.
"""

from __future__ import annotations

import logging

import torch

from engine.batch import row_from_cache
from engine.contrastive import contrastive_choice
from engine.grammar import GrammarMasks
from engine.job import SeqStatus, Sequence
from engine.runner import ModelRunner
from engine.sampling import (
    apply_logit_bias,
    apply_penalties,
    block_stop_tokens,
    logprobs_for,
    sample_rows,
)

log = logging.getLogger("seqgate.engine")


def fail(s: Sequence, message: str) -> None:
    """Finish a sequence with an error (no-op when it already finished)."""
    if not s.status.finished:
        s.status = SeqStatus.ERROR
        s.error = message


class TokenDecoder:
    """Owns the token choice: penalties, strategies, logprobs, and the stop conditions."""

    def __init__(self, runner: ModelRunner, eos_ids: list[int], max_model_len: int):
        self.runner = runner
        self.eos_ids = eos_ids
        self.max_model_len = max_model_len
        self.generator = torch.Generator(device=runner.device)  # draws for unseeded jobs
        self.generator.seed()
        self.generated_tokens = 0
        self.grammar = GrammarMasks(runner.vocab_size)

    def choose(self, seqs: list[Sequence], logits: torch.Tensor, sources: list) -> None:
        """Pick each row's next token; a row whose choice raises fails alone."""
        try:
            tokens, lps = self._choose_rows(seqs, logits, sources)
        except Exception:
            # A bug, not a row's fault: say so loudly, then isolate the row that raises.
            log.exception("batched token choice failed; choosing row by row")
            tokens, lps = [], []
            for i, s in enumerate(seqs):
                try:
                    t, lp = self._choose_rows([s], logits[i : i + 1], [sources[i]])
                    tokens.append(t[0])
                    lps.append(lp[0])
                except Exception as exc:
                    log.exception("token choice failed for %s", s.job.job_id)
                    fail(s, f"sampling failed: {exc}")
                    tokens.append(None)
                    lps.append(None)
        for s, tok, lp in zip(seqs, tokens, lps):
            if tok is not None and not s.status.finished:
                self.accept(s, tok, lp)

    def _choose_rows(self, seqs: list[Sequence], logits: torch.Tensor, sources: list):
        logits = apply_penalties(logits, seqs, self.runner.vocab_size)
        logits = apply_logit_bias(logits, seqs)
        scored = block_stop_tokens(logits, seqs, self.eos_ids)  # what logprobs report
        logits = self._constrain(logits, scored, seqs)
        tokens: list[int] = [0] * len(seqs)
        strategies = [s.job.strategy for s in seqs]
        greedy = [i for i, st in enumerate(strategies) if st == "greedy"]
        if greedy:
            picks = logits[greedy].argmax(dim=-1).tolist()
            for i, t in zip(greedy, picks):
                tokens[i] = t
        sample = [i for i, st in enumerate(strategies) if st == "sample"]
        if sample:
            picks = sample_rows(logits[sample], [seqs[i] for i in sample], self.generator)
            for i, t in zip(sample, picks):
                tokens[i] = t
        for i, st in enumerate(strategies):
            if st == "contrastive":
                tokens[i] = self._contrastive(seqs[i], logits[i], sources[i])
        lps: list = [None] * len(seqs)
        want = [i for i, s in enumerate(seqs) if s.params.logprobs]
        if want:
            got = logprobs_for(
                scored[want], [tokens[i] for i in want], [seqs[i].params.top_logprobs for i in want]
            )
            for i, lp in zip(want, got):
                lps[i] = lp
        return tokens, lps

    def _constrain(self, logits: torch.Tensor, blocked: torch.Tensor,
                   seqs: list[Sequence]) -> torch.Tensor:
        """Apply the rows' grammars. A grammar that allows only what `min_tokens` blocks (its
        output is complete) wins: that row is masked from the unblocked logits."""
        matchers = [s.matcher for s in seqs]
        masked = self.grammar.apply(blocked, matchers)
        if masked is blocked or blocked is logits:
            return masked
        dead = torch.isneginf(masked).all(dim=-1)
        if dead.any():
            masked[dead] = self.grammar.apply(logits, matchers)[dead]
        return masked

    def _contrastive(self, s: Sequence, logits: torch.Tensor, source) -> int:
        p = s.params
        # Candidates are allowed tokens only (a grammar or a bias may forbid most of them).
        k = min(p.top_k or 4, int(torch.isfinite(logits).sum()))
        probs = logits.softmax(dim=-1)
        top = probs.topk(k)
        if hasattr(source, "row"):  # a sub-batch: this row's KV after the step's forward
            row = source.row(source.seqs.index(s))
        else:  # a prefill cache
            row = row_from_cache(source)
        cand_hidden = self.runner.lookahead(row, top.indices.tolist())
        return contrastive_choice(top.values, top.indices, cand_hidden, s.hidden, p.penalty_alpha)

    def accept(self, s: Sequence, tok: int, lp) -> None:
        """Record a chosen token and apply the stop conditions."""
        p = s.params
        s.generated.append(tok)
        s.out_tokens.append(tok)
        s.pending_token = tok
        self.generated_tokens += 1
        if lp is not None:
            s.out_logprobs.append(lp)
        if s.counts is not None:
            s.counts[tok] += 1
        if s.matcher is not None and not s.matcher.consume_token(tok):
            fail(s, f"the output left its grammar: {s.matcher.get_error()}")
        elif tok in self.eos_ids and not p.ignore_eos:
            s.status = SeqStatus.EOS
        elif tok in p.stop_token_ids:
            s.status = SeqStatus.STOP_TOKEN
        else:
            text, stopped = s.stops.feed(s.detok.push(tok))
            s.out_text.append(text)
            if stopped:
                s.status = SeqStatus.STOP_STRING
            elif s.matcher is not None and s.matcher.is_stopped():
                s.status = SeqStatus.GRAMMAR  # the grammar is complete: nothing may follow
        if not s.status.finished and (
            len(s.generated) >= p.max_new_tokens or s.kv_len + 1 >= self.max_model_len
        ):
            s.status = SeqStatus.LENGTH
        if s.status.finished and s.status not in (SeqStatus.STOP_STRING, SeqStatus.ERROR):
            # Text held back for an incomplete character or a partial stop match goes out now.
            text, stopped = s.stops.feed(s.detok.flush())
            s.out_text.append(text if stopped else text + s.stops.flush())
