"""TokenDecoder: turns a sub-batch's logits into each row's next token and applies stop rules.

Rows of one sub-batch may use different strategies (greedy, sample, contrastive); each group is
handled with batched tensor code, and a row whose choice raises fails alone. A contrastive row
chooses in two halves: `choose` proposes its candidates from the logits, and `pick` chooses among
them once the next step's forward has fed them.
"""

from __future__ import annotations

import logging

import torch

from engine.kv.batch import SubBatch
from engine.model.runner import GroupResult
from engine.outputs import TokenLogprob
from engine.request.job import Candidates, SeqStatus, Sequence
from engine.request.sampling_params import CONTRASTIVE_DEFAULT_K
from engine.sample.contrastive import contrastive_scores
from engine.sample.grammar import GrammarMasks
from engine.sample.sampling import (
    apply_logit_bias,
    apply_penalties,
    block_stop_tokens,
    greedy_tokens,
    logprobs_for,
    sample_rows,
)
from engine.sample.speculative import Speculator, sampled_choices, verify
from engine.sched.stops import at_length, token_stop
from engine.staging import to_device

log = logging.getLogger("seqgate.engine")


def fail(s: Sequence, message: str, cause: str | None = None) -> None:
    """Finish a sequence with an error (no-op when it already finished); `cause` as
    JobDelta.error_cause."""
    if not s.status.finished:
        s.status = SeqStatus.ERROR
        s.error, s.error_cause = message, cause


