"""The bounded queue of jobs waiting for a slot in the rolling batch."""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import TYPE_CHECKING

from engine.errors import QueueFull

if TYPE_CHECKING:
    from engine.request.job import Job



class JobQueue:
    """Waiting jobs in arrival order, bounded at `limit`; safe to push from any thread.

    `peek` names the job to admit next: the oldest (policy "fifo"), or the one with the lowest
    `priority` or the shortest prompt (ties: the oldest), except that a job waiting `age_limit`
    seconds or more goes first: no job starves behind a stream of preferred ones. A preempted job
    (`requeue`) goes first too.
    """

    def __init__(self, limit: int, policy: str = "fifo", age_limit: float = 10.0):
        self.limit = limit
        self.policy, self.age_limit = policy, age_limit
        self._jobs: deque[Job] = deque()
        self._lock = threading.Lock()

    def push(self, job: Job, free_slots: int) -> None:
        """Queue `job`, or raise QueueFull. Jobs that fit in free batch slots never count as
        queued.
        """
        with self._lock:
            # Jobs that free slots will take at the next step are not waiting.
            if len(self._jobs) >= self.limit + max(free_slots, 0):
                raise QueueFull(self.limit)
            self._jobs.append(job)

    def requeue(self, job: Job) -> None:
        """Put a preempted job first, whatever the limit: it was admitted once and must not
        be dropped."""
        with self._lock:
            self._jobs.appendleft(job)

    def peek(self) -> Job | None:
        with self._lock:
            if not self._jobs:
                return None
            oldest = self._jobs[0]
            if self.policy == "fifo" or oldest.preemptions or \
                    time.monotonic() - oldest.arrival >= self.age_limit:
                return oldest
            if self.policy == "priority":
                return min(self._jobs, key=lambda j: j.params.priority)
            return min(self._jobs, key=lambda j: len(j.prompt_ids))

    def pop(self) -> Job:
        with self._lock:
            return self._jobs.popleft()

    def remove(self, job: Job) -> bool:
        with self._lock:
            try:
                self._jobs.remove(job)
                return True
            except ValueError:
                return False

    def take(self, job_id: str) -> Job | None:
        """Remove and return the waiting job with this id; None if none waits."""
        with self._lock:
            job = next((j for j in self._jobs if j.job_id == job_id), None)
            if job is not None:
                self._jobs.remove(job)
            return job

    def __len__(self) -> int:
        return len(self._jobs)
