"""The engine's figures: each step's StepStats, handed to the listeners (the server's metrics),
and the running totals that `EngineCore.stats()` completes and reports."""

from __future__ import annotations

import logging
from collections.abc import Callable

from engine.kv.rolling_batch import RollingBatch
from engine.outputs import EngineStats, StepStats
from engine.sched.plan import StepPlan
from engine.sched.scheduler import Scheduler

log = logging.getLogger("seqgate.engine")


class StepRecorder:
    """Turns each step into its StepStats, keeps the totals, tells the listeners."""

    def __init__(self) -> None:
        self.totals = EngineStats()
        self.listeners: list[Callable[[StepStats], None]] = []

    def record(self, plan: StepPlan, batch: RollingBatch, scheduler: Scheduler,
               seconds: float) -> StepStats:
        sbs = batch.sub_batches
        real = sum(sum(sb.lengths()) for sb in sbs)
        padded = batch.padded_tokens()
        stats = StepStats(
            step=plan.step,
            running=scheduler.slots_taken(),
            queued=len(scheduler.queue),
            admitted=len(plan.admitted),
            finished=sum(1 for sb in sbs for s in sb.seqs if s.status.finished),
            sub_batches=len(sbs),
            sub_batch_sizes=[sb.size for sb in sbs],
            sparsity=padded / real if real else 0.0,
            padded_tokens=padded,
            kv_bytes=batch.kv_bytes(),
            regrouped=plan.groups is not None,
            decode_rows=plan.decode_rows,
            prefill_tokens=plan.prefill_tokens,
            prefill_chunks=len(plan.chunks),
            cached_prompt_tokens=sum(j.cached_tokens for j in plan.admitted),
            seconds=seconds,
            abort_free_steps=plan.abort_delays,
        )
        totals = self.totals
        totals.steps = plan.step
        totals.last_step = stats
        totals.kv_bytes = stats.kv_bytes
        totals.peak_kv_bytes = max(totals.peak_kv_bytes, stats.kv_bytes)
        for fn in self.listeners:
            try:
                fn(stats)
            except Exception:
                log.exception("step listener failed")
        return stats
