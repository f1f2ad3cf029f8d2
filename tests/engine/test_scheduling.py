"""Rolling-batch mechanics on a tiny random model: joins, leaves, aborts, the queue bound,
failure isolation, the async stream, and the scheduler's plan without a model."""

from __future__ import annotations

import asyncio
import math
import threading

import pytest

import engine.core.service as engine_module
import engine.kv.slab_sizing as sizing_module
import engine.sample.decoder as decoder_module
from engine import Engine, EngineConfig, EngineStopped, QueueFull, SamplingParams
from engine.request.job import Job, SeqStatus, Sequence
from engine.sched.scheduler import Scheduler
from tests.engine.helpers import collect, count_slab_columns


def params(n_tokens: int, strategy: str = "greedy", **kw) -> SamplingParams:
    return SamplingParams(strategy=strategy, max_new_tokens=n_tokens, min_new_tokens=n_tokens,
                          **kw)


def test_jobs_join_next_step_and_leave_when_done(tiny_model, make_engine):
    eng = make_engine(tiny_model, max_rolling_batch_size=4)
    a = eng.submit([1, 2, 3, 4], params(5))
    s1 = eng.step()
    assert s1.admitted == 1 and s1.running == 1
    b = eng.submit([5, 6], params(2))
    s2 = eng.step()
    assert s2.admitted == 1 and s2.running == 2
    # b's prompt ran in step 2 (its first token); it decodes its second token in step 3 and
    # leaves the batch at step 4.
    s3 = eng.step()
    assert s3.decode_rows == 2 and s3.finished == 1
    s4 = eng.step()
    assert s4.running == 1 and s4.decode_rows == 1
    eng.run_until_idle()
    assert len(collect(a)[0]["tokens"]) == 5 and len(collect(b)[0]["tokens"]) == 2
    assert eng.stats().running == 0


def test_decoding_on_a_device_moves_a_slab_log_n_times(tiny_model, make_engine, monkeypatch):
    """The engine under the device slab policy (memory taken at allocation; here on the CPU): a
    job within CHARGED_RESERVED_COLUMNS gets its whole budget when its row joins and its slab
    never moves; past it the slab doubles when full, so n decode steps move it O(log n) times,
    not every GROWTH_COLUMNS steps. Counted at the slab allocations the batch makes."""
    sizes = count_slab_columns(monkeypatch)
    eng = make_engine(tiny_model, max_rolling_batch_size=4)
    short = eng.submit([1, 2, 3, 4], params(300))
    eng.run_until_idle()
    assert len(collect(short)[0]["tokens"]) == 300
    assert len(sizes) == 1  # built once, with room for all 300 tokens
    # Past the reservation (none here, to keep the run short) the slab doubles.
    sizes.clear()
    monkeypatch.setattr(sizing_module, "CHARGED_RESERVED_COLUMNS", 0)
    n = 1000
    long = eng.submit([1, 2, 3, 4], params(n))
    eng.run_until_idle()
    assert len(collect(long)[0]["tokens"]) == n
    moves = len(sizes) - 1
    assert moves <= math.ceil(math.log2(n / sizing_module.GROWTH_COLUMNS)) + 1
    assert all(b >= 2 * a for a, b in zip(sizes, sizes[1:-1]))
    assert sizes[-1] >= 4 + n - 1  # the last move reached the rows' whole budget


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
    # step 1 gives a token (the prompt's last position), steps 2 and 3 one each; none after.
    assert out["finish"] == "abort" and len(out["tokens"]) == 3
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


def test_failing_contrastive_choice_fails_its_row_alone(tiny_model, make_engine, monkeypatch):
    """A contrastive row whose choice among its candidates raises fails alone: the other
    contrastive and greedy rows of its sub-batch go on with the tokens they get alone."""
    real = decoder_module.contrastive_scores

    def faulty(probs, hidden, context, alpha):
        if bool((alpha == 0.55).any()):
            raise RuntimeError("injected contrastive fault")
        return real(probs, hidden, context, alpha)

    monkeypatch.setattr(decoder_module, "contrastive_scores", faulty)
    eng = make_engine(tiny_model, max_rolling_batch_size=4, max_sparsity=1.0)
    jobs = [([1, 2, 3], params(6, strategy="contrastive", top_k=3)),
            ([4, 5, 6, 7, 8], params(6)),
            ([9, 10], params(6, strategy="contrastive", top_k=2, penalty_alpha=0.3))]
    alone = []
    for ids, p in jobs:
        h = eng.submit(ids, p)
        eng.run_until_idle()
        alone.append(collect(h)[0]["tokens"])
    hs = [eng.submit(ids, p) for ids, p in jobs]
    bad = eng.submit([11, 12, 13], params(6, strategy="contrastive", penalty_alpha=0.55))
    steps = eng.run_until_idle()
    assert max(st.sub_batches for st in steps) == 1  # one sub-batch: the rows chose together
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


def _job(name: str, length: int, n: int = 1, first: int = 1) -> Job:
    j = Job(name, list(range(first, first + length)), SamplingParams(n=n), "greedy")
    j.seqs = [Sequence(j, i) for i in range(n)]
    return j


