"""Running a request's engine jobs: submit, merge their deltas, stream or collect, abort on leave.

A request is one or more engine jobs (completions takes several prompts). `JobStream` merges
their deltas into one queue, which the consumer can wait on with a timeout (for SSE keep-alive
comments) without cancelling an engine iterator mid-way, and aborts every unfinished job when it
is closed early: the client went away, or the response failed.

SSE goes out through Litestar's ServerSentEvent rather than sse-starlette: sse-starlette is a
Starlette response (Litestar does not run it as a return value) and it patches uvicorn's
signal handler to end open streams on SIGTERM, which is the opposite of our drain.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

import msgspec
from litestar import Request
from litestar.background_tasks import BackgroundTask
from litestar.response import ServerSentEvent
from litestar.response.sse import ServerSentEventMessage

from adapters.errors import (
    ApiError,
    ParamNames,
    from_engine_error,
    job_outcome_error,
    request_timeout_error,
)
from adapters.openai_params import JobSpec
from app.lifespan import GatewayState
from app.metrics import GatewayMetrics
from engine import EngineClient, JobDelta, SubmittedJob

log = logging.getLogger("seqgate.app.streaming")

_DONE = object()
P = TypeVar("P")


def submit_all(engine: EngineClient, specs: list[JobSpec], names: ParamNames) -> list[SubmittedJob]:
    """Submit every job or none: if one is refused, the ones already queued are aborted."""
    handles: list[SubmittedJob] = []
    try:
        for spec in specs:
            handles.append(engine.submit(spec.prompt_ids, spec.params))
    except Exception as exc:
        raise _refused(engine, handles, exc, names) from None
    return handles


async def admit_all(engine: EngineClient, handles: list[SubmittedJob], names: ParamNames) -> None:
    """Wait until every job is queued (at once here; a replica answers remotely); if one is
    refused, the others are aborted and the refusal is the request's error (429 queue full)."""
    try:
        for h in handles:
            await h.accepted()
    except Exception as exc:
        raise _refused(engine, handles, exc, names) from None


def _refused(engine: EngineClient, handles: list[SubmittedJob], exc: Exception,
             names: ParamNames) -> ApiError:
    """Abort the request's jobs and return the API error its refusal means."""
    for h in handles:
        engine.abort(h.job_id)
    err = from_engine_error(exc, names)
    if err.status >= 500:
        log.error("a job was refused", exc_info=exc)
    return err


async def open_request(gw: GatewayState, request: Request, route: str, names: ParamNames,
                       prepare: Callable[[EngineClient, bytes], tuple[P, list[JobSpec]]],
                       ) -> tuple[P, JobStream]:
    """Admit a request and start its jobs: readiness, the API key's open-request cap, the body,
    `prepare(engine, body)` off the event loop (decode, validate, tokenize: it returns what the
    controller needs and the jobs), then submission. The key's count is released when the
    returned stream closes, or here if anything before that fails."""
    started = time.perf_counter()
    engine = gw.require_ready()
    release = gw.key_limiter.admit(request)
    try:
        body = await request.body()
        prepared, specs = await gw.off_loop(prepare, engine, body)
        handles = submit_all(engine, specs, names)
        await admit_all(engine, handles, names)
    except BaseException:
        release()
        raise
    if replicas := sorted({h.replica for h in handles if h.replica is not None}):
        request.state.seqgate_replicas = ",".join(replicas)  # the x-seqgate-replica header
    return prepared, JobStream(engine, handles, gw.metrics, started, route, gw.request_timeout,
                               on_close=release)


class JobStream:
    """The merged deltas of one request's jobs, tagged with the job's position in the request.

    Owns the request's deadline (`timeout`, seconds from `started`; None: none) and its outcome,
    counted once when the stream is closed: finished, failed, shutdown (the engine stopped the
    job), timed_out, or client_disconnected (closed before every job ended). `on_close` runs
    once, when it closes (the API key's open-request count is released there).
    """

    def __init__(self, engine: EngineClient, handles: list[SubmittedJob], metrics: GatewayMetrics,
                 started: float, route: str, timeout: float | None = None,
                 on_close: Callable[[], None] | None = None):
        self.engine, self.handles, self.metrics, self.started = engine, handles, metrics, started
        self.route = route
        self.timeout = timeout
        self.deadline = started + timeout if timeout else None
        self._queue: asyncio.Queue = asyncio.Queue()
        self._open = len(handles)
        self._finished: set[int] = set()
        self._first_token: dict[tuple[int, int], float] = {}
        self._failure: str | None = None  # failed | shutdown | timed_out
        self._closed = False
        self._on_close = on_close
        self._pumps = [asyncio.create_task(self._pump(i, h)) for i, h in enumerate(handles)]

    async def _pump(self, i: int, handle: SubmittedJob) -> None:
        # put_nowait: the queue is unbounded, and the finally must not await once cancelled.
        try:
            async for delta in handle:
                self._queue.put_nowait((i, delta))
        finally:
            self._queue.put_nowait((i, _DONE))

    def _observe(self, i: int, delta: JobDelta) -> None:
        key = (i, delta.index)
        now = time.perf_counter()
        if delta.token_ids and key not in self._first_token:
            self._first_token[key] = now
            self.metrics.ttft.observe(now - self.started)
        if delta.finish_reason is not None and key in self._first_token and \
                delta.completion_tokens > 1:
            self.metrics.tpot.observe((now - self._first_token[key]) /
                                      (delta.completion_tokens - 1))
        if delta.finish_reason == "error":
            self._failure = "failed"
        elif delta.finish_reason == "abort" and self._failure is None:
            self._failure = "shutdown"  # we did not abort it (we would have closed first)

    def _time_out(self) -> None:
        self._failure = "timed_out"
        self.close()
        raise request_timeout_error(self.timeout)

    async def next(self, timeout: float | None = None) -> tuple[int, JobDelta] | None:
        """The next (job position, delta); None once every job has ended.

        Raises TimeoutError when nothing arrives within `timeout` (the stream stays usable), and
        ApiError(408) once the request's deadline has passed (its jobs are aborted).
        """
        while self._open:
            wait = timeout
            if self.deadline is not None:
                left = self.deadline - time.perf_counter()
                if left <= 0:
                    self._time_out()
                wait = left if wait is None else min(wait, left)
            try:
                i, item = await asyncio.wait_for(self._queue.get(), wait)
            except TimeoutError:
                if self.deadline is not None and (timeout is None or wait < timeout):
                    # The deadline bounded this wait. The loop's timers may fire a clock
                    # resolution early, so the check at the top of the loop decides (it waits
                    # out what is left, if anything): never a bare TimeoutError (a 500).
                    continue
                raise
            if item is _DONE:
                self._open -= 1
                self._finished.add(i)
                continue
            self._observe(i, item)
            return i, item
        return None

    def close(self) -> None:
        """Abort whatever is still running (client gone, or the response failed); count the
        request's outcome (once)."""
        if self._closed:
            return
        self._closed = True
        for i, h in enumerate(self.handles):
            if i not in self._finished:
                self.engine.abort(h.job_id)
        for task in self._pumps:
            task.cancel()
        outcome = self._failure or ("finished" if not self._open else "client_disconnected")
        self.metrics.count_outcome(self.route, outcome)
        if self._on_close is not None:
            self._on_close()


