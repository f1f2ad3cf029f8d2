"""StepCost (the learnt step costs) and the cap it puts on a step's prompt work, without a
model: steps are fed with the times a machine would give."""

from __future__ import annotations

import pytest

from engine import EngineConfig
from engine.request.job import Job, Sequence
from engine.request.sampling_params import SamplingParams
from engine.sched.scheduler import Scheduler
from engine.sched.step_cost import MIN_CAP_UNITS, StepCost


def machine(rows: int, units: int) -> float:
    """A machine where a step costs 25 ms, 4 ms per decode row and 1.25 ms per prompt unit."""
    return 0.025 + 0.004 * rows + 0.00125 * units


def taught(rows_seen=(4, 8, 16), units: int = 100) -> StepCost:
    cost = StepCost()
    for r in rows_seen:
        for _ in range(5):
            cost.observe(r, 0, machine(r, 0))
    for _ in range(40):
        cost.observe(rows_seen[0], units, machine(rows_seen[0], units))
    return cost


def test_no_cap_until_prompt_work_has_varied():
    cost = StepCost()
    assert cost.prefill_cap(8, 2.5) is None
    for _ in range(3):  # decode-only steps alone: a prompt unit's cost is unknown
        cost.observe(8, 0, machine(8, 0))
    assert cost.prefill_cap(8, 2.5) is None
    cost.observe(8, 64, machine(8, 64))
    assert cost.prefill_cap(8, 2.5) is not None
    assert cost.prefill_cap(0, 2.5) is None  # nothing decodes: nothing to stall


def test_step_costs_are_learnt():
    cost = taught()
    for rows in (1, 8, 32):
        assert cost.decode_seconds(rows) == pytest.approx(machine(rows, 0), rel=1e-6)
    assert cost.coefficients == pytest.approx((0.025, 0.004, 0.00125), rel=1e-6)


def test_costs_are_learnt_under_steady_load_from_mixed_steps():
    """The case that broke a fit of decode-only steps plus the excess of mixed ones: under load
    nearly every step is mixed, and the few decode-only steps came early, with few rows. That
    decode line never moved, the excess of every mixed step was charged to its prompt units, and
    the cap sat at its floor."""
    cost = StepCost()
    for _ in range(5):
        cost.observe(2, 0, machine(2, 0))
    for i in range(300):
        rows, units = 24 + i % 9, 20 + (37 * i) % 130
        cost.observe(rows, units, machine(rows, units))
    truth = int((2.5 - 1) * machine(32, 0) / 0.00125)
    assert cost.prefill_cap(32, 2.5) == pytest.approx(truth, abs=2)
    assert cost.prefill_cap(32, 2.5) > 5 * MIN_CAP_UNITS


def test_a_prefill_alone_does_not_teach_the_cap():
    """Steps with no decode row are prefills alone, in large steps at a cost per unit of their
    own. In one stall run a 1,101-unit start-up prefill at 1.19 ms per unit, then 38 decode-only
    steps of 16 rows and a few 240-unit chunks beside them, fitted a 394 ms intercept and a
    negative row cost; clipped, that made a 16-row decode step 394 ms instead of 45 and the cap
    700 units, so every step ran the token budget's 240 and took 5x a decode step."""
    cost = StepCost()
    cost.observe(0, 1101, 1.308)
    for _ in range(38):
        cost.observe(16, 0, 0.045)
    for units, seconds in ((58, 0.105), (240, 0.245), (240, 0.267)):
        cost.observe(16, units, seconds)
    assert cost.decode_seconds(16) == pytest.approx(0.045, abs=0.005)
    cap = cost.prefill_cap(16, 2.5)
    assert 60 <= cap <= 100  # 1.5 x 45 ms at ~0.85 ms per unit: ~80


def test_rows_that_seem_to_save_time_are_fitted_as_costing_nothing():
    """Noise can make more rows look cheaper (here 8-row steps slower than 16-row ones). The
    fit then takes time on prompt units alone, keeping the decode step near what was seen."""
    cost = StepCost()
    for i in range(60):
        rows, units = (8, 16)[i % 2], (0, 40, 120)[i % 3]
        cost.observe(rows, units, (0.060 if rows == 8 else 0.050) + 0.001 * units)
    coef = cost.coefficients
    assert coef[1] == 0.0
    assert cost.decode_seconds(16) == pytest.approx(0.055, abs=0.002)
    assert coef[2] == pytest.approx(0.001, rel=0.05)


def test_a_fit_that_makes_decoding_free_gives_no_cap():
    """Noisy steps can fit a line whose decode step is zero or less (every step here had prompt
    work, and the small chunks ran fast). Such a fit has no basis for a cap: without this the
    estimate was clipped to 0 s and the cap fell to its floor."""
    cost = StepCost()
    for i in range(40):
        units = (10, 50)[i % 2]
        cost.observe(4, units, (0.005, 0.050)[i % 2])
    assert cost.coefficients is None
    assert cost.decode_seconds(4) == 0.0 and cost.prefill_cap(4, 2.5) is None
    for _ in range(10):  # decode-only steps seen, the fit is determined again
        cost.observe(4, 0, 0.020)
    assert cost.decode_seconds(4) > 0 and cost.prefill_cap(4, 2.5) >= MIN_CAP_UNITS