def _run(plan) -> None:
    """What the engine does with a plan's chunks, without a model."""
    for c in plan.chunks:
        c.job.computed = c.stop
        if c.last:
            for s in c.job.seqs:
                s.kv_len = len(c.job.prompt_ids)


def _chunks(plan) -> list[tuple[str, int, int]]:
    return [(c.job.job_id, c.start, c.stop) for c in plan.chunks]


def _running(sched: Scheduler, job: Job) -> None:
    """Admit and prefill `job` so that its rows decode from the next step."""
    sched.submit(job)
    _run(sched.schedule())


def test_scheduler_plan_without_a_model():
    sched = Scheduler(EngineConfig(max_rolling_batch_size=4, job_queue_size=10, max_splits=2,
                                   max_sparsity=0.1, max_num_batched_tokens=40))
    r = _job("r", 5, first=500)
    _running(sched, r)  # alone in the engine: its whole prompt in one step
    a, b, c = _job("a", 100), _job("b", 10, n=2), _job("c", 5, first=300)
    for j in (a, b, c):
        sched.submit(j)
    # r decodes every step; a's 100 tokens take the rest of the budget for two steps.
    plan = sched.schedule()
    assert [j.job_id for j in plan.joined] == ["r"] and plan.decode_rows == 1
    assert [j.job_id for j in plan.admitted] == ["a"] and _chunks(plan) == [("a", 0, 39)]
    _run(plan)
    plan = sched.schedule()
    assert not plan.admitted and _chunks(plan) == [("a", 39, 78)] and plan.groups is None
    _run(plan)
    # Its last 22 tokens leave room for b (r + a + b take the 4 slots; c waits for a slot).
    plan = sched.schedule()
    assert _chunks(plan) == [("a", 78, 100), ("b", 0, 10)] and plan.chunks[0].last
    assert [j.job_id for j in plan.admitted] == ["b"]
    _run(plan)
    # Both prompts are done: their rows join, partitioned in the plan (r's group would pad
    # too much if they joined it, so the rows are partitioned anew: [100] and [10, 10, 5]).
    plan = sched.schedule()
    assert [j.job_id for j in plan.joined] == ["a", "b"] and plan.decode_rows == 4
    assert [len(g) for g in plan.groups] == [1, 3]
    assert not plan.chunks and not plan.admitted  # no free slot for c
    # a finishes and b is aborted: their rows leave, c is admitted; r's group stays.
    a.seqs[0].status = SeqStatus.LENGTH
    sched.request_abort("b")
    plan = sched.schedule()
    assert [j.job_id for j in plan.aborted] == ["b"]
    assert all(s.status == SeqStatus.ABORT for s in b.seqs)
    assert set(plan.evicted) == {a.seqs[0], *b.seqs} and plan.groups == [[r.seqs[0]]]
    assert [j.job_id for j in plan.admitted] == ["c"] and _chunks(plan) == [("c", 0, 5)]


def test_joining_rows_keep_the_layout_while_it_is_sparse_enough():
    sched = Scheduler(EngineConfig(max_rolling_batch_size=8, max_splits=3, max_sparsity=0.2,
                                   max_num_batched_tokens=4096))
    long, short = _job("long", 100), _job("short", 20, first=200)
    _running(sched, long)
    _running(sched, short)
    plan = sched.schedule()
    assert [len(g) for g in plan.groups] == [1, 1]  # [100] and [20]: 80 padded tokens is 0.67
    # A 95-token row pads the long group least (5); an 18-token one joins the short group.
    mid, small = _job("mid", 95, first=400), _job("small", 18, first=600)
    _running(sched, mid)
    _running(sched, small)
    plan = sched.schedule()
    assert plan.groups == [[long.seqs[0], mid.seqs[0]], [short.seqs[0], small.seqs[0]]]
    # A 60-token row joins the long group too: 47 padded tokens over 293 is within 0.2.
    odd = _job("odd", 60, first=800)
    _running(sched, odd)
    plan = sched.schedule()
    assert plan.groups == [[long.seqs[0], mid.seqs[0], odd.seqs[0]],
                           [short.seqs[0], small.seqs[0]]]
    # Without the 95-token row that group would pad 40 of 198 tokens (0.21): partitioned anew.
    mid.seqs[0].status = SeqStatus.EOS
    plan = sched.schedule()
    assert plan.groups == [[long.seqs[0]], [odd.seqs[0]], [short.seqs[0], small.seqs[0]]]
    # Rows leaving a layout that stays sparse enough keep everyone else where they are.
    small.seqs[0].status = SeqStatus.EOS
    plan = sched.schedule()
    assert plan.groups == [[long.seqs[0]], [odd.seqs[0]], [short.seqs[0]]]


