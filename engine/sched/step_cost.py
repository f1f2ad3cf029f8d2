"""What a step costs in wall time, learnt from the steps that ran; it bounds the prompt work
a step takes on while rows decode.

A token budget alone cannot keep running streams from stalling: on the CPU a decode row costs
several prompt tokens, and the right number of prompt tokens per step grows with the rows
decoding. So the scheduler asks `StepCost.prefill_cap`: the most prompt budget units (a token
each, plus its attention, `Scheduler.chunk_cost`) that keep a mixed step within `stall_ratio`
times a decode-only step of the same rows. That is Sarathi-Serve's time-between-tokens bound,
set relative to the step the streams would run anyway, and measured on the machine rather than
configured.

Model: a step of r decode rows and u prompt units takes a + b·r + c·u seconds, one least-squares
fit over recent steps with decode rows (older ones forgotten geometrically). One fit over all
those steps, not a decode line from decode-only steps and a unit cost from the excess of mixed
ones: under steady load nearly every step is mixed, so a decode line learnt from the few
decode-only steps goes stale, and the error it leaves is charged to the prompt units (caps then
shrink to the floor and throughput falls, docs/benchmarks/scheduler.md). Until the fit is
determined there is no cap (the token budget alone applies).
"""

from __future__ import annotations

import numpy as np

# Weight of the newest observation in the running sums.
FORGET = 0.02
# A cap never goes below this, so that prompts progress under any load.
MIN_CAP_UNITS = 16
# Spread (standard deviation) the observed prompt units need before any fit, and the rows before
# their own cost is fitted (less: the decode step is taken as the same at any row count).
MIN_SPREAD = 1.0


class StepCost:
    """A running least-squares fit of step seconds on (1, decode rows, prompt units)."""

    def __init__(self) -> None:
        self._xx = np.zeros((3, 3))
        self._xy = np.zeros(3)
        self._coef: np.ndarray | None = None  # (a, b, c) once the fit is determined
        self._dirty = False

    def observe(self, decode_rows: int, prefill_units: int, seconds: float) -> None:
        """Learn from a step that ran `decode_rows` decode tokens and `prefill_units` of prompt
        work in `seconds`.

        Only steps with decode rows teach: the cap governs those. A prefill alone runs in
        larger steps (up to `scheduler.ALONE_TOKENS`) whose cost per unit is not that of a chunk
        beside decode rows, and varies more: one such step can pull the fit far enough that the
        cap lets every mixed step stall the streams."""
        if not decode_rows:
            return
        x = np.array([1.0, decode_rows, prefill_units])
        self._xx = self._xx * (1.0 - FORGET) + np.outer(x, x)
        self._xy = self._xy * (1.0 - FORGET) + x * seconds
        self._dirty = True

    @property
    def coefficients(self) -> tuple[float, float, float] | None:
        """(seconds per step, per decode row, per prompt unit), or None until determined."""
        if self._dirty:
            self._dirty = False
            self._coef = self._fit()
        return None if self._coef is None else tuple(float(v) for v in self._coef)

    def _fit(self) -> np.ndarray | None:
        w = self._xx[0, 0]
        if w <= 0:
            return None
        mean = self._xx[0, 1:] / w
        var = np.diag(self._xx)[1:] / w - mean * mean
        if var[1] < MIN_SPREAD ** 2:
            return None  # prompt work barely varies: its cost cannot be told apart
        coef = None
        if var[0] >= MIN_SPREAD ** 2:
            coef, *_ = np.linalg.lstsq(self._xx, self._xy, rcond=None)
        if coef is None or coef[1] < 0:
            # One batch size seen (streams decoding steadily), or rows that look as if they
            # saved time: fit time on units alone, the decode step the same at any row count.
            # (Clipping a negative row cost to 0 after the fit would keep the intercept that
            # compensated it, and overstate the decode step several times.)
            keep = [0, 2]
            a, c = np.linalg.lstsq(self._xx[np.ix_(keep, keep)], self._xy[keep], rcond=None)[0]
            coef = np.array([a, 0.0, c])
        if coef[2] <= 0:
            return None  # prompt work looks free: noise, no basis for a cap
        if coef[0] + coef[1] * mean[0] <= 0:
            return None  # the steps decoding rows look free: no basis for a cap either
        return coef

    def decode_seconds(self, rows: int) -> float:
        """Estimated wall time of a decode-only step of `rows` rows (0.0 before any fit)."""
        coef = self.coefficients
        return 0.0 if coef is None else max(0.0, coef[0] + coef[1] * rows)

    def prefill_cap(self, decode_rows: int, stall_ratio: float) -> int | None:
        """The most prompt units a step of `decode_rows` decode rows may add and stay within
        `stall_ratio` times a decode-only step of those rows; None while the costs are unknown."""
        coef = self.coefficients
        if not decode_rows or coef is None:
            return None
        allowed = (stall_ratio - 1.0) * self.decode_seconds(decode_rows)
        return max(MIN_CAP_UNITS, int(allowed / coef[2]))
