"""Choices timed on the host at start and cached per machine: which product serves which row
counts (engine/model/lowbit.py, engine/model/w8a8.py); `cached` keeps other facts about the
host as well (engine/model/loader.py's file digests)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

log = logging.getLogger("seqgate.engine")


def best_of(times: int, work: Callable[[], object]) -> float:
    """Seconds of the fastest of `times` runs of `work`, after one to warm up."""
    work()
    best = float("inf")
    for _ in range(times):
        start = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - start)
    return best


@contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """Within the block torch runs `threads` intra-op threads (the engine thread's; None:
    this thread's), so that timings taken here hold for the engine."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def cached(path: Path | None, key: str, measure: Callable[[], dict]) -> dict:
    """The entry under `key` in the JSON file at `path`, measured and stored there if missing
    (an unreadable file counts as empty; one that cannot be written is logged, not raised)."""
    try:
        known = json.loads(path.read_text()) if path is not None and path.is_file() else {}
    except (OSError, ValueError):
        known = {}
    if key in known:
        return known[key]
    entry = measure()
    if path is not None:
        known[key] = entry
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{time.monotonic_ns()}.tmp")
            tmp.write_text(json.dumps(known, indent=1))
            tmp.replace(path)
        except OSError as exc:
            log.warning("could not write the cache at %s: %s", path, exc)
    return entry


def largest_win(rows: Iterable[int], timed: Callable[[int], tuple[float, float]],
                best: int = 0) -> tuple[int, dict]:
    """The largest of `rows` at which the first of `timed(n)`'s two timings (seconds) is the
    smaller (else `best`), and the timings in ms by row count; stops after two losses in a
    row, since the second way's lead grows with the rows."""
    timings: dict[str, list[float]] = {}
    losses = 0
    for n in rows:
        first, second = timed(n)
        timings[str(n)] = [round(first * 1e3, 3), round(second * 1e3, 3)]
        if first < second:
            best, losses = n, 0
        else:
            losses += 1
            if losses == 2:
                break
    return best, timings
