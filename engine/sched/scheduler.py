"""Scheduler: decides what each step computes, before any forward call.

Every step runs the decode token of every running row, never skipped, plus prefill chunks of
waiting prompts in the rest of a token budget (`max_num_batched_tokens`): Sarathi-Serve's
stall-free batching. A long prompt is prefilled over several steps, a chunk per step, while the
running streams keep producing a token each step; it joins the decode set the step after its last
chunk. While rows decode, a step's prompt work is also capped, unless `stall_ratio` is 0, by
what keeps it within that many times a decode-only step, from step costs learnt as the engine
runs (`engine.sched.step_cost`): a decode row costs several prompt tokens on a CPU, so a token
budget alone either stalls a large batch or starves prompts beside a small one. Jobs are admitted in
FIFO order while batch slots last and, under a KV budget, while the KV they may come to hold fits
it (`KvBudget.admits`); a new job's prompt starts from the longest prefix the prefix cache holds.

The plan (`engine.sched.plan.StepPlan`) carries everything the step does; tests assert on plans
without a model.
"""

from __future__ import annotations

import bisect
import threading

from engine.config import EngineConfig
from engine.kv.budget import KvBudget
from engine.kv.radix_cache import RadixPrefixCache
from engine.request.job import Job, SeqStatus, Sequence
from engine.sched.partition import partition_by_sparsity, sparsity
from engine.sched.plan import PrefillChunk, StepPlan
from engine.sched.preemption import MemoryPressure
from engine.sched.queue import JobQueue
from engine.sched.step_cost import StepCost

# A step's budget when no row decodes (see `Scheduler.prefill_budget`).
ALONE_TOKENS = 2048


