"""What one engine step does, decided by the scheduler before any forward call: aborts,
evictions, jobs joining the decode set, the partition of the decode rows into sub-batches, and
the prefill chunks."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.request.job import Job, Sequence


@dataclass
class PrefillChunk:
    """Prompt positions [start, stop) of `job`, computed this step."""

    job: Job
    start: int
    stop: int

    @property
    def tokens(self) -> int:
        return self.stop - self.start

    @property
    def last(self) -> bool:
        """The chunk completes the prompt: its last position's logits give the first token."""
        return self.stop == len(self.job.fill_ids)


@dataclass
class StepPlan:
    """What one step does, decided before any forward call."""

    step: int
    aborted: list[Job] = field(default_factory=list)  # jobs cancelled this step (any state)
    # For each aborted job: steps since its abort was requested (its slots are free this step).
    abort_delays: list[int] = field(default_factory=list)
    evicted: list[Sequence] = field(default_factory=list)  # finished rows leaving the batch
    admitted: list[Job] = field(default_factory=list)  # jobs whose prefill starts this step
    joined: list[Job] = field(default_factory=list)  # prefilled jobs whose rows decode from now
    # The decode rows as sub-batches, when membership changed; None keeps the current layout.
    groups: list[list[Sequence]] | None = None
    decode_rows: int = 0
    chunks: list[PrefillChunk] = field(default_factory=list)
    prefill_units: int = 0  # the chunks' cost in budget units (`Scheduler.chunk_cost`)
    # Bytes the batch's slabs may hold this step: the KV budget's less the prompts being
    # prefilled (their KV is outside the batch); None: no KV budget.
    kv_limit: int | None = None
    # After an allocation failure, slabs give back the rows and columns their rows cannot use
    # (rows that leave a slab keep their memory otherwise).
    compact: bool = False
    out_of_memory: bool = False  # set by the step: an allocation failure undid work in it

    @property
    def prefill_tokens(self) -> int:
        return sum(c.tokens for c in self.chunks)
