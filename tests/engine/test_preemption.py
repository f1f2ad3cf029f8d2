"""Out of memory is survived: an allocation failure in a step undoes the step's failed work,
puts the most recently admitted job back on the queue to be recomputed (prompt and generated
tokens, its output kept), holds admission for a while, and the engine goes on; only a job that
cannot fit alone fails.

A real model cannot run out of memory on demand, so the failure is injected (an error path, as
the standards allow): a KV write part way through the forward raises torch.OutOfMemoryError at
chosen steps, after some layers wrote their columns; or the slab a regroup builds cannot be
allocated, after the joining prompts handed their KV over to it.
"""

from __future__ import annotations

import pytest
import torch

import engine.kv.rolling_batch as rolling_module
from engine import SamplingParams
from engine.errors import out_of_memory
from engine.kv.slabs import SlabLayer
from engine.request.job import SeqStatus, new_job
from tests.engine.helpers import BUDGET_NEW_TOKENS, budget_workload, collect, unbudgeted_outputs


class FailingWrites:
    """Makes the `after`-th KV write of each chosen step raise, as an allocation would."""

    def __init__(self, eng, steps: set[int], after: int = 7):
        self.eng, self.steps, self.after = eng, set(steps), after
        self.seen: dict[int, int] = {}
        self.raised: list[int] = []

    def install(self, monkeypatch) -> FailingWrites:
        real = SlabLayer.update

        def update(layer, *args, **kwargs):
            step = self.eng.scheduler.step
            if step in self.steps:
                self.seen[step] = self.seen.get(step, 0) + 1
                if self.seen[step] == self.after:
                    self.raised.append(step)
                    raise torch.OutOfMemoryError("CUDA out of memory (injected)")
            return real(layer, *args, **kwargs)

        monkeypatch.setattr(SlabLayer, "update", update)
        return self


def failing_regroup(monkeypatch, eng, first: int) -> list[int]:
    """Makes the first slab a regroup builds at step `first` or later fail to allocate."""
    raised: list[int] = []
    real = rolling_module.build_sub_batch

    def build(*args, **kwargs):
        if eng.scheduler.step >= first and not raised:
            raised.append(eng.scheduler.step)
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return real(*args, **kwargs)

    monkeypatch.setattr(rolling_module, "build_sub_batch", build)
    return raised


def greedy(n: int) -> SamplingParams:
    return SamplingParams(strategy="greedy", max_new_tokens=n)


def test_allocation_failures_recompute_jobs_and_every_output_equals_a_run_without_them(
        smollm2, make_engine, monkeypatch):
    """32 greedy jobs; forwards fail part way at a prefill step and at decode steps, and a
    regroup fails after prompts joined: every job's output equals the run without failures."""
    prompts = budget_workload(smollm2.tokenizer)
    want = unbudgeted_outputs(smollm2, prompts)
    eng = make_engine(smollm2, max_rolling_batch_size=32)
    writes = FailingWrites(eng, {2, 9, 10, 14}).install(monkeypatch)
    regroups = failing_regroup(monkeypatch, eng, 4)
    handles = [eng.submit(p, greedy(BUDGET_NEW_TOKENS)) for p in prompts]
    stats = eng.run_until_idle()
    assert writes.raised == [2, 9, 10, 14] and len(regroups) == 1
    counters = eng.stats()
    assert counters.out_of_memory_steps == 5
    assert counters.preemptions >= 5  # a regroup that fails loses every joining job's KV
    assert counters.prompt_tokens == sum(map(len, prompts)), "a resumed prompt counts once"
    failed_at = stats[8].running  # step 9: admission holds at the rows it left
    assert all(s.running <= failed_at for s in stats[9:12])
    for i, h in enumerate(handles):
        got = collect(h)[0]
        assert got["tokens"] == want[i]["tokens"], f"job {i}"
        assert got["finish"] == want[i]["finish"]
        assert got["text"] == want[i]["text"]


def test_sampled_contrastive_and_n_jobs_resume_with_their_state(tiny_model, make_engine,
                                                               monkeypatch):
    """Seeded sampling (its generator), contrastive search (its candidates and hidden states),
    n > 1 before its rows diverge, stop strings and logprobs come through a preemption as they
    would have without it."""
    jobs = [(list(range(5, 40)), SamplingParams(strategy="sample", seed=7, max_new_tokens=24,
                                                temperature=1.0, logprobs=True, top_logprobs=2)),
            (list(range(50, 70)), SamplingParams(strategy="contrastive", top_k=3,
                                                 penalty_alpha=0.6, max_new_tokens=20)),
            (list(range(80, 90)), SamplingParams(strategy="sample", seed=3, n=2,
                                                 max_new_tokens=16)),
            (list(range(100, 140)), greedy(30))]

    def run(fail_steps: set[int]) -> tuple[list[dict], object]:
        eng = make_engine(tiny_model, max_rolling_batch_size=8, prompt_cache_bytes=0)
        FailingWrites(eng, fail_steps, after=2).install(monkeypatch)
        handles = [eng.submit(ids, params) for ids, params in jobs]
        eng.run_until_idle()
        return [collect(h) for h in handles], eng.stats()

    want, _ = run(set())
    got, stats = run({2, 6, 7})
    assert stats.preemptions == 3 and not stats.finished_by_reason["error"]
    for i, (g, w) in enumerate(zip(got, want)):
        assert {k: v["tokens"] for k, v in g.items()} == {k: v["tokens"] for k, v in w.items()}, i
        for k, v in g.items():  # a recomputed row's KV comes from a prefill: the same to ~1e-6
            for lp, ref in zip(v["logprobs"], w[k]["logprobs"], strict=True):
                assert lp.token_id == ref.token_id and lp.logprob == pytest.approx(ref.logprob,
                                                                                   abs=1e-4)


