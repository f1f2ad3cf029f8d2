"""Tensor parallelism: one engine over `tensor_parallel_degree` processes (ranks), each holding
its share of every layer through transformers' own tensor-parallel plan (`tp_plan="auto"`) over
`torch.distributed` (gloo on the CPU, NCCL on GPUs).

Every rank runs the same Engine, step for step: the model's collectives need each rank to call
the same forwards with the same shapes. Rank 0 takes the requests; what changes the scheduler's
state (a submitted job, an abort) is not applied where it arrives but logged, and at the top of
each engine iteration rank 0 broadcasts the log (`RankGroup.share`) and every rank applies it in
the same order. The rest follows deterministically: the same queue, the same plan, the same
logits (the output layer's are gathered on every rank), so the same tokens; sampled jobs get a
seed on rank 0 so that every rank draws alike. Rank 0 broadcasts an empty log while idle (its
heartbeat) and `STOP` when the engine stops.

Rank 0 starts the other ranks itself (`RankGroup.lead`, processes spawned from this one, each
running the entry point it is given); they follow rank 0 until `STOP`.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import multiprocessing as mp
import os
import random
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from engine.errors import QueueFull
from engine.model.loader import check_source, prefer_expandable_segments
from engine.outputs import JobDelta
from engine.request.job import Job, new_job

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.core.step import EngineCore

log = logging.getLogger("seqgate.engine.tp")

STOP = "stop"
# A rank waits this long for rank 0's next broadcast (rank 0 sends one at least every 0.5 s).
RANK_TIMEOUT = datetime.timedelta(minutes=30)


@dataclass(frozen=True)
class SubmitOp:
    """A job as every rank builds it (the grammar as its source: compiled matchers stay local)."""

    job_id: str
    prompt_ids: list[int]
    params: Any  # SamplingParams without its compiled grammar
    grammar: Any  # engine.sample.grammar.Grammar | None
    strategy: str


@dataclass(frozen=True)
class AbortOp:
    job_id: str


class RankGroup:
    """This process's place in a tensor-parallel engine: its rank, the world size, the
    processes rank 0 started."""

    def __init__(self, rank: int, world: int, followers: list | None = None):
        self.rank, self.world = rank, world
        self._followers = followers or []

    @classmethod
    def lead(cls, config: EngineConfig,
             follower: Callable[[int, int, int, EngineConfig], None]) -> RankGroup:
        """Rank 0: start ranks 1 … degree-1, each running `follower(rank, world, port, config)`
        in a process of its own, and join the process group with them."""
        check_source(config)  # before any process starts: a bad model fails fast, by name
        world = config.tensor_parallel_degree
        port = _free_port()
        ctx = mp.get_context("spawn")
        followers = [ctx.Process(target=follower, args=(rank, world, port, config),
                                 name=f"seqgate-tp-rank{rank}", daemon=True)
                     for rank in range(1, world)]
        for p in followers:
            p.start()
        join(0, world, port, config)
        log.info("tensor parallel: %d ranks (%s)", world, dist.get_backend())
        return cls(0, world, followers)

    def share(self, ops: list | str | None) -> list | str:
        """Rank 0 sends `ops`; every rank returns what rank 0 sent."""
        box = [ops if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def least(self, value: int) -> int:
        """The smallest of every rank's `value` (each rank calls it at the same point)."""
        values: list[Any] = [None] * self.world
        dist.all_gather_object(values, value)
        return min(values)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        for p in self._followers:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


class Lockstep:
    """Keeps an engine's ranks in step: rank 0 logs what would change the scheduler (a job, an
    abort) and every rank applies the log at the top of the same iteration."""

    def __init__(self, engine: EngineCore, ranks: RankGroup):
        self.engine = engine
        self.ranks = ranks
        self._pending: list[Job | AbortOp] = []
        self._lock = threading.Lock()

    # -- rank 0, any thread (under the engine's admission lock) ------------------------------
    def submit(self, job: Job) -> None:
        """Log a job; QueueFull now if the queue, with what is logged, is already full."""
        scheduler = self.engine.scheduler
        with self._lock:
            logged = sum(not isinstance(p, AbortOp) for p in self._pending)
            limit = scheduler.queue.limit
            if len(scheduler.queue) + logged >= limit + max(scheduler.free_slots(), 0):
                raise QueueFull(limit)
            if job.params.seed is None and job.strategy == "sample":  # every rank draws alike
                job.params = dataclasses.replace(job.params, seed=random.getrandbits(63))
            self._pending.append(job)

    def abort(self, job_id: str) -> None:
        with self._lock:
            self._pending.append(AbortOp(job_id))

    # -- the engine thread ---------------------------------------------------------------
    def lead(self) -> None:
        """Rank 0, each iteration: broadcast the log, then apply it here."""
        with self._lock:
            pending, self._pending = self._pending, []
        self.ranks.share([_wire(p) for p in pending])
        for item in pending:
            self._apply(item)

    def follow(self) -> None:
        """Other ranks: apply rank 0's log, step when there is work, until STOP."""
        engine = self.engine
        while (ops := self.ranks.share(None)) != STOP:
            for op in ops:
                self._apply(self._job_of(op) if isinstance(op, SubmitOp) else op)
            if engine.scheduler.has_work:
                engine.step()
        engine.end_remaining()

    def stop(self) -> None:
        """Rank 0, when its loop ends: the other ranks stop too."""
        try:
            self.ranks.share(STOP)
        except Exception:  # noqa: BLE001 - a rank is gone already; close what is left
            log.exception("could not tell the other ranks to stop")
        finally:
            self.ranks.close()

    def _apply(self, item: Job | AbortOp) -> None:
        if isinstance(item, AbortOp):
            self.engine.scheduler.request_abort(item.job_id)
            return
        try:
            self.engine.scheduler.submit(item)
        except QueueFull as exc:  # the same on every rank: the job is dropped everywhere
            for seq in item.seqs:
                item.emit(JobDelta(item.job_id, seq.index, [], "", finish_reason="error",
                                   error=str(exc)))
            item.emit(None)

    def _job_of(self, op: SubmitOp) -> Job:
        params = op.params
        if op.grammar is not None:
            params = dataclasses.replace(params,
                                         grammar=self.engine.grammars.compile(op.grammar))
        return new_job(op.job_id, op.prompt_ids, params, op.strategy, _discard)


def _wire(item: Job | AbortOp) -> SubmitOp | AbortOp:
    if isinstance(item, AbortOp):
        return item
    grammar = item.params.grammar
    return SubmitOp(item.job_id, item.prompt_ids, dataclasses.replace(item.params, grammar=None),
                    grammar.grammar if grammar is not None else None, item.strategy)


def _discard(_delta: JobDelta | None) -> None:
    """Other ranks' jobs: their output is rank 0's to send."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join(rank: int, world: int, port: int, config: EngineConfig) -> None:
    # transformers' tensor-parallel loading reads these, as torchrun would set them.
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    cuda = config.device.startswith("cuda") or (config.device == "auto"
                                                and torch.cuda.is_available())
    if cuda:
        prefer_expandable_segments()  # set_device starts CUDA, which reads the setting once
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world,
                            timeout=RANK_TIMEOUT)
