"""Rolling-batch mechanics on a tiny random model: joins, leaves, aborts, the queue bound,
failure isolation, the async stream, and the scheduler's plan without a model."""

from __future__ import annotations

import asyncio
import threading

import pytest

import engine.decoder as decoder_module
import engine.engine as engine_module
from engine import Engine, EngineConfig, EngineStopped, QueueFull, SamplingParams
from engine.job import Job, SeqStatus, Sequence
from engine.scheduler import Scheduler
from tests.engine.helpers import collect


def params(n_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(strategy="greedy", max_new_tokens=n_tokens, min_new_tokens=n_tokens, **kw)


def test_jobs_join_next_step_and_leave_when_done(tiny_model, make_engine):
    eng = make_engine(tiny_model, max_rolling_batch_size=4)
    a = eng.submit([1, 2, 3, 4], params(5))
    s1 = eng.step()
    assert s1.admitted == 1 and s1.running == 1
    b = eng.submit([5, 6], params(2))
    s2 = eng.step()
    assert s2.admitted == 1 and s2.running == 2
    # b has its 2 tokens (one from prefill, one from this decode) and leaves at the next step.
    s3 = eng.step()
    assert s3.running == 1
    eng.run_until_idle()
    assert len(collect(a)[0]["tokens"]) == 5 and len(collect(b)[0]["tokens"]) == 2
    assert eng.stats().running == 0


def test_running_set_is_capped_and_queue_bounded(tiny_model, make_engine):
    eng = make_engine(tiny_model, max_rolling_batch_size=2, job_queue_size=2)
    hs = [eng.submit([1, 2, 3], params(4)) for _ in range(4)]  # 2 run, 2 wait
    with pytest.raises(QueueFull) as err:
        eng.submit([1, 2, 3], params(4))
    assert err.value.queue_size == 2
    plan_stats = eng.step()
    assert plan_stats.running == 2 and plan_stats.queued == 2
    eng.run_until_idle()
    assert all(collect(h)[0]["finish"] == "length" for h in hs)


def test_abort_frees_the_slot_next_step(tiny_model, make_engine):
    eng = make_engine(tiny_model, max_rolling_batch_size=2)
    keep = eng.submit([1, 2, 3], params(30))
    gone = eng.submit([4, 5, 6, 7], params(30))
    for _ in range(3):
        eng.step()
    eng.abort(gone.job_id)
    st = eng.step()
    assert st.running == 1
    out = collect(gone)[0]
    # step 1 gives two tokens (prefill + first decode), steps 2 and 3 one each; none after.
    assert out["finish"] == "abort" and len(out["tokens"]) == 4
    queued = eng.submit([9, 9], params(3))
    eng.abort(queued.job_id)  # aborting a queued job removes it before it runs
    eng.run_until_idle()
    assert collect(queued)[0]["finish"] == "abort"
    assert len(collect(keep)[0]["tokens"]) == 30


def test_failing_job_fails_alone(tiny_model, make_engine, monkeypatch):
    real = decoder_module.apply_logit_bias

    def faulty(logits, seqs):
        if any(7 in s.params.logit_bias for s in seqs):
            raise RuntimeError("injected sampling fault")
        return real(logits, seqs)

    monkeypatch.setattr(decoder_module, "apply_logit_bias", faulty)
    eng = make_engine(tiny_model, max_rolling_batch_size=4)
    ids = [[1, 2, 3], [4, 5, 6, 7, 8], [9, 10]]
    alone = []
    for i in ids:
        h = eng.submit(i, params(6))
        eng.run_until_idle()
        alone.append(collect(h)[0]["tokens"])
    hs = [eng.submit(i, params(6)) for i in ids]
    bad = eng.submit([11, 12, 13], params(6, logit_bias={7: 1.0}))
    eng.run_until_idle()
    failed = collect(bad)[0]
    assert failed["finish"] == "error" and "injected" in failed["deltas"][-1].error
    assert [collect(h)[0]["tokens"] for h in hs] == alone


def test_context_and_param_errors(tiny_model, make_engine):
    from engine import ContextLengthExceeded, InvalidParams

    eng = make_engine(tiny_model, max_model_len=64)
    with pytest.raises(ContextLengthExceeded) as err:
        eng.submit(list(range(1, 60)), params(10))
    assert "maximum context length is 64" in str(err.value)
    with pytest.raises(InvalidParams) as err:
        eng.submit([1, 2], SamplingParams(temperature=3.0))
    assert err.value.param == "temperature"
    with pytest.raises(InvalidParams) as err:
        eng.submit([1, 10**9], SamplingParams())
    assert err.value.param == "prompt"


def test_async_stream_from_engine_thread(tiny_model):
    eng = Engine(EngineConfig(max_rolling_batch_size=4), loaded=tiny_model)
    eng.start()
    try:

        async def consume(ids):
            h = eng.submit(ids, params(8))
            return [d async for d in h]

        async def main():
            return await asyncio.gather(*(consume([i, i + 1, i + 2]) for i in range(1, 6)))

        results = asyncio.run(main())
        for deltas in results:
            assert sum(len(d.token_ids) for d in deltas) == 8
            assert deltas[-1].finish_reason == "length"
    finally:
        eng.stop()
    assert eng.stats().running == 0


def test_scheduler_plan_without_a_model():
    sched = Scheduler(
        EngineConfig(max_rolling_batch_size=3, job_queue_size=10, max_splits=2, max_sparsity=0.1)
    )

    def job(name, length, n=1):
        j = Job(name, list(range(1, length + 1)), SamplingParams(n=n), "greedy")
        j.seqs = [Sequence(j, i) for i in range(n)]
        return j

    jobs = [job("a", 100), job("b", 10, n=2), job("c", 5)]
    for j in jobs:
        sched.submit(j)
    plan = sched.schedule()
    assert [j.job_id for j in plan.admitted] == ["a", "b"]  # c waits: 3 slots, a + b take 3
    for j in plan.admitted:
        for s in j.seqs:
            s.kv_len = len(j.prompt_ids)
    part, groups = sched.partition()
    assert part.k == 2 and [len(g) for g in groups] == [1, 2]  # [100] and [10, 10]
    jobs[0].seqs[0].status = SeqStatus.LENGTH
    plan = sched.schedule()
    assert plan.evicted == [jobs[0].seqs[0]] and [j.job_id for j in plan.admitted] == ["c"]
    sched.request_abort("b")
    plan = sched.schedule()
    assert [j.job_id for j in plan.aborted] == ["b"]
    assert all(s.status == SeqStatus.ABORT for s in jobs[1].seqs)


def test_stop_without_drain_ends_every_stream(tiny_model):
    eng = Engine(EngineConfig(max_rolling_batch_size=1), loaded=tiny_model)
    eng.start(background=False)
    running = eng.submit([1, 2, 3], params(50))
    waiting = eng.submit([4, 5, 6], params(50))
    eng.step()
    eng.stop(drain=False)
    for h in (running, waiting):
        out = collect(h)[0]
        assert out["finish"] == "abort"  # the API answers 503 service_unavailable for it


def test_drain_timeout_lets_finished_jobs_finish_and_aborts_the_rest(tiny_model):
    eng = Engine(EngineConfig(max_rolling_batch_size=2), loaded=tiny_model)
    eng.start()
    short = eng.submit([1, 2, 3], params(3))
    long = eng.submit([4, 5, 6], params(1500))
    queued = eng.submit([7, 8, 9], params(5))
    eng.stop(drain=True, timeout=0.5)
    assert collect(short)[0]["finish"] == "length"
    assert collect(long)[0]["finish"] == "abort"
    assert collect(queued)[0]["finish"] in ("length", "abort")
    with pytest.raises(EngineStopped):
        eng.submit([1], params(1))
    assert eng.stats().running == 0 and eng.stats().queued == 0


def test_stop_while_a_step_runs_leaves_the_jobs_to_the_engine_thread(tiny_model, monkeypatch):
    """A step that outlives stop()'s join: stop returns, and the loop ends the jobs itself when
    the step returns, each stream once (no second thread touching the batch)."""
    eng = Engine(EngineConfig(max_rolling_batch_size=2, fuse_sub_batches=False), loaded=tiny_model)
    in_step, release = threading.Event(), threading.Event()
    real_decode = eng.runner.decode

    def slow_decode(*args, **kwargs):
        in_step.set()
        release.wait(10)
        return real_decode(*args, **kwargs)

    monkeypatch.setattr(eng.runner, "decode", slow_decode)
    monkeypatch.setattr(engine_module, "_STOP_JOIN_SECONDS", 0.1)
    eng.start()
    handles = [eng.submit([1, 2, 3], params(50)), eng.submit([4, 5], params(50))]
    assert in_step.wait(10)
    eng.stop(drain=False)
    assert eng._thread is not None and eng._thread.is_alive()  # the step is still running
    release.set()
    eng._thread.join(10)
    for h in handles:
        deltas = list(h.iter_sync(timeout=10))
        assert [d.finish_reason for d in deltas if d.finished] == ["abort"]