class Scheduler:
    """Owns the wait queue, the jobs being prefilled and the running (decoding) sequences."""

    def __init__(self, config: EngineConfig, prefix_cache: RadixPrefixCache | None = None,
                 attention_tokens: int = 1 << 30, cost: StepCost | None = None,
                 kv: KvBudget | None = None):
        self.config = config
        self.kv = kv  # None: rows are admitted by count alone
        # Learnt step costs that bound a step's prompt work while rows decode; None: the token
        # budget alone (as under tensor parallelism, where every rank must plan alike).
        self.cost = cost if config.stall_ratio else None
        self.prefix_cache = prefix_cache
        self.attention_tokens = attention_tokens
        self.queue = JobQueue(config.job_queue_size, config.scheduling_policy,
                              config.scheduling_age_limit)
        self.prefilling: list[Job] = []  # admitted, prompt not done (or done, joining next step)
        self.running: list[Sequence] = []
        self.layout: list[list[Sequence]] = []  # the decode rows' groups, as last planned
        self.step = 0
        self._abort_ids: dict[str, int] = {}  # job id -> the step during which it was asked
        self.pressure = MemoryPressure(config.batch_rows)  # admission after out of memory
        self._relayout = False  # rows left the batch outside a plan (preempted)
        self._abort_lock = threading.Lock()

    # -- called from any thread -------------------------------------------------------------
    def submit(self, job: Job) -> None:
        self.queue.push(job, self.free_slots())

    def request_abort(self, job_id: str) -> None:
        with self._abort_lock:
            self._abort_ids.setdefault(job_id, self.step)

    def free_slots(self) -> int:
        return self.config.batch_rows - self.slots_taken()

    def slots_taken(self) -> int:
        return len(self.running) + sum(len(j.seqs) for j in list(self.prefilling))

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.prefilling or len(self.queue) or self._abort_ids)

    # -- called from the engine thread ------------------------------------------------------
    def schedule(self) -> StepPlan:
        self.step += 1
        plan = StepPlan(self.step)
        self._take_aborts(plan)
        # Prompts whose every sequence ended (failed, or finished on its first token) are done.
        self.prefilling = [j for j in self.prefilling if not j.done]
        plan.evicted = [s for s in self.running if s.status.finished]
        self.running = [s for s in self.running if not s.status.finished]
        # Jobs whose last chunk ran in the previous step decode from this one.
        for job in [j for j in self.prefilling if j.computed == len(j.fill_ids)]:
            self.prefilling.remove(job)
            plan.joined.append(job)
            self.running.extend(s for s in job.seqs if not s.status.finished)
        # Evicted includes running rows aborted just now; preempted rows left since last step.
        if plan.evicted or plan.joined or self._relayout:
            self._relayout = False
            plan.groups = self._regroup(plan)
            self.layout = plan.groups
        plan.decode_rows = len(self.running)

        budget = self.prefill_budget(plan.decode_rows)
        for job in self.prefilling:  # prompts under way first, oldest first
            if plan.prefill_units >= budget:
                break
            plan.prefill_units += self._chunk(plan, job, budget - plan.prefill_units)
        while plan.prefill_units < budget and (job := self.queue.peek()) is not None:
            if not self._fits(job):
                break
            self.queue.remove(job)
            self._admit(job)
            plan.admitted.append(job)
            plan.prefill_units += self._chunk(plan, job, budget - plan.prefill_units)
        if self.kv is not None:
            prompts = sum(len(j.fill_ids) for j in self.prefilling)
            plan.kv_limit = self.kv.batch - prompts * self.kv.per_token
        plan.compact = self.pressure.cap is not None
        return plan

    def _fits(self, job: Job) -> bool:
        """Whether `job` fits beside the admitted jobs: its rows within max_rolling_batch_size
        and, under a KV budget, every admitted row charged the longest reservation among them
        (`KvBudget.admits`), which keeps the batch's slabs within the budget whatever the
        partition (engine.kv.rolling_batch)."""
        rows = self.slots_taken() + job.params.n
        if rows > self.config.batch_rows or not self.pressure.admits(rows, self.slots_taken()):
            return False
        if self.kv is None:
            return True
        admitted = [s.job for s in self.running] + self.prefilling
        longest = max((j.kv_reserved for j in admitted), default=0)
        return self.kv.admits(rows, max(longest, job.kv_reserved))

    def prefill_budget(self, decode_rows: int) -> int:
        """Budget units of prompt work a step with `decode_rows` decode rows takes on: what the
        token budget leaves, and, while rows decode, no more than keeps the step within
        `stall_ratio` times a decode-only step (`StepCost`). With no row decoding there is
        nothing to stall: prompts go in larger steps (fewer passes over the weights), bounded
        for the activations' memory."""
        if not decode_rows:
            return max(self.config.token_budget, ALONE_TOKENS)
        budget = self.config.token_budget - decode_rows
        cap = None if self.cost is None else \
            self.cost.prefill_cap(decode_rows, self.config.stall_ratio)
        return budget if cap is None else min(budget, cap)

    def _take_aborts(self, plan: StepPlan) -> None:
        with self._abort_lock:
            abort_ids, self._abort_ids = self._abort_ids, {}
        if not abort_ids:
            return
        jobs = {s.job.job_id: s.job for s in self.running}
        jobs.update((j.job_id, j) for j in self.prefilling)
        for job_id, asked_at in abort_ids.items():
            job = jobs.get(job_id)
            if job is None:
                job = self.queue.take(job_id)
                if job is None:
                    continue  # already finished, or never existed
            elif job in self.prefilling:
                self.prefilling.remove(job)
            for s in job.seqs:
                if not s.status.finished:
                    s.status = SeqStatus.ABORT
            plan.aborted.append(job)
            plan.abort_delays.append(self.step - asked_at - 1)

    def _admit(self, job: Job) -> None:
        """Start a job's prefill from the longest cached prefix of its prompt (at least one
        token is left to compute: its logits give the first new token)."""
        ids = job.fill_ids
        cache = self.prefix_cache
        # A prompt whose log-probabilities are asked is computed whole: the cache holds KV, not
        # the logits that score it.
        if cache is not None and cache.capacity_bytes and not job.scores_prompt:
            job.prefix = cache.match(ids, len(ids) - 1, need_hidden=job.strategy == "contrastive",
                                     min_tokens=self.config.prompt_cache_min_tokens)
        if job.prefix is not None:
            job.computed = job.prefix.length
            if job.resume_ids is None:  # a resumed job reports what its first admission found
                job.cached_tokens = job.prefix.length
        for s in job.seqs:
            if not s.status.finished:
                s.status = SeqStatus.RUNNING
        job.admitted_at = self.step
        self.prefilling.append(job)

    def chunk_cost(self, start: int, tokens: int) -> int:
        """Budget units of computing prompt positions [start, start + tokens): a token each for
        the linear layers, plus attention over the context, which grows with it (a query at
        position p attends to p + 1 keys; `attention_tokens` keys cost as much as one token)."""
        return tokens + tokens * (2 * start + tokens) // (2 * self.attention_tokens)

    def _chunk(self, plan: StepPlan, job: Job, budget: int) -> int:
        """Plan the longest chunk of `job`'s prompt that fits `budget`; returns its cost."""
        start, left = job.computed, len(job.fill_ids) - job.computed
        # The cost grows with the chunk's length: the longest that fits, and at least one token.
        fits = bisect.bisect_right(range(1, left + 1), budget,
                                   key=lambda n: self.chunk_cost(start, n))
        tokens = max(1, fits)
        plan.chunks.append(PrefillChunk(job, start, start + tokens))
        return self.chunk_cost(start, tokens)

    def abort_all(self) -> list[Job]:
        """End every queued, prefilling and running job with ABORT (shutdown); returns them."""
        jobs = {s.job.job_id: s.job for s in self.running}
        jobs.update((j.job_id, j) for j in self.prefilling)
        while len(self.queue):
            job = self.queue.pop()
            jobs[job.job_id] = job
        for job in jobs.values():
            for s in job.seqs:
                if not s.status.finished:
                    s.status = SeqStatus.ABORT
        self.running, self.prefilling, self.layout = [], [], []
        with self._abort_lock:
            self._abort_ids.clear()
        return list(jobs.values())

    def fail_all(self) -> list[Job]:
        """Take every prefilling and running job out of the schedule (a step failed in a way
        that leaves their state unknown); returns them for the caller to fail. Queued jobs
        stay queued."""
        jobs = {s.job.job_id: s.job for s in self.running}
        jobs.update((j.job_id, j) for j in self.prefilling)
        self.running, self.prefilling, self.layout = [], [], []
        return list(jobs.values())

    def update_from_step(self, plan: StepPlan, seconds: float, learn: bool = True) -> None:
        """Learn from a finished step: its cost, for the stall bound (steps that laid the batch
        out anew carry a cost of their own, copies of KV, that neither rows nor prompt units
        explain, so they are not counted, nor are steps the caller says were not typical:
        `learn` False); and ease an out-of-memory cap. A step that ran out of memory teaches
        nothing."""
        if plan.out_of_memory:
            return
        if self.cost is not None and plan.groups is None and learn:
            self.cost.observe(plan.decode_rows, plan.prefill_units, seconds)
        self.pressure.step_done()

    def jobs_by_age(self) -> list[Job]:
        """The prefilling and running jobs, most recently admitted first."""
        jobs = {s.job.job_id: s.job for s in self.running}
        jobs.update((j.job_id, j) for j in self.prefilling)
        return sorted(jobs.values(), key=lambda j: j.admitted_at, reverse=True)

    def preempt(self, job: Job) -> None:
        """Take `job` out of the schedule and put it first in the queue, to be prefilled
        again (`Job.preempt`); its rows leave the batch at the next step's layout."""
        if job in self.prefilling:
            self.prefilling.remove(job)
        before = len(self.running)
        self.running = [s for s in self.running if s.job is not job]
        self._relayout = self._relayout or len(self.running) != before
        job.preempt()
        self.queue.requeue(job)

    def out_of_memory(self) -> None:
        """A step ran out of memory: admission holds at the rows now taken, for a while."""
        self.pressure.failed(self.slots_taken())

    def _regroup(self, plan: StepPlan) -> list[list[Sequence]]:
        """The decode rows' sub-batches after rows left or joined.

        The current groups are kept, less the rows that left; each joining row goes to the group
        it pads least among those at least as long, or a group of its own while `max_splits`
        allows. Kept groups change in place (cheap: `RollingBatch.regroup`). When that layout's
        sparsity exceeds `max_sparsity`, or a row has no group, the rows are partitioned anew
        by max-sparsity thresholding.
        """
        live = set(self.running)
        groups = [[s for s in g if s in live] for g in self.layout]
        groups = [g for g in groups if g]
        joining = sorted((s for job in plan.joined for s in job.seqs if not s.status.finished),
                         key=lambda s: -s.kv_len)
        for s in joining:
            longest = [max(x.kv_len for x in g) for g in groups]
            fits = [i for i, n in enumerate(longest) if n >= s.kv_len]
            if fits:
                groups[min(fits, key=lambda i: longest[i])].append(s)
            elif len(groups) < self.config.splits:
                groups.append([s])
            else:
                return self.partition()
        index = {s: i for i, s in enumerate(self.running)}
        lengths = [s.kv_len for s in self.running]
        part_groups = tuple(tuple(index[s] for s in g) for g in groups)
        if sparsity(lengths, part_groups) > self.config.max_sparsity:
            return self.partition()
        return groups

    def partition(self) -> list[list[Sequence]]:
        """Partition the running rows by their KV length (max-sparsity thresholding)."""
        lengths = [s.kv_len for s in self.running]
        part = partition_by_sparsity(lengths, self.config.max_sparsity, self.config.splits)
        return [[self.running[i] for i in group] for group in part.groups]