class TokenDecoder:
    """Owns the token choice: penalties, strategies, logprobs, and the stop conditions."""

    def __init__(self, vocab_size: int, device: torch.device, eos_ids: list[int],
                 max_model_len: int, speculator: Speculator | None = None):
        self.vocab_size = vocab_size
        self.speculator = speculator  # told what verification kept
        self.eos_ids = eos_ids
        self.max_model_len = max_model_len
        self.generator = torch.Generator(device=device)  # draws for unseeded jobs
        self.generator.seed()
        self.generated_tokens = 0
        self.grammar = GrammarMasks(vocab_size)

    def choose(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        """Pick each row's next token (contrastive rows: propose their candidates); a row whose
        choice raises fails alone."""
        try:
            tokens, lps = self._choose_rows(seqs, logits)
        except Exception:
            # A bug, not a row's fault: say so loudly, then isolate the row that raises.
            log.exception("batched token choice failed; choosing row by row")
            tokens, lps = [], []
            for i, s in enumerate(seqs):
                try:
                    t, lp = self._choose_rows([s], logits[i : i + 1])
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

    def advance(self, groups: list[tuple[SubBatch, GroupResult]]) -> None:
        """After the step's forward, for each sub-batch and its result (logits and hidden states
        of its fed tokens, each row's first at `first`, also on the host): contrastive rows
        choose among the candidates they fed and keep that one's K/V, hidden state and logits;
        then every row still running, in every sub-batch, chooses (or proposes) its next token
        in one `choose`: one transfer of the step's tokens to the host."""
        seqs, rows = [], []
        for sb, result in groups:
            if result.drafts is not None:
                self._verify(sb, result)
                continue
            slots = self.pick(sb.seqs, result.hidden, result.first)
            sb.commit(slots)
            kept = [f + s for f, s in zip(result.first_host, slots)]
            if result.hidden is not None:
                for s, at in zip(sb.seqs, kept):
                    if s.hidden is not None:
                        s.hidden = torch.cat([s.hidden, result.hidden[at : at + 1]])
            live = [i for i, s in enumerate(sb.seqs) if not s.status.finished]
            seqs += [sb.seqs[i] for i in live]
            # Every row fed one token and runs on (the usual step): its logits as they are,
            # not a copy of [rows, vocab].
            picked = [kept[i] for i in live]
            logits = result.logits
            rows.append(logits if picked == list(range(len(logits))) else logits[picked])
        if seqs:
            self.choose(seqs, rows[0] if len(rows) == 1 else torch.cat(rows))

    def _verify(self, sb: SubBatch, result: GroupResult) -> None:
        """A speculative sub-batch (engine.sample.speculative): each row's choice after each
        token it fed (greedy rows' argmax; sampled rows' by rejection sampling); the drafted
        tokens every row agreed with are kept, in the slab and in the output, then each row's
        own next choice."""
        drafts, firsts = result.drafts, result.first_host
        chosen = greedy_tokens(result.logits).tolist()
        choices = [chosen[f : f + 1 + len(d)] for f, d in zip(firsts, drafts)]
        drawn = [i for i, s in enumerate(sb.seqs) if s.job.strategy == "sample"]
        if drawn:
            try:
                got = sampled_choices(result.logits, [firsts[i] for i in drawn],
                                      [drafts[i] for i in drawn], [sb.seqs[i] for i in drawn],
                                      self.generator)
            except Exception:
                # As in `choose`: a bug, said loudly; then the row that raises fails alone.
                log.exception("rejection sampling failed; verifying row by row")
                got = [self._sampled_alone(sb.seqs[i], result.logits, firsts[i], drafts[i])
                       for i in drawn]
            for i, row in zip(drawn, got):
                choices[i] = row
        outcome = verify(drafts, choices)
        sb.commit([0] * sb.size)
        sb.keep_drafted(outcome.kept)
        if self.speculator is not None:
            self.speculator.record(drafts, outcome.kept)
        for s, tokens in zip(sb.seqs, outcome.tokens):
            s.draft = []
            for tok in tokens:
                if s.status.finished:
                    break
                self.accept(s, tok, None)

    def _sampled_alone(self, s: Sequence, logits: torch.Tensor, first: int,
                       draft: list[int]) -> list[int]:
        """One sampled row's verification; where it raises, the row fails (its choice then
        keeps none of the draft, and nothing is accepted for a finished row)."""
        try:
            return sampled_choices(logits, [first], [draft], [s], self.generator)[0]
        except Exception as exc:
            log.exception("rejection sampling failed for %s", s.job.job_id)
            fail(s, f"sampling failed: {exc}")
            return [-1]

    def _choose_rows(self, seqs: list[Sequence], logits: torch.Tensor):
        logits = apply_penalties(logits, seqs, self.vocab_size)
        logits = apply_logit_bias(logits, seqs)
        scored = block_stop_tokens(logits, seqs, self.eos_ids)  # what logprobs report
        logits = self._constrain(logits, scored, seqs)
        tokens: list[int | None] = [None] * len(seqs)
        strategies = [s.job.strategy for s in seqs]
        greedy = [i for i, st in enumerate(strategies) if st == "greedy"]
        if greedy:
            picks = greedy_tokens(_take(logits, greedy)).tolist()
            for i, t in zip(greedy, picks):
                tokens[i] = t
        sample = [i for i, st in enumerate(strategies) if st == "sample"]
        if sample:
            picks = sample_rows(_take(logits, sample), [seqs[i] for i in sample], self.generator)
            for i, t in zip(sample, picks):
                tokens[i] = t
        contrastive = [i for i, st in enumerate(strategies) if st == "contrastive"]
        if contrastive:
            self._propose([seqs[i] for i in contrastive], logits[contrastive],
                          scored[contrastive])
        lps: list = [None] * len(seqs)
        want = [i for i, s in enumerate(seqs) if s.params.logprobs and tokens[i] is not None]
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

    def _propose(self, seqs: list[Sequence], logits: torch.Tensor, scored: torch.Tensor) -> None:
        """Each contrastive row's candidates: its top-k tokens among the allowed ones (a grammar
        or a bias may forbid most of them)."""
        top_k = to_device([s.params.top_k or CONTRASTIVE_DEFAULT_K for s in seqs], logits.device)
        ks = torch.minimum(top_k, torch.isfinite(logits).sum(dim=-1)).tolist()
        if 0 in ks:
            raise ValueError("contrastive search found no allowed token")
        top = logits.softmax(dim=-1).topk(max(ks))
        ids = top.indices.tolist()
        for i, (s, k) in enumerate(zip(seqs, ks)):
            s.candidates = Candidates(ids[i][:k], top.values[i, :k],
                                      scored[i] if s.params.logprobs else None)

    def pick(self, seqs: list[Sequence], hidden: torch.Tensor | None,
             first: torch.Tensor) -> list[int]:
        """Choose each contrastive row's token among the candidates it fed this step, from their
        last-layer states `hidden` (the rows' fed tokens, row by row from `first`), and accept
        it. Returns, per row, which of its fed tokens it keeps (0 for rows that fed one)."""
        slots = [0] * len(seqs)
        rows = [i for i, s in enumerate(seqs) if s.candidates is not None]
        if not rows:
            return slots
        try:
            picked = self._pick_rows([seqs[i] for i in rows], hidden, first[rows])
        except Exception:
            log.exception("batched contrastive choice failed; choosing row by row")
            picked = []
            for i in rows:
                try:
                    picked += self._pick_rows([seqs[i]], hidden, first[i : i + 1])
                except Exception as exc:
                    log.exception("contrastive choice failed for %s", seqs[i].job.job_id)
                    fail(seqs[i], f"contrastive choice failed: {exc}")
                    picked.append(None)
        for i, got in zip(rows, picked):
            s, cand = seqs[i], seqs[i].candidates
            s.candidates = None
            if got is not None and not s.status.finished:
                slots[i] = got[0]
                self.accept(s, cand.ids[got[0]], got[1])
        return slots

    def _pick_rows(self, seqs: list[Sequence], hidden: torch.Tensor, first: torch.Tensor
                   ) -> list[tuple[int, TokenLogprob | None]]:
        cands = [s.candidates for s in seqs]
        device = hidden.device
        counts = to_device([len(c.ids) for c in cands], device)
        slot = torch.arange(int(counts.max()), device=device)[None, :]
        at = first.to(device)[:, None] + torch.minimum(slot, counts[:, None] - 1)
        probs = torch.nn.utils.rnn.pad_sequence([c.probs for c in cands], batch_first=True)
        alpha = to_device([s.params.penalty_alpha for s in seqs], device, torch.float32)
        scores = contrastive_scores(probs, hidden[at], [s.hidden for s in seqs], alpha)
        slots = scores.masked_fill_(slot >= counts[:, None], float("-inf")).argmax(dim=-1).tolist()
        lps: list[TokenLogprob | None] = [None] * len(seqs)
        want = [i for i, c in enumerate(cands) if c.scored is not None]
        if want:
            got = logprobs_for(torch.stack([cands[i].scored for i in want]),
                               [cands[i].ids[slots[i]] for i in want],
                               [seqs[i].params.top_logprobs for i in want])
            for i, lp in zip(want, got):
                lps[i] = lp
        return list(zip(slots, lps))

    def accept(self, s: Sequence, tok: int, lp) -> None:
        """Record a chosen token and apply the stop conditions: by id (engine.sched.stops),
        then by text (the detokenizer and the stop strings)."""
        s.generated.append(tok)
        s.out_tokens.append(tok)
        s.pending_token = tok
        self.generated_tokens += 1
        if lp is not None:
            s.out_logprobs.append(lp)
        if s.counts is not None:
            s.counts[tok] += 1
        if s.matcher is not None and not s.matcher.consume_token(tok):
            # The grammar's own token mask allowed `tok`: what it asks for cannot be written
            # with this tokenizer (llguidance masks a byte sequence that no token starts
            # with, e.g. a character in an unassigned plane, as if its lead byte were
            # already written).
            fail(s, f"the output left its grammar: {s.matcher.get_error()}", "grammar")
        elif (stop := token_stop(s, tok, self.eos_ids)) is not None:
            s.status = stop
        else:
            text, stopped = s.stops.feed(s.detok.push(tok))
            s.out_text.append(text)
            if stopped:
                s.status = SeqStatus.STOP_STRING
            elif s.matcher is not None and s.matcher.is_stopped():
                s.status = SeqStatus.GRAMMAR  # the grammar is complete: nothing may follow
        if not s.status.finished and at_length(s, self.max_model_len):
            s.status = SeqStatus.LENGTH
        if s.status.finished and s.status not in (SeqStatus.STOP_STRING, SeqStatus.ERROR):
            # Text held back for an incomplete character or a partial stop match goes out now.
            text, stopped = s.stops.feed(s.detok.flush())
            s.out_text.append(text if stopped else text + s.stops.flush())


def _take(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """`logits[rows]`, the index sent through staging (a host list would be copied waiting)."""
    return logits if len(rows) == logits.shape[0] else logits[to_device(rows, logits.device)]