def test_chunks_are_charged_for_their_attention():
    sched = Scheduler(EngineConfig(max_rolling_batch_size=4, max_num_batched_tokens=120),
                      attention_tokens=100)
    _running(sched, _job("r", 4, first=900))
    long = _job("long", 1000)
    sched.submit(long)
    sizes = []
    plan = sched.schedule()
    while plan.chunks:
        c = plan.chunks[0]
        sizes.append(c.tokens)
        assert sched.chunk_cost(c.start, c.tokens) <= 119 or c.tokens == 1
        if c.stop < 1000:  # the largest chunk that fits
            assert sched.chunk_cost(c.start, c.tokens + 1) > 119
        _run(plan)
        plan = sched.schedule()
    assert sum(sizes) == 1000
    assert sizes[0] > 3 * sizes[-1]  # later chunks attend to more context: they are shorter


def test_decode_rows_are_never_skipped_and_prompts_share_the_rest():
    sched = Scheduler(EngineConfig(max_rolling_batch_size=8, max_num_batched_tokens=20))
    short = [_job(f"s{i}", 3, first=100 * i) for i in range(6)]
    for j in short:
        sched.submit(j)
    _run(sched.schedule())  # nothing decodes yet: the six prompts go in one step
    long = _job("long", 50)
    sched.submit(long)
    plan = sched.schedule()
    # The six rows decode and the new prompt gets the other 14 tokens of the budget, step
    # after step, until it is done.
    assert plan.decode_rows == 6 and _chunks(plan) == [("long", 0, 14)]
    done = 14
    while done < 50:
        _run(plan)
        plan = sched.schedule()
        assert plan.decode_rows == 6 and plan.chunks[0].start == done
        done = plan.chunks[0].stop
    assert done == 50 and plan.chunks[0].last


def test_abort_of_a_prompt_mid_prefill():
    sched = Scheduler(EngineConfig(max_rolling_batch_size=4, max_num_batched_tokens=16))
    _running(sched, _job("r", 3, first=900))
    a, b = _job("a", 64), _job("b", 8, first=200)
    sched.submit(a)
    sched.submit(b)
    _run(sched.schedule())
    sched.request_abort("a")
    plan = sched.schedule()
    assert [j.job_id for j in plan.aborted] == ["a"] and a not in sched.prefilling
    assert _chunks(plan) == [("b", 0, 8)]  # b takes the budget a left
    assert sched.slots_taken() == 2


def test_admission_starts_from_the_cached_prefix():
    import torch

    from engine.kv.radix_cache import PrefixEntry, RadixPrefixCache

    cache = RadixPrefixCache(1 << 20)
    cfg = EngineConfig(max_rolling_batch_size=4, max_num_batched_tokens=64,
                       prompt_cache_min_tokens=4)
    ids = list(range(1, 41))
    kv = [torch.zeros(2, 30, 4)]
    cache.insert(ids[:30], PrefixEntry(kv, kv, None, 30))
    sched = Scheduler(cfg, cache)
    hit, whole = _job("hit", 40), _job("whole", 30)
    sched.submit(hit)
    sched.submit(whole)
    plan = sched.schedule()
    # 30 cached tokens: only the last 10 are computed. A prompt that is entirely cached still
    # computes its last token, whose logits give the first new one.
    assert _chunks(plan) == [("hit", 30, 40), ("whole", 29, 30)]
    assert hit.cached_tokens == 30 and whole.cached_tokens == 29


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


def test_token_budget_defaults_and_limits():
    from engine.errors import ConfigError

    assert EngineConfig().token_budget == 256
    assert EngineConfig(max_rolling_batch_size=256).token_budget == 512  # a full batch leaves room
    assert EngineConfig(max_num_batched_tokens=100).token_budget == 100
    with pytest.raises(ConfigError) as err:
        EngineConfig(max_rolling_batch_size=64, max_num_batched_tokens=64)
    assert "max_num_batched_tokens" in str(err.value)


def test_admission_policies_and_the_age_limit(monkeypatch):
    import engine.sched.queue as queue_module

    now = [1000.0]
    monkeypatch.setattr(queue_module.time, "monotonic", lambda: now[0])

    def order(policy: str, jobs: list[Job]) -> list[str]:
        q = queue_module.JobQueue(10, policy, age_limit=5.0)
        for j in jobs:
            q.push(j, 0)
        out = []
        while (j := q.peek()) is not None:
            q.remove(j)
            out.append(j.job_id)
        return out

    def job(name: str, length: int, priority: int, arrival: float) -> Job:
        j = Job(name, list(range(1, length + 1)), SamplingParams(priority=priority), "greedy")
        j.arrival = arrival
        return j

    jobs = [job("a", 300, 2, 999.0), job("b", 10, 1, 999.5), job("c", 50, 0, 999.9),
            job("d", 10, 0, 999.9)]
    assert order("fifo", jobs) == ["a", "b", "c", "d"]
    assert order("priority", jobs) == ["c", "d", "b", "a"]  # ties: the earlier arrival
    assert order("shortest", jobs) == ["b", "d", "c", "a"]
    now[0] = 1004.5  # a has waited 5.5 s: it goes first, then the policy's order again
    assert order("shortest", jobs) == ["a", "b", "d", "c"]