async def collect(stream: JobStream, request: Request,
                  on_delta: Callable[[int, JobDelta], None]) -> None:
    """Feed every delta to `on_delta`; abort the jobs if the client disconnects meanwhile.

    Raises ApiError when a job fails inside the engine.
    """
    async def watch_disconnect() -> None:
        # The body has been read, so the next ASGI message is the disconnect, if it comes.
        while (await request.receive())["type"] != "http.disconnect":
            pass
        log.info("client disconnected: aborting %s", [h.job_id for h in stream.handles])
        stream.close()

    watcher = asyncio.create_task(watch_disconnect())
    try:
        while (item := await stream.next()) is not None:
            i, delta = item
            if (err := job_outcome_error(delta)) is not None:
                raise err
            on_delta(i, delta)
    finally:
        watcher.cancel()
        stream.close()


def _data(obj: object) -> ServerSentEventMessage:
    return ServerSentEventMessage(data=msgspec.json.encode(obj).decode(), sep="\n")


def named_event(obj: object) -> ServerSentEventMessage:
    """An event named after its `type` field (`event: <type>`), as Anthropic's and OpenAI's
    Responses streams send them (Anthropic's SDK skips unnamed events)."""
    return ServerSentEventMessage(data=msgspec.json.encode(obj).decode(),
                                  event=obj.type, sep="\n")  # type: ignore[attr-defined]


@dataclass(frozen=True)
class SseFraming:
    """How a protocol frames its stream: each event, an error once the headers are gone, the
    keep-alive sent while nothing else is, and what ends a stream that completed or failed."""

    event: Callable[[object], ServerSentEventMessage]
    error: Callable[[ApiError], ServerSentEventMessage]
    ping: ServerSentEventMessage
    end: tuple[ServerSentEventMessage, ...] = ()


# OpenAI's: bare `data:` events, comment lines as keep-alive, `data: [DONE]` at the end.
OPENAI_FRAMING = SseFraming(
    event=_data, error=lambda err: _data(err.body()),
    ping=ServerSentEventMessage(data=None, comment="ping", sep="\n"),
    end=(ServerSentEventMessage(data="[DONE]", sep="\n"),))


async def _events(stream: JobStream, start: Iterable[object],
                  on_delta: Callable[[int, JobDelta], list], finish: Callable[[], list],
                  ping_seconds: float, framing: SseFraming
                  ) -> AsyncIterator[ServerSentEventMessage]:
    completed = False
    try:
        for chunk in start:
            yield framing.event(chunk)
        while True:
            try:
                item = await stream.next(ping_seconds)
            except TimeoutError:
                # A keep-alive keeps proxies from cutting a stream during a long prefill.
                yield framing.ping
                continue
            except ApiError as err:  # the request's deadline passed
                yield framing.error(err)
                break
            if item is None:
                completed = True
                break
            i, delta = item
            if (err := job_outcome_error(delta)) is not None:
                # Headers are gone: the error travels as an event, then the stream ends.
                yield framing.error(err)
                break
            for chunk in on_delta(i, delta):
                yield framing.event(chunk)
        if completed:
            for chunk in finish():
                yield framing.event(chunk)
        for message in framing.end:
            yield message
    finally:
        # Runs on normal end, on client disconnect (Litestar cancels the stream) and on errors.
        stream.close()


def sse_response(stream: JobStream, start: Iterable[object],
                 on_delta: Callable[[int, JobDelta], list], finish: Callable[[], list],
                 ping_seconds: float, framing: SseFraming = OPENAI_FRAMING) -> ServerSentEvent:
    """An event stream framed as `framing` says (OpenAI's by default: `data: {chunk}` events,
    keep-alive comments, `[DONE]`)."""
    return ServerSentEvent(_events(stream, start, on_delta, finish, ping_seconds, framing),
                           background=closing(stream))


def closing(stream: JobStream) -> BackgroundTask:
    """Close the stream once the response is over, also when its body never began (the client
    left before the first event): the generator's own `finally` runs only once it has started."""
    return BackgroundTask(stream.close)
