"""Engine: the seq-scheduler as a service. One thread owns the model and steps while there is
work; any thread submits, aborts and stops (vLLM's EngineCoreProc around its EngineCore)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid

import torch
import torch.distributed as dist

from engine.config import EngineConfig
from engine.core.handle import JobHandle
from engine.core.step import EngineCore
from engine.distributed.tensor_parallel import Lockstep, RankGroup, join
from engine.errors import EngineStopped
from engine.model.loader import LoadedModel, load_model
from engine.request.job import new_job
from engine.request.sampling_params import SamplingParams, check_kv_budget, validate_job

log = logging.getLogger("seqgate.engine")

_STOP_JOIN_SECONDS = 30  # how long stop() waits for a step in progress


class Engine(EngineCore):
    """The engine thread and its admission: submit / abort / stop from any thread, `step()` on
    the engine thread only (or from the caller's, with `start(background=False)`)."""

    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None,
                 ranks: RankGroup | None = None):
        config = config or EngineConfig()
        # Tensor parallelism: rank 0 starts the other ranks before loading its share.
        if ranks is None and config.tensor_parallel_degree > 1:
            ranks = RankGroup.lead(config, _follow)
        self.ranks = ranks
        super().__init__(config, loaded or load_model(config), ranks)
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._running = False
        self.draining = False
        self._admit_lock = threading.Lock()
        self.lockstep = Lockstep(self, ranks) if ranks is not None else None

    def start(self, background: bool = True) -> None:
        """Start admitting jobs; with `background`, run the loop in the engine thread.

        Without it the caller drives the engine with `step()` (tests that control timing do).
        """
        if self._running:
            return
        if self.lockstep is not None and not background:
            raise RuntimeError("tensor parallelism needs the engine thread: start(background=True)")
        self._running = True
        if background:
            self._thread = threading.Thread(target=self._loop, name="seqgate-engine", daemon=True)
            self._thread.start()

    def stop(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop admitting; with `drain`, let running and queued jobs finish first (for up to
        `timeout` seconds). Jobs still unfinished then end with finish reason "abort" (the API
        answers 503 service_unavailable), never silently.

        Only the engine thread touches jobs: if a step is still running when the join gives up,
        the loop ends the remaining jobs itself when that step returns.
        """
        with self._admit_lock:
            self.draining = True
        if drain and self._thread is not None:  # only the engine thread can drain the work
            deadline = None if timeout is None else time.monotonic() + timeout
            while self.scheduler.has_work and (deadline is None or time.monotonic() < deadline):
                time.sleep(0.02)
        self._running = False
        self._wake.set()
        thread = self._thread
        if thread is not None:
            thread.join(timeout=_STOP_JOIN_SECONDS)
            if thread.is_alive():
                log.warning("an engine step is still running after %ss; it ends the remaining "
                            "jobs when it returns", _STOP_JOIN_SECONDS)
                return
            self._thread = None
        self.end_remaining()

    def submit(self, prompt_ids: list[int], params: SamplingParams,
               job_id: str | None = None) -> JobHandle:
        """Queue a job; its output arrives on the returned handle. Raises QueueFull, InvalidParams,
        ContextLengthExceeded, KvBudgetExceeded or EngineStopped."""
        strategy = validate_job(prompt_ids, params, self.config, self.runner.vocab_size,
                                self.max_model_len)
        check_kv_budget(len(prompt_ids), params, strategy, self.kv_budget)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        handle = JobHandle(job_id or f"job-{uuid.uuid4().hex}", loop)
        job = new_job(handle.job_id, prompt_ids, params, strategy, handle.put)
        with self._admit_lock:  # stop() cannot slip between this check and the push
            if self.draining or not self._running:
                raise EngineStopped("the engine is not accepting new jobs (draining or stopped)")
            if self.lockstep is not None:  # every rank queues it at the next iteration
                self.lockstep.submit(job)
            else:
                self.scheduler.submit(job)
        self._wake.set()
        return handle

    def abort(self, job_id: str) -> None:
        """Cancel a job; its slot is free at the next step and its stream ends with 'abort'."""
        if self.lockstep is not None:
            self.lockstep.abort(job_id)
        else:
            self.scheduler.request_abort(job_id)
        self._wake.set()

    @property
    def alive(self) -> bool:
        """The engine thread is running (a replica's health check asks)."""
        return self._thread is not None and self._thread.is_alive()

    def _loop(self) -> None:
        torch.set_num_threads(self.config.threads)
        checked = True  # the idle check ran since the last step
        while self._running:
            try:
                if self.lockstep is not None:  # every rank takes the same jobs and aborts
                    self.lockstep.lead()
                if not self.scheduler.has_work:
                    if not checked:
                        self.check_when_idle()
                        checked = True
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                self.step()
                checked = False
            except Exception:  # a bug in the step must not kill the server: fail what ran
                if self.lockstep is not None:  # ranks out of step cannot be brought back
                    log.exception("tensor-parallel engine failed; it stops (new jobs refused)")
                    self.fail_all("internal engine error (tensor-parallel ranks out of step)")
                    with self._admit_lock:
                        self.draining = True
                    break
                log.exception("engine step failed; failing the running jobs")
                self.fail_all("internal engine error")
        self.end_remaining()  # stopped: whatever is left ends here, on this thread
        if self.lockstep is not None:
            self.lockstep.stop()

    def follow(self) -> None:
        """A rank other than 0: run rank 0's iterations until it stops."""
        torch.set_num_threads(self.config.threads)
        self.lockstep.follow()


def _follow(rank: int, world: int, port: int, config: EngineConfig) -> None:
    """A tensor-parallel rank other than 0, in its own process: load this rank's share of the
    model, then run rank 0's steps."""
    logging.basicConfig(level=logging.INFO)
    join(rank, world, port, config)
    engine = Engine(config, ranks=RankGroup(rank, world))
    try:
        engine.follow()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
