"""EmbeddingService: the embedding model's own thread, and the batching of concurrent requests.

Requests put their rows of token ids on a queue and wait on a future. The thread takes the first
request and everything queued behind it, and runs them together: rows sorted by length and cut
into forwards of at most `max_batch_tokens` padded tokens, so what arrives together shares one
forward, and one huge request cannot take all the memory at once.

Thread budget: the chat engine takes every core of a small machine and all but one of a larger
one (engine/config.py), and its intra-op threads spin while they wait for each other, so an
encoder that took cores at the same priority would stretch every decode step. The thread
therefore runs `threads` intra-op threads (default: the cores the engine leaves, at least one)
at a lower priority (`EMBED_NICE`): embeddings use what the streams leave, and a long batch
delays the next token by little (bench/embeddings_streams.py measures it).
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from app.embeddings.model import EmbeddingModel, load_embedding_model
from app.settings import Settings
from engine.model.loader import cache_dir, resolve_device

log = logging.getLogger("seqgate.embeddings")

# Padded tokens per forward: hundreds of short inputs at once, yet activations of about 100 MiB
# for full-length ones, whatever a request holds.
MAX_BATCH_TOKENS = 8192
# Tokens that may wait before requests are refused (429): minutes of work on one core. A request
# larger than that alone still runs when nothing waits.
MAX_QUEUED_TOKENS = 1 << 19
# A nice value the engine's threads always win against, yet not the prep threads' 19: a
# forward still gets a share of a core while the streams run.
EMBED_NICE = 10


class EmbeddingQueueFull(Exception):
    """Too many tokens are waiting for the embedding model; retry later."""


class EmbeddingStopped(Exception):
    """The service stopped before the request ran."""


@dataclass
class _Request:
    rows: list[list[int]]
    future: Future

    @property
    def tokens(self) -> int:
        return sum(map(len, self.rows))


def plan_forwards(lengths: list[int], max_batch_tokens: int) -> list[list[int]]:
    """Row indices in forwards: sorted by length (less padding), each forward's rows × its
    longest row within `max_batch_tokens` (a row longer than that runs alone)."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    forwards: list[list[int]] = []
    current: list[int] = []
    for i in order:  # ascending, so row i is the longest so far
        if current and (len(current) + 1) * lengths[i] > max_batch_tokens:
            forwards.append(current)
            current = []
        current.append(i)
    if current:
        forwards.append(current)
    return forwards


def default_threads(engine_threads: int) -> int:
    """The cores the chat engine leaves, at least one."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) - engine_threads)


def pin_torch_threads(n: int) -> None:
    """Give the calling thread `n` intra-op threads without changing anyone else's.

    torch keeps one process-wide count, which every thread copies at its first parallel op;
    setting ours also sets it, and an engine thread that set its own but has not yet run an op
    would then copy ours. So the process-wide value is put back at once, from a short-lived
    thread whose own copy ends with it."""
    before = torch.get_num_threads()  # this thread's first call copies the process-wide count
    torch.set_num_threads(n)
    restore = threading.Thread(target=torch.set_num_threads, args=(before,))
    restore.start()
    restore.join()


def _lower_priority(nice: int) -> None:
    try:  # Linux: a thread's nice value is its own, and the threads it starts inherit it
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (AttributeError, OSError):  # not Linux, or not allowed: run at normal priority
        pass


class EmbeddingService:
    """Owns the embedding model's thread and queue; `forwards` counts the forwards it ran."""

    def __init__(self, model: EmbeddingModel, threads: int = 1, *,
                 max_batch_tokens: int = MAX_BATCH_TOKENS,
                 max_queued_tokens: int = MAX_QUEUED_TOKENS, nice: int = EMBED_NICE):
        self.model = model
        self.threads = threads
        self.max_batch_tokens = max_batch_tokens
        self.max_queued_tokens = max_queued_tokens
        self.nice = nice
        self.forwards = 0
        self._queue: queue.SimpleQueue[_Request | None] = queue.SimpleQueue()
        self._queued_tokens = 0
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopped = False

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="seqgate-embeddings",
                                            daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Finish the forward that runs; requests still queued fail with EmbeddingStopped."""
        self._stopped = True
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout)
            self._thread = None
        self._fail_queued()  # a service stopped before it started still answers its requests

    def submit(self, rows: list[list[int]]) -> Future:
        """Queue rows of token ids; the future gets their vectors, [len(rows), dim] fp32.
        Rows queued before `start` run in its first batch."""
        if self._stopped:
            raise EmbeddingStopped("the embedding service has stopped")
        request = _Request(rows, Future())
        with self._lock:
            waiting = self._queued_tokens
            if waiting and waiting + request.tokens > self.max_queued_tokens:
                raise EmbeddingQueueFull(f"{waiting} tokens are waiting for the embedding model "
                                         f"(at most {self.max_queued_tokens})")
            self._queued_tokens += request.tokens
        self._queue.put(request)
        return request.future

    @classmethod
    def from_settings(cls, settings: Settings) -> EmbeddingService:
        """Load `settings.embeddings.model` on the chat model's device (same cache folder, same
        trust_remote_code); not started."""
        engine = settings.engine
        model = load_embedding_model(settings.embeddings.model, cache_dir=cache_dir(engine),
                                     device=resolve_device(engine.device),
                                     trust_remote_code=engine.trust_remote_code)
        return cls(model, settings.embeddings.threads or default_threads(engine.threads))

    async def embed(self, rows: list[list[int]]) -> torch.Tensor:
        """The rows' vectors. Cancelling the await drops the rows if they have not run yet."""
        return await asyncio.wrap_future(self.submit(rows))

    def _run(self) -> None:
        pin_torch_threads(self.threads)
        _lower_priority(self.nice)
        stopping = False
        while not stopping:
            requests, stopping = self._take()
            self._serve(requests)
        self._fail_queued()

    def _take(self) -> tuple[list[_Request], bool]:
        """What is queued (waiting for a first item), up to a stop; whether the stop came."""
        items = [self._queue.get()]
        while items[-1] is not None:
            try:
                items.append(self._queue.get_nowait())
            except queue.Empty:
                break
        requests = [r for r in items if r is not None]
        with self._lock:
            self._queued_tokens -= sum(r.tokens for r in requests)
        return requests, items[-1] is None

    def _serve(self, requests: list[_Request]) -> None:
        live = [r for r in requests if r.future.set_running_or_notify_cancel()]
        if not live:
            return
        rows = [row for r in live for row in r.rows]
        try:
            vectors = self._forward_all(rows)
        except Exception as exc:  # a failed forward fails its requests, not the thread
            log.exception("embedding forward failed")
            for r in live:
                r.future.set_exception(exc)
            return
        start = 0
        for r in live:
            r.future.set_result(vectors[start:start + len(r.rows)])
            start += len(r.rows)

    def _forward_all(self, rows: list[list[int]]) -> torch.Tensor:
        out = torch.empty(len(rows), self.model.dimensions.full)
        for part in plan_forwards([len(r) for r in rows], self.max_batch_tokens):
            out[part] = self.model.forward([rows[i] for i in part])
            self.forwards += 1
        return out

    def _fail_queued(self) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not None and item.future.set_running_or_notify_cancel():
                item.future.set_exception(EmbeddingStopped("the embedding service stopped"))
