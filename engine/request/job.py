"""A job (one request) and its sequences (one per `n`), with their decoding state."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from llguidance import LLMatcher

from engine.kv.radix_cache import PrefixEntry
from engine.outputs import JobDelta, TokenLogprob
from engine.request.detokenize import IncrementalDetokenizer
from engine.request.sampling_params import SamplingParams, row_kv_tokens
from engine.request.stops import StopMatcher


@dataclass
class Candidates:
    """The tokens proposed for a contrastive row's next position, fed together next step."""

    ids: list[int]  # the top-k allowed tokens, most probable first
    probs: torch.Tensor  # [k] their probabilities
    scored: torch.Tensor | None  # [vocab] the logits logprobs report, when the job asks for them


class SeqStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    # Finished states; `finish_reason` below maps them to OpenAI's finish reasons, in one table.
    EOS = 10
    STOP_TOKEN = 11
    STOP_STRING = 12
    LENGTH = 13
    ABORT = 14
    ERROR = 15
    GRAMMAR = 16  # the output completed its grammar

    @property
    def finished(self) -> bool:
        return self >= SeqStatus.EOS

    @property
    def finish_reason(self) -> str | None:
        return {
            SeqStatus.EOS: "stop",
            SeqStatus.STOP_TOKEN: "stop",
            SeqStatus.STOP_STRING: "stop",
            SeqStatus.GRAMMAR: "stop",
            SeqStatus.LENGTH: "length",
            SeqStatus.ABORT: "abort",
            SeqStatus.ERROR: "error",
        }.get(self)


@dataclass(eq=False)
class Sequence:
    """One generated continuation: its tokens, KV length, and per-sequence decoding state."""

    job: Job
    index: int  # 0..n-1 within the job
    generated: list[int] = field(default_factory=list)
    # Tokens in this row's KV: the prompt, then every generated token but the newest (contrastive
    # rows: every one; the step that chose a token wrote its KV).
    kv_len: int = 0
    # The newest sampled token, fed to the model at the next decode step (not contrastive rows).
    pending_token: int = -1
    # Contrastive search: the tokens proposed for the next position, fed together next step.
    candidates: Candidates | None = None
    # Speculative decoding: tokens proposed to follow the pending one, verified next step.
    draft: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    generator: torch.Generator | None = None
    detok: IncrementalDetokenizer | None = None
    stops: StopMatcher | None = None
    matcher: LLMatcher | None = None  # the grammar's state, when the job has one
    # Counts of generated tokens, for presence/frequency penalties, and the prompt's tokens as a
    # [vocab] mask, for the repetition penalty (both built on first use).
    counts: torch.Tensor | None = None
    prompt_seen: torch.Tensor | None = None
    # Last-layer hidden states of the context, for contrastive search: [tokens, hidden].
    hidden: torch.Tensor | None = None
    # Output not yet handed to the client.
    out_tokens: list[int] = field(default_factory=list)
    out_text: list[str] = field(default_factory=list)
    out_logprobs: list[TokenLogprob] = field(default_factory=list)
    error: str | None = None
    error_cause: str | None = None  # "grammar": the request's grammar could not be followed
    final_sent: bool = False  # the finishing delta went out
    prompt_logprobs_sent: bool = False

    @property
    def params(self) -> SamplingParams:
        return self.job.params

    @property
    def tokens_left(self) -> int:
        return self.params.max_new_tokens - len(self.generated)

    @property
    def kv_reserved(self) -> int:
        return self.job.kv_reserved

    @property
    def feeds(self) -> int:
        """Tokens it feeds at its next decode step: its candidates, or its pending token and
        its draft."""
        return len(self.candidates.ids) if self.candidates is not None else 1 + len(self.draft)

    def start(self, tokenizer, device: torch.device, hidden: torch.Tensor | None) -> None:
        """Set up decoding once the prompt is prefilled: detokenizer, stop matcher, the seeded
        generator, and the prompt's hidden states (contrastive search)."""
        job = self.job
        self.kv_len = len(job.prompt_ids)
        self.hidden = hidden
        self.detok = IncrementalDetokenizer(tokenizer, job.prompt_ids,
                                            job.params.skip_special_tokens)
        self.stops = StopMatcher(job.params.stop)
        if job.params.grammar is not None:
            self.matcher = job.params.grammar.matcher()
        if job.params.seed is not None:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(job.params.seed + self.index)

    def take_delta(self) -> JobDelta:
        finish = self.status.finish_reason if self.status.finished else None
        delta = JobDelta(
            job_id=self.job.job_id,
            index=self.index,
            token_ids=self.out_tokens,
            text="".join(self.out_text),
            finish_reason=finish,
            logprobs=self.out_logprobs if self.params.logprobs else None,
            prompt_tokens=len(self.job.prompt_ids),
            cached_tokens=self.job.cached_tokens,
            completion_tokens=len(self.generated),
            error=self.error,
            error_cause=self.error_cause,
        )
        if self.job.prompt_logprobs is not None and not self.prompt_logprobs_sent:
            delta.prompt_logprobs = [None, *self.job.prompt_logprobs]
            self.prompt_logprobs_sent = True
        self.out_tokens, self.out_text, self.out_logprobs = [], [], []
        return delta