def test_a_job_that_cannot_fit_alone_fails_and_the_engine_goes_on(tiny_model, make_engine,
                                                                  monkeypatch):
    eng = make_engine(tiny_model, max_rolling_batch_size=4)
    FailingWrites(eng, {1}, after=1).install(monkeypatch)
    doomed = eng.submit(list(range(10, 30)), greedy(8))
    eng.run_until_idle()
    out = collect(doomed)[0]
    assert out["finish"] == "error" and "out of memory" in out["deltas"][-1].error
    fine = eng.submit(list(range(10, 30)), greedy(8))
    eng.run_until_idle()
    assert collect(fine)[0]["finish"] == "length"


def test_a_job_alone_is_recomputed_once_the_prefix_cache_is_freed(tiny_model, make_engine,
                                                                  monkeypatch):
    """The prefix cache's KV may be what a job alone lacks: it is cleared, and the job is
    recomputed rather than failed."""
    eng = make_engine(tiny_model, max_rolling_batch_size=4)
    writes = FailingWrites(eng, set(), after=1).install(monkeypatch)
    first = eng.submit(list(range(10, 40)), greedy(8))
    eng.run_until_idle()
    want = collect(first)[0]
    assert eng.prefix_cache.nbytes > 0
    writes.steps = {eng.scheduler.step + 1}
    again = eng.submit(list(range(10, 40)), greedy(8))
    eng.run_until_idle()
    got = collect(again)[0]
    assert writes.raised and eng.stats().preemptions == 1
    assert (got["finish"], got["tokens"]) == (want["finish"], want["tokens"])


def test_after_an_allocation_failure_slabs_give_back_the_rows_that_left(tiny_model, make_engine,
                                                                        monkeypatch):
    """One sub-batch (CUDA's default): the preempted job's row leaves the slab, and the slab
    moves to a block of the rows left, or a job left alone would still hold every row's
    memory and fail; outputs equal a run without the failure."""
    prompts = [list(range(10 + i, 30 + 3 * i)) for i in range(6)]

    def run(fail: set[int]) -> tuple[list[list[int]], dict[int, int]]:
        eng = make_engine(tiny_model, max_rolling_batch_size=8, max_splits=1,
                          prompt_cache_bytes=0)
        FailingWrites(eng, fail, after=1).install(monkeypatch)
        spare: dict[int, int] = {}
        eng.add_step_listener(lambda st: spare.__setitem__(st.step, sum(
            sb.allocated_bytes() - sb.claim_bytes() for sb in eng.batch.sub_batches)))
        handles = [eng.submit(p, greedy(24)) for p in prompts]
        eng.run_until_idle()
        return [collect(h)[0]["tokens"] for h in handles], spare

    want, _ = run(set())
    got, spare = run({5})
    assert got == want
    assert spare[4] > 0 and spare[6] == 0  # a spare row before; none once the row left


def test_only_rows_that_share_one_context_can_be_recomputed(tiny_model):
    params = SamplingParams(strategy="sample", n=2, max_new_tokens=8)
    job = new_job("j", [1, 2, 3], params, "sample", lambda d: None)
    assert job.recomputable  # not started
    for s in job.seqs:
        s.start(tiny_model.tokenizer, torch.device("cpu"), None)
        s.generated, s.pending_token, s.status = [s.index + 7], s.index + 7, SeqStatus.RUNNING
    assert job.recomputable  # each has chosen a token, none has fed it yet
    job.preempt()
    assert job.fill_ids == [1, 2, 3] and job.preemptions == 1
    for s in job.seqs:
        s.generated.append(9)
        s.kv_len = 4
    assert not job.recomputable  # their KV differs after the prompt
    job.seqs[1].status = SeqStatus.EOS
    assert job.recomputable  # the one left running
    job.preempt()
    assert job.fill_ids == [1, 2, 3, 7]


def test_allocation_failures_are_told_from_other_errors():
    assert out_of_memory(torch.OutOfMemoryError("CUDA out of memory"))
    assert out_of_memory(MemoryError())
    assert out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried"))
    assert not out_of_memory(RuntimeError("shape mismatch"))
    assert not out_of_memory(ValueError("can't allocate memory"))


@pytest.fixture(autouse=True)
def _quiet_warnings(caplog):
    caplog.set_level("ERROR", logger="seqgate.engine")
