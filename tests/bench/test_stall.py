"""The stall benchmark's per-stream figures and report, on made-up token times (no server)."""

from __future__ import annotations

from bench.harness import StreamTrace
from bench.stall import report, summarize


def _trace(start: float, gap: float, n: int, stall_at: int | None = None,
           stall: float = 0.0) -> StreamTrace:
    t, times = start, []
    for i in range(n):
        times.append(t)
        t += gap + (stall if i == stall_at else 0.0)
    return StreamTrace(times)


def test_the_largest_gap_in_the_window_over_the_stream_median():
    steady = _trace(0.0, 0.1, 100)
    stalled = _trace(0.0, 0.1, 100, stall_at=50, stall=0.5)  # one 0.6 s gap ending at 5.6 s
    early = _trace(0.0, 0.1, 100, stall_at=5, stall=2.0)  # before the window: not counted
    longs = [{"tokens": 1000, "sent": 4.0, "first_token": 6.0, "ttft_s": 2.0}]
    m = summarize([steady, stalled, early], longs, window_start=4.0, window_end=7.0)
    rows = m["streams"]
    assert rows[0]["max_over_median"] == 1.0
    assert rows[1]["max_gap_during_s"] == 0.6 and rows[1]["max_over_median"] == 6.0
    assert rows[1]["max_gap_ended_at_s"] == 1.6
    assert rows[2]["max_over_median"] == 1.0
    assert m["worst_max_over_median"] == 6.0 and m["long_ttft_p50_s"] == 2.0
    assert m["streams_outlasting_window"] == 3
    text = report([{"label": "budget 128", "repeat": 0, "result": m}])
    assert "| budget 128 | 0 | 6.00 (not met) | 0.600 s | 100 ms |" in text
