"""The benchmark's pure parts: percentiles, per-request figures, run summaries and ratios."""

from __future__ import annotations

import math

import pytest

from bench.figures import (
    RequestResult,
    geomean,
    paired_ratios,
    percentile,
    pooled,
    ratio,
    summarize,
)


def test_percentile_interpolates_like_numpy():
    assert percentile([], 50) is None
    assert percentile([3.0], 95) == 3.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5  # mean of the middle two
    assert percentile([1, 2, 3, 4, 5], 95) == pytest.approx(4.8)
    assert percentile([1, 2, 3], 0) == 1 and percentile([1, 2, 3], 100) == 3
    with pytest.raises(ValueError, match="outside"):
        percentile([1.0], 101)


def test_request_figures():
    r = RequestResult(index=0, sent=1.0, first_token=1.5, end=3.5, output_tokens=5)
    assert (r.ttft, r.e2e, r.tpot) == (0.5, 2.5, 0.5)
    assert RequestResult(0, 0.0, 0.1, 0.2, output_tokens=1).tpot is None  # no gap to measure
    failed = RequestResult(0, 0.0, end=1.0, error="HTTP 500: boom")
    assert not failed.ok and failed.ttft is None
    assert "text" not in r.to_json() and r.to_json(keep_text=True)["text"] == ""


def test_summarize_counts_only_successes():
    ok = [RequestResult(i, 0.0, 0.1 * (i + 1), 1.0, output_tokens=10) for i in range(4)]
    bad = RequestResult(4, 0.0, error="HTTP 429: full")
    f = summarize(ok + [bad], wall_seconds=2.0)
    assert (f["requests"], f["completed"], f["errors"]) == (5, 4, 1)
    assert f["output_tokens_per_s"] == 20.0 and f["requests_per_s"] == 2.0
    assert f["ttft_p50"] == pytest.approx(0.25)
    assert f["cached_tokens"] is None
    assert math.isnan(summarize([], 0.0)["output_tokens_per_s"])


def _run(repeat: int, tps: float, ttfts=()) -> dict:
    reqs = [{"error": None, "ttft": t} for t in ttfts]
    return {"repeat": repeat, "figures": {"output_tokens_per_s": tps}, "requests": reqs}


def test_ratios_pair_runs_by_repeat():
    ours = [_run(0, 30.0), _run(1, 40.0)]
    theirs = [_run(1, 20.0), _run(0, 10.0)]
    assert paired_ratios(ours, theirs, "output_tokens_per_s") == [3.0, 2.0]
    assert geomean([2.0, 8.0]) == pytest.approx(4.0)
    assert geomean([]) is None
    assert ratio(1.0, 0.0) is None and ratio(None, 1.0) is None and ratio(3.0, 2.0) == 1.5


def test_pooled_percentiles_span_repeats():
    runs = [_run(0, 1.0, [1.0, 2.0]), _run(1, 1.0, [3.0, 4.0])]
    assert pooled(runs, "ttft", 50) == 2.5