def test_cap_keeps_a_mixed_step_within_the_ratio_and_grows_with_the_rows():
    cost = taught()
    caps = {rows: cost.prefill_cap(rows, 2.5) for rows in (1, 16, 32)}
    for rows, cap in caps.items():
        assert machine(rows, cap) <= 2.5 * machine(rows, 0) + 1e-9
        assert machine(rows, cap + 2) > 2.5 * machine(rows, 0)  # and not far below it
    assert caps[1] < caps[16] < caps[32]


def test_one_row_count_seen_gives_its_mean_and_the_cap_has_a_floor():
    cost = taught(rows_seen=(8,))
    assert cost.decode_seconds(8) == pytest.approx(machine(8, 0))
    assert cost.prefill_cap(8, 1.01) == MIN_CAP_UNITS


def test_costs_follow_a_machine_that_slows_down():
    cost = taught()
    before = cost.prefill_cap(8, 2.5)
    for _ in range(200):  # another process now takes half the machine: decode steps slow down
        cost.observe(8, 0, 2 * machine(8, 0))
        cost.observe(8, 100, 2 * machine(8, 100))
    assert cost.decode_seconds(8) == pytest.approx(2 * machine(8, 0), rel=0.05)
    assert cost.prefill_cap(8, 2.5) == pytest.approx(before, abs=2)  # both slowed alike


def _job(name: str, length: int, first: int = 1) -> Job:
    j = Job(name, list(range(first, first + length)), SamplingParams(), "greedy")
    j.seqs = [Sequence(j, 0)]
    return j


def _decoding(sched: Scheduler, rows: int) -> None:
    for i in range(rows):
        sched.submit(_job(f"r{i}", 3, first=100 * (i + 1)))
    for c in sched.schedule().chunks:  # nothing decodes: every prompt in one step
        c.job.computed = c.stop
        c.job.seqs[0].kv_len = c.stop


def _chunks_of(plan):
    return [(c.job.job_id, c.start, c.stop) for c in plan.chunks]


@pytest.mark.parametrize("ratio", [0.0, 2.5])
def test_the_scheduler_takes_the_cap_while_rows_decode(ratio):
    cost = taught()
    sched = Scheduler(EngineConfig(max_num_batched_tokens=256, stall_ratio=ratio), cost=cost)
    _decoding(sched, 8)
    sched.submit(_job("long", 1500, first=2000))
    plan = sched.schedule()
    assert plan.decode_rows == 8
    want = 256 - 8 if not ratio else cost.prefill_cap(8, ratio)
    if ratio:
        assert want < 256 - 8  # the cap binds before the token budget
    # No attention charge here (the scheduler's default): a chunk costs a unit per token.
    assert _chunks_of(plan) == [("long", 0, want)] and plan.prefill_units == want
    assert sched.prefill_budget(0) >= 2048  # alone, a prompt is never capped


def test_stall_ratio_is_validated():
    from engine.errors import ConfigError

    with pytest.raises(ConfigError, match="stall_ratio"):
        EngineConfig(stall_ratio=1.0)
    assert EngineConfig(stall_ratio=0).stall_ratio == 0


def test_the_engine_learns_costs_only_when_asked(tiny_model, make_engine):
    """The engine feeds the cost model every step it ran (the model learns from those with
    decode rows), with that step's rows, prompt units and wall time. Whether a tiny model's
    ~1 ms steps give a determined fit is up to the machine's noise (a CI run once saw none):
    the fit itself is tested above, on the times of a machine."""
    off = make_engine(tiny_model, background=False, stall_ratio=0)
    assert off.scheduler.cost is None
    assert make_engine(tiny_model, background=False).scheduler.cost is not None  # the default
    # No drafts: a random model's repetitive output would otherwise take fewer decode steps.
    on = make_engine(tiny_model, background=False, stall_ratio=2.5, max_num_batched_tokens=64,
                     num_speculative_tokens=0)
    seen = []
    observe = on.scheduler.cost.observe
    on.scheduler.cost.observe = lambda *args: (seen.append(args), observe(*args))
    steps = []
    on.add_step_listener(steps.append)
    rows = [on.submit(list(range(10 + i, 20 + i)), SamplingParams(max_new_tokens=40))
            for i in range(4)]
    for _ in range(4):  # the four prompts, alone; then they join and decode
        on.step()
    long = on.submit(list(range(100, 400)), SamplingParams(max_new_tokens=2))
    on.run_until_idle()
    assert all(h.job_id for h in rows + [long])
    unregrouped = [s for s in steps if not s.regrouped]
    assert [(r, t) for r, _, t in seen] == [(st.decode_rows, st.seconds) for st in unregrouped]
    assert all(t > 0 for *_, t in seen) and sum(r > 0 for r, *_ in seen) > 30
    mixed = [u for r, u, _ in seen if r and u]
    # The 300-token prompt went in chunks beside the four decoding rows, every one of them seen.
    assert len(mixed) >= 300 // 64 and sum(mixed) >= 300