@dataclass(eq=False)
class Job:
    """One request: its prompt, parameters and `n` sequences sharing one prefill."""

    job_id: str
    prompt_ids: list[int]
    params: SamplingParams
    strategy: str  # resolved: greedy | sample | contrastive
    emit: Callable[[JobDelta | None], None] = lambda d: None  # None = end of stream
    seqs: list[Sequence] = field(default_factory=list)
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    closed: bool = False
    arrival: float = field(default_factory=time.monotonic)
    # Prefill progress: prompt positions whose KV exists (the cached prefix, then each chunk).
    computed: int = 0
    prefix: PrefixEntry | None = None  # the cached prefix matched at admission, until used
    kv: Any = None  # the prompt's KV while it is prefilled: a batch-1 transformers Cache
    hidden: list[torch.Tensor] = field(default_factory=list)  # contrastive: prompt's hidden
    # After a preemption (recompute): the tokens its row's KV held, prompt and generated,
    # which its prefill computes again; None: the prompt alone.
    resume_ids: list[int] | None = None
    preemptions: int = 0
    admitted_at: int = 0  # the scheduler's step that last admitted it
    # The prompt's log-probabilities so far (from position 1), when asked: computed by its
    # prefill, which then reads no cached prefix.
    prompt_logprobs: list[TokenLogprob] | None = None

    @property
    def scores_prompt(self) -> bool:
        """Its prefill computes the prompt's log-probabilities (asked, and not yet done)."""
        return self.prompt_logprobs is not None and self.resume_ids is None

    @property
    def fill_ids(self) -> list[int]:
        """The tokens its prefill computes: the prompt, or what a preempted row held."""
        return self.prompt_ids if self.resume_ids is None else self.resume_ids

    @property
    def decoding(self) -> bool:
        """Its sequences were set up to decode (their prompt was done at least once)."""
        return any(s.detok is not None for s in self.seqs)

    def _contexts(self) -> set[tuple[int, ...]]:
        """The generated tokens in each running row's KV (after the prompt's)."""
        n = len(self.prompt_ids)
        return {tuple(s.generated[: s.kv_len - n]) for s in self.seqs
                if s.detok is not None and not s.status.finished}

    @property
    def recomputable(self) -> bool:
        """Whether `preempt` can put it back on the queue: its running rows hold one context
        (one sequence, or rows that have not yet fed a generated token), recomputed by one
        prefill."""
        return len(self._contexts()) <= 1

    def preempt(self) -> None:
        """Drop its KV so that it is prefilled again (recompute preemption): a decoding row
        resumes from its prompt and generated tokens with its decoding state (detokenizer,
        stops, grammar, generator, pending token) as it was, so no output is lost or repeated.
        """
        self.release_prompt()
        self.computed = 0
        self.preemptions += 1
        if self.decoding:
            (context,) = self._contexts() or {()}
            self.resume_ids = self.prompt_ids + list(context)
        else:
            for s in self.seqs:
                s.status = SeqStatus.WAITING
            if self.prompt_logprobs is not None:
                self.prompt_logprobs = []  # its prefill starts over

    @property
    def done(self) -> bool:
        return all(s.status.finished for s in self.seqs)

    @property
    def kv_reserved(self) -> int:
        """Tokens of KV each of its rows may come to hold (`row_kv_tokens`)."""
        return row_kv_tokens(len(self.prompt_ids), self.params, self.strategy)

    def release_prompt(self) -> None:
        """Drop what prefilling held: the prompt's KV (the batch or the prefix cache keep their
        own references), the matched prefix and the hidden states."""
        self.kv, self.prefix, self.hidden = None, None, []


def new_job(job_id: str, prompt_ids: list[int], params: SamplingParams, strategy: str,
            emit: Callable[[JobDelta | None], None]) -> Job:
    """A job with its `n` sequences, as the engine queues it (every rank alike, under tensor
    parallelism)."""
    job = Job(job_id=job_id, prompt_ids=list(prompt_ids), params=params, strategy=strategy,
              emit=emit)
    job.seqs = [Sequence(job, i) for i in range(params.n)]
    if params.prompt_logprobs is not None:
        job.prompt_logprobs = []
    return job
