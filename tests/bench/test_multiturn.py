"""The multi-turn benchmark's summary and report, on made-up turns (no server)."""

from __future__ import annotations

import pytest

from bench.multiturn import ServerRun, TurnResult, report, summarize


def _runs() -> list[ServerRun]:
    on = ServerRun("on", 0, 1.0, [
        TurnResult(0, 1, 0.30, 60, 20), TurnResult(0, 2, 0.10, 160, 120),
        TurnResult(0, 3, 0.10, 260, 220), TurnResult(1, 1, 0.50, 60, 20),
        TurnResult(1, 2, 0.20, 160, 120), TurnResult(1, 3, None, None, None, error="HTTP 500")])
    off = ServerRun("off", 0, 2.0, [
        TurnResult(c, t, 0.3 * t, 60 + 100 * (t - 1), 0) for c in (0, 1) for t in (1, 2, 3)])
    return [on, off]


def test_summary_pools_turns_and_counts_errors_apart():
    s = summarize(_runs())
    assert s["on"][1]["requests"] == 2 and s["on"][3]["requests"] == 1
    assert s["on"][3]["errors"] == 1
    assert s["on"][2]["cached_fraction"] == 240 / 320
    assert s["on"][1]["ttft_p50"] in (0.30, 0.50)
    assert s["off"][3]["ttft_p50"] == pytest.approx(0.9)
    assert s["off"][2]["cached_fraction"] == 0.0


def test_report_states_the_ratio_against_the_target():
    text = report(summarize(_runs()), "on", "off")
    assert "| on | 2 | 2 | 160 | 75.0% |" in text
    assert "turn 3: TTFT p50 cache off / on = 9.00x (target >= 3x: met)" in text
