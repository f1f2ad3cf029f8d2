"""Scheduler: decides who runs. Admission, aborts, evictions, and the max-sparsity partition."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.job import Job, SeqStatus, Sequence
from engine.partition import Partition, partition_by_sparsity
from engine.queue import JobQueue


@dataclass
class StepPlan:
    """What one step will do, decided before any forward call; tests assert on it without a model.
    """

    step: int
    aborted: list[Job] = field(default_factory=list)  # jobs cancelled this step (queued or running)
    # For each aborted job: steps since its abort was requested (its slots are free this step).
    abort_delays: list[int] = field(default_factory=list)
    evicted: list[Sequence] = field(default_factory=list)  # finished rows leaving the batch
    admitted: list[Job] = field(default_factory=list)  # jobs to prefill and join the batch
    prefill_tokens: int = 0

    @property
    def membership_changed(self) -> bool:
        return bool(self.aborted or self.evicted or self.admitted)


class Scheduler:
    """Owns the wait queue and the set of running sequences; partitions them by sparsity."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.queue = JobQueue(config.job_queue_size)
        self.running: list[Sequence] = []
        self.step = 0
        self._abort_ids: dict[str, int] = {}  # job id -> the step during which it was asked
        self._abort_lock = threading.Lock()

    # -- called from any thread -------------------------------------------------------------
    def submit(self, job: Job) -> None:
        self.queue.push(job, self.free_slots())

    def request_abort(self, job_id: str) -> None:
        with self._abort_lock:
            self._abort_ids.setdefault(job_id, self.step)

    def free_slots(self) -> int:
        return self.config.max_rolling_batch_size - len(self.running)

    @property
    def has_work(self) -> bool:
        return bool(self.running) or len(self.queue) > 0 or bool(self._abort_ids)

    # -- called from the engine thread ------------------------------------------------------
    def schedule(self) -> StepPlan:
        self.step += 1
        plan = StepPlan(self.step)
        with self._abort_lock:
            abort_ids, self._abort_ids = self._abort_ids, {}
        running_jobs = {s.job.job_id: s.job for s in self.running}
        for job_id, asked_at in abort_ids.items():
            job = running_jobs.get(job_id)
            if job is None:
                job = next((j for j in list(self.queue._jobs) if j.job_id == job_id), None)
                if job is None or not self.queue.remove(job):
                    continue  # already finished, or never existed
            for s in job.seqs:
                if not s.status.finished:
                    s.status = SeqStatus.ABORT
            plan.aborted.append(job)
            plan.abort_delays.append(self.step - asked_at - 1)
        plan.evicted = [s for s in self.running if s.status.finished]
        self.running = [s for s in self.running if not s.status.finished]

        # Admit in FIFO order while slots last; bound the prompt tokens prefilled in one step so a
        # burst of long prompts does not stall the running batch for long (one job always goes).
        budget = max(self.config.prefill_chunk_tokens * 4, 1)
        while (job := self.queue.peek()) is not None:
            if len(self.running) + job.params.n > self.config.max_rolling_batch_size:
                break
            if plan.admitted and plan.prefill_tokens + len(job.prompt_ids) > budget:
                break
            self.queue.pop()
            plan.admitted.append(job)
            plan.prefill_tokens += len(job.prompt_ids)
            for s in job.seqs:
                s.status = SeqStatus.RUNNING
            self.running.extend(job.seqs)
        return plan

    def abort_all(self) -> list[Job]:
        """End every queued and running job with ABORT (shutdown); returns the jobs touched."""
        jobs = {s.job.job_id: s.job for s in self.running}
        while len(self.queue):
            job = self.queue.pop()
            jobs[job.job_id] = job
        for job in jobs.values():
            for s in job.seqs:
                if not s.status.finished:
                    s.status = SeqStatus.ABORT
        self.running = []
        with self._abort_lock:
            self._abort_ids.clear()
        return list(jobs.values())

    def drop_finished(self) -> list[Sequence]:
        """Remove rows that finished during prefill, before the batch is regrouped."""
        done = [s for s in self.running if s.status.finished]
        if done:
            self.running = [s for s in self.running if not s.status.finished]
        return done

    def partition(self) -> tuple[Partition, list[list[Sequence]]]:
        """Partition the running rows by their KV length (max-sparsity thresholding)."""
        lengths = [s.kv_len for s in self.running]
        part = partition_by_sparsity(lengths, self.config.max_sparsity, self.config.max_splits)
        return part, [[self.running[i] for i in group] for group in part.groups]
