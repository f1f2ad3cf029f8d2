"""Out of memory, survived: which jobs a failed step gives back (recompute preemption, as vLLM
does), and the admission cap that holds for a while after it.

The step undoes its failed work (engine.kv.slabs.rewind) and asks `victims` which jobs go back
to the queue (`Scheduler.preempt`) and which, if any, must fail; `MemoryPressure` then keeps
admission at the rows left, a row more every EASE_STEPS steps without another failure.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from engine.request.job import Job, Sequence

# Steps without an out-of-memory failure after which the admission cap grows by a row.
EASE_STEPS = 16


class Victims(NamedTuple):
    """What a failed step gives back: jobs to recompute, jobs to fail, and whether the prefix
    cache is to be cleared first (the caller clears it: choosing frees nothing itself)."""

    preempt: list[Job]
    fail: list[Job]
    clear_cache: bool = False


def victims(jobs: list[Job], lost: list[Job], cache_bytes: int = 0) -> Victims:
    """Which of the admitted `jobs` (most recently admitted first) a failed step gives back.
    The jobs whose rows a failed layout lost must be recomputed; else the newest job that can
    be (`Job.recomputable`) gives its memory back. A job alone in the engine cannot fit at all,
    and where no job can be recomputed the newest fails; but where the prefix cache holds
    `cache_bytes`, that KV may be what the job lacks: the cache is to be cleared and the job
    recomputed once more."""
    if lost:
        return Victims(lost, [])
    if len(jobs) <= 1:
        preempt, fail = [], jobs
    else:
        newest = next((job for job in jobs if job.recomputable), None)
        preempt, fail = ([newest], []) if newest is not None else ([], jobs[:1])
    if fail and cache_bytes:
        return Victims([job for job in fail if job.recomputable],
                       [job for job in fail if not job.recomputable], clear_cache=True)
    return Victims(preempt, fail)


def lost_rows(joined: list[Job], held: Iterable[Sequence]) -> list[Job]:
    """Jobs that joined the decode set this step but whose running rows are not `held` by any
    sub-batch (the layout that was to take them failed after their prompt's KV was handed
    over)."""
    held = set(held)
    return [job for job in joined
            if any(s not in held for s in job.seqs if not s.status.finished)]


class MemoryPressure:
    """The admission cap after an out-of-memory step: the rows then taken, eased a row at a
    time while steps succeed; None: no cap."""

    def __init__(self, batch_rows: int):
        self.batch_rows = batch_rows
        self.cap: int | None = None
        self._calm = 0

    def admits(self, rows: int, taken: int) -> bool:
        """Whether `rows` rows in all may run; a job may always run alone."""
        return self.cap is None or rows <= self.cap or not taken

    def failed(self, taken: int) -> None:
        self.cap, self._calm = max(1, taken), 0

    def step_done(self) -> None:
        if self.cap is None:
            return
        self._calm += 1
        if self._calm >= EASE_STEPS:
            self._calm = 0
            self.cap = None if self.cap + 1 >= self.batch_rows else self.cap + 1
