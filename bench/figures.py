"""The figures of a serving run, from per-request timings: pure functions, no I/O.

A run is a closed loop of requests against one server. Per request the load generator records
when it was sent, when its first content token arrived and when its stream ended; from those:
  TTFT  time to first token = first content chunk - sent (a role-only first chunk does not count);
  TPOT  time per output token = (end - first token) / (output tokens - 1), requests of 2+ tokens;
  E2E   end-to-end latency = end - sent.
Throughput is over the run's wall time (first request sent to last stream ended): output tokens/s
and completed requests/s. Percentiles interpolate linearly between order statistics (numpy's
default), so p50 of an even sample is the mean of the two middle values.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass


@dataclass
class RequestResult:
    """What the load generator saw of one request (seconds are perf_counter offsets)."""

    index: int  # position in the workload
    sent: float  # when the request was sent
    first_token: float | None = None  # when the first non-empty content delta arrived
    end: float | None = None  # when the stream (or the JSON body) was complete
    output_tokens: int = 0  # usage.completion_tokens, else the count of content chunks
    content_chunks: int = 0  # SSE chunks that carried content
    prompt_tokens: int | None = None  # usage.prompt_tokens as the server counted them
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens (seqgate)
    finish_reason: str | None = None
    text: str = ""  # the generated text (kept only where it is compared)
    # Per generated token, where the server returned top_logprobs (non-streamed, seqgate): the
    # token, the runner-up, and the logprob gap between them (small: a near tie).
    margins: list[tuple[str, str, float]] | None = None
    error: str | None = None  # HTTP status + body, an in-stream error, or the exception

    @property
    def ok(self) -> bool:
        return self.error is None and self.end is not None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.sent

    @property
    def e2e(self) -> float | None:
        return None if self.end is None else self.end - self.sent

    @property
    def tpot(self) -> float | None:
        if self.first_token is None or self.end is None or self.output_tokens < 2:
            return None
        return (self.end - self.first_token) / (self.output_tokens - 1)

    def to_json(self, keep_text: bool = False) -> dict:
        data = asdict(self)
        if not keep_text:
            data.pop("text")
            data.pop("margins")
        data.update(ttft=self.ttft, tpot=self.tpot, e2e=self.e2e)
        return data


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation; None for an empty sample."""
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q={q} is outside 0-100")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _present(values: Iterable[float | None]) -> list[float]:
    return [v for v in values if v is not None]


def summarize(results: Sequence[RequestResult], wall_seconds: float) -> dict:
    """The figures of one run: throughput over `wall_seconds`, latency percentiles over the
    successful requests, and the error count."""
    ok = [r for r in results if r.ok]
    ttft = _present(r.ttft for r in ok)
    tpot = _present(r.tpot for r in ok)
    e2e = _present(r.e2e for r in ok)
    out_tokens = sum(r.output_tokens for r in ok)
    wall = wall_seconds if wall_seconds > 0 else float("nan")
    cached = _present(r.cached_tokens for r in ok)
    return {
        "requests": len(results),
        "completed": len(ok),
        "errors": len(results) - len(ok),
        "wall_seconds": wall_seconds,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / wall,
        "requests_per_s": len(ok) / wall,
        "ttft_p50": percentile(ttft, 50),
        "ttft_p95": percentile(ttft, 95),
        "tpot_p50": percentile(tpot, 50),
        "tpot_p95": percentile(tpot, 95),
        "e2e_p50": percentile(e2e, 50),
        "e2e_p95": percentile(e2e, 95),
        "cached_tokens": sum(cached) if cached else None,
    }


def pooled(runs: Sequence[dict], key: str, q: float) -> float | None:
    """A latency percentile over the requests of several runs (each run's "requests" list holds
    RequestResult.to_json() dicts), so repeats weigh by their requests, not by their count."""
    values = [r[key] for run in runs for r in run["requests"] if r["error"] is None
              and r[key] is not None]
    return percentile(values, q)


def mean_of(runs: Sequence[dict], key: str) -> float | None:
    """The mean of a figure over runs (None where no run has it)."""
    values = _present(run["figures"].get(key) for run in runs)
    return statistics.fmean(values) if values else None


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None where either is missing or b is zero."""
    if a is None or b is None or b == 0 or math.isnan(a) or math.isnan(b):
        return None
    return a / b


def paired_ratios(ours: Sequence[dict], theirs: Sequence[dict], key: str) -> list[float]:
    """Per-repeat ratios ours/theirs of a figure, pairing the runs by repeat number, so each
    ratio compares two runs taken next to each other in time (A B A B)."""
    by_repeat = {run["repeat"]: run for run in theirs}
    out = []
    for run in ours:
        peer = by_repeat.get(run["repeat"])
        if peer is not None:
            r = ratio(run["figures"].get(key), peer["figures"].get(key))
            if r is not None:
                out.append(r)
    return out


def geomean(values: Sequence[float]) -> float | None:
    """The geometric mean (the average that suits ratios); None for an empty sample."""
    if not values or any(v <= 0 for v in values):
        return None
    return math.exp(statistics.fmean(math.log(v) for v in values))
