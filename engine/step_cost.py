"""What a step costs in wall time, learnt from the steps that ran; it bounds the prompt work
a step takes on while rows decode.

A token budget alone cannot keep running streams from stalling: on the CPU a decode row costs
several prompt tokens (16 rows decode in ~90 ms, where 240 prompt tokens add ~340 ms), and the
right number of prompt tokens per step grows with the rows decoding. So the scheduler asks
`StepCost.prefill_cap`: the most prompt budget units (a token each, plus its attention,
`Scheduler.chunk_cost`) that keep a mixed step within `stall_ratio` times a decode-only step of
the same rows. That is Sarathi-Serve's time-between-tokens bound, set relative to the step the
streams would run anyway, and measured on the machine rather than configured.

Model: a decode-only step of r rows takes a + b·r seconds (least squares over recent
decode-only steps, older ones forgotten geometrically); a prompt budget unit adds c seconds (the
mean of recent mixed steps' excess over that line, per unit). Until both are known there is no
cap (the token budget alone applies).
"""

from __future__ import annotations

# Weight of the newest observation in the running estimates.
FORGET = 0.05
# Mixed steps with fewer prompt units than this say little about a unit's cost (noise).
MIN_OBSERVED_UNITS = 16
# A cap never goes below this, so that prompts progress under any load.
MIN_CAP_UNITS = 16


class StepCost:
    """Running estimates of decode-only step time by rows, and of seconds per prompt unit."""

    def __init__(self) -> None:
        # Exponentially weighted sums for the decode line t = a + b·r.
        self._w = self._r = self._rr = self._t = self._rt = 0.0
        self.unit_seconds: float | None = None

    def observe(self, decode_rows: int, prefill_units: int, seconds: float) -> None:
        """Learn from a step that ran `decode_rows` decode tokens and `prefill_units` of prompt
        work in `seconds` (a step with neither teaches nothing)."""
        if decode_rows and not prefill_units:
            keep = 1.0 - FORGET
            self._w = self._w * keep + 1.0
            self._r = self._r * keep + decode_rows
            self._rr = self._rr * keep + decode_rows * decode_rows
            self._t = self._t * keep + seconds
            self._rt = self._rt * keep + decode_rows * seconds
        elif decode_rows and prefill_units >= MIN_OBSERVED_UNITS and self._w:
            excess = max(0.0, seconds - self.decode_seconds(decode_rows)) / prefill_units
            self.unit_seconds = excess if self.unit_seconds is None else \
                (1.0 - FORGET) * self.unit_seconds + FORGET * excess

    def decode_seconds(self, rows: int) -> float:
        """Estimated wall time of a decode-only step of `rows` rows (0.0 before any)."""
        if not self._w:
            return 0.0
        mean_r, mean_t = self._r / self._w, self._t / self._w
        var = self._rr / self._w - mean_r * mean_r
        if var < 0.25:  # one row count seen so far: no slope to fit
            return mean_t
        slope = max(0.0, (self._rt / self._w - mean_r * mean_t) / var)
        return max(0.0, mean_t + slope * (rows - mean_r))

    def prefill_cap(self, decode_rows: int, stall_ratio: float) -> int | None:
        """The most prompt units a step of `decode_rows` decode rows may add and stay within
        `stall_ratio` times a decode-only step; None while the costs are unknown."""
        if not decode_rows or not self.unit_seconds or not self._w:
            return None
        allowed = (stall_ratio - 1.0) * self.decode_seconds(decode_rows)
        return max(MIN_CAP_UNITS, int(allowed / self.unit_seconds))
