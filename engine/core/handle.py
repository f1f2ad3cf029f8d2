"""JobHandle: a submitted job's output stream, fed by the engine thread, read by the caller."""

from __future__ import annotations

import asyncio
import queue as thread_queue
from collections.abc import AsyncIterator, Iterator

from engine.outputs import JobDelta

END = None  # end-of-stream marker on a handle's queue


class JobHandle:
    """A submitted job's output stream. Iterate with `async for` on the loop that submitted it,
    or with `iter_sync()` from a plain thread."""

    replica: str | None = None  # which engine replica runs the job; None: this process's

    def __init__(self, job_id: str, loop: asyncio.AbstractEventLoop | None):
        self.job_id = job_id
        self._loop = loop
        self._aq: asyncio.Queue | None = asyncio.Queue() if loop is not None else None
        self._tq: thread_queue.Queue | None = None if loop is not None else thread_queue.Queue()

    def put(self, item: JobDelta | None) -> None:
        """Hand a delta (or END) to the reader; called on the engine thread."""
        if self._aq is not None:
            try:
                self._loop.call_soon_threadsafe(self._aq.put_nowait, item)
            except RuntimeError:  # the client's loop is gone; nobody is listening
                pass
        else:
            self._tq.put(item)

    async def accepted(self) -> None:
        """Wait until the job is queued. Here `submit` has queued it already (a remote engine's
        handle waits for its replica's answer, which may be a refusal)."""

    async def __aiter__(self) -> AsyncIterator[JobDelta]:
        assert self._aq is not None, "submitted outside an event loop: use iter_sync()"
        while (item := await self._aq.get()) is not END:
            yield item

    def iter_sync(self, timeout: float | None = None) -> Iterator[JobDelta]:
        assert self._tq is not None, "submitted inside an event loop: use async for"
        while (item := self._tq.get(timeout=timeout)) is not END:
            yield item
