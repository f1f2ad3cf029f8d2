"""The KV budget: its figures as pure functions, admission by bytes, the layout that keeps the
batch's slabs within it (proved over random workloads without a model, then on the real engine:
a budget of 8 rows serves 32 jobs with the output of an unbudgeted run), and the refusal of a
job that could not fit alone."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import engine.kv.batch as batch_module
import engine.kv.slab_sizing as sizing_module
from engine import ConfigError, EngineConfig, InvalidParams, KvBudgetExceeded, SamplingParams
from engine.config import AUTO_BATCH_ROWS
from engine.core.sizing import resolved
from engine.kv.batch import SubBatch
from engine.kv.budget import (
    AUTO_MAX_ROWS,
    PREFIX_CACHE_SHARE,
    KvBudget,
    cpu_budget,
    cuda_budget,
    kv_bytes_per_token,
    mem_available,
)
from engine.kv.rolling_batch import RollingBatch
from engine.kv.slabs import RowKV
from engine.request.job import Job, SeqStatus, Sequence
from engine.request.sampling_params import check_kv_budget, row_kv_tokens
from engine.sched.scheduler import Scheduler
from tests.engine.helpers import (
    BUDGET_NEW_TOKENS,
    budget_workload,
    collect,
    eight_rows_budget,
    unbudgeted_outputs,
)

GiB = 2**30


# -- the figures ---------------------------------------------------------------------------------

def test_cuda_budget_is_the_used_share_less_what_is_in_use():
    assert cuda_budget(80 * GiB, 20 * GiB, 0.9) == 52 * GiB
    assert cuda_budget(80 * GiB, 20 * GiB, 1.0) == 60 * GiB
    assert cuda_budget(80 * GiB, 75 * GiB, 0.9) == 0  # the model alone is past the share
    assert cuda_budget(10, 0, 0.55) == 5  # whole bytes


def test_cpu_budget_is_half_the_memory_available_shared_by_ranks(tmp_path):
    assert cpu_budget(16 * GiB) == 8 * GiB
    assert cpu_budget(16 * GiB, ranks=2) == 4 * GiB
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24683656 kB\nMemFree:  100 kB\n"
                       "MemAvailable:   1048576 kB\n")
    assert mem_available(meminfo) == GiB
    meminfo.write_text("MemTotal:       24683656 kB\n")
    assert mem_available(meminfo) is None
    assert mem_available(tmp_path / "absent") is None


def test_a_tokens_kv_bytes_come_from_the_model_config(smollm2):
    cfg = smollm2.model.config  # 30 layers, 3 KV heads of 64
    assert kv_bytes_per_token(cfg, torch.float32) == 30 * 2 * 3 * 64 * 4
    assert kv_bytes_per_token(cfg, torch.bfloat16) == 30 * 2 * 3 * 64 * 2
    assert kv_bytes_per_token(cfg, torch.bfloat16, tp_degree=3) == 30 * 2 * 1 * 64 * 2


def test_the_prefix_cache_gets_at_most_its_share_and_the_batch_the_rest():
    small = KvBudget.split(GiB, 1000, 512 * 2**20)
    assert small.prefix_cache == int(GiB * PREFIX_CACHE_SHARE) and small.batch == GiB * 3 // 4
    large = KvBudget.split(8 * GiB, 1000, 512 * 2**20)
    assert large.prefix_cache == 512 * 2**20 and large.batch == 8 * GiB - 512 * 2**20
    assert KvBudget.split(GiB, 1000, 0).batch == GiB  # the cache off: all for the batch
    assert large.batch_tokens == large.batch // 1000


def test_auto_rows_count_rows_of_2k_tokens_between_the_cpu_default_and_256():
    per_token = 128 * 1024  # Llama-3-8B in bf16
    assert KvBudget(60 * GiB, per_token, 0).auto_rows() == 240
    assert KvBudget(200 * GiB, per_token, 0).auto_rows() == AUTO_MAX_ROWS
    assert KvBudget(GiB, per_token, 0).auto_rows() == AUTO_BATCH_ROWS  # short rows fill it
    assert KvBudget(200 * GiB, per_token, 0).auto_rows(cap=100) == 100


def test_the_engine_config_on_cuda_splits_once_and_sizes_rows_from_the_budget():
    budget = KvBudget(60 * GiB, 128 * 1024, 0)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    on_gpu = resolved(EngineConfig(), budget, cuda)
    assert (on_gpu.splits, on_gpu.max_rolling_batch_size) == (1, 240)
    assert resolved(EngineConfig(max_num_batched_tokens=100), budget, cuda).batch_rows == 99
    chosen = resolved(EngineConfig(max_splits=3, max_rolling_batch_size=8), budget, cuda)
    assert (chosen.splits, chosen.batch_rows) == (3, 8)  # what the user set stands
    on_cpu = resolved(EngineConfig(), budget, cpu)
    assert (on_cpu.splits, on_cpu.batch_rows) == (3, AUTO_BATCH_ROWS)
    with pytest.raises(ConfigError) as err:
        EngineConfig(max_splits=0)
    assert err.value.field == "max_splits"


def test_config_validation():
    for bad in ({"kv_cache_bytes": -1}, {"gpu_memory_utilization": 0.0},
                {"gpu_memory_utilization": 1.5}, {"max_rolling_batch_size": -1}):
        with pytest.raises(ConfigError) as err:
            EngineConfig(**bad)
        assert err.value.field == next(iter(bad))
    auto = EngineConfig()
    assert auto.max_rolling_batch_size == 0 and auto.batch_rows == AUTO_BATCH_ROWS == 64
    assert auto.kv_cache_bytes == 0 and auto.gpu_memory_utilization == 0.9
    assert EngineConfig(max_rolling_batch_size=8).batch_rows == 8
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        EngineConfig(max_rolling_batch_size=32, max_num_batched_tokens=32)  # not above the rows
    # Automatic rows stay below a token budget that is set.
    assert EngineConfig(max_num_batched_tokens=48).batch_rows == 47
    assert EngineConfig(max_num_batched_tokens=512).batch_rows == AUTO_BATCH_ROWS


def test_a_job_that_cannot_fit_alone_names_what_to_reduce():
    budget = KvBudget(1000 * 10, 10, 0)  # 1,000 tokens for the batch

    def refusal(prompt: int, max_new: int, n: int = 1, strategy: str = "greedy"):
        params = SamplingParams(max_new_tokens=max_new, n=n)
        try:
            check_kv_budget(prompt, params, strategy, budget)
        except KvBudgetExceeded as exc:
            return exc
        return None

    assert refusal(500, 500) is None and refusal(250, 250, n=2) is None
    assert refusal(500, 501).param == "max_new_tokens"
    assert refusal(1000, 1).param == "prompt"
    assert refusal(400, 100, n=3).param == "n"  # 3 rows of 401 are past 1,000 already
    assert refusal(300, 200, n=3).param == "max_new_tokens"  # 3 rows of 301 fit
    # Contrastive rows also hold their candidates' columns.
    assert row_kv_tokens(10, SamplingParams(max_new_tokens=5, top_k=6), "contrastive") == 21
    assert refusal(500, 497, strategy="contrastive").param == "max_new_tokens"
    exc = refusal(500, 501)
    assert isinstance(exc, InvalidParams)
    assert "max_tokens is too large for this server's KV cache" in exc.message_for("max_tokens")
    assert "1001 tokens" in str(exc) and "1000 tokens" in str(exc)
    import pickle
    back = pickle.loads(pickle.dumps(exc))  # it crosses processes from a replica
    assert (back.param, str(back)) == (exc.param, str(exc))


# -- the layout within the budget, without a model ----------------------------------------------

LAYERS, HEADS, DIM = 2, 2, 4
CELL = LAYERS * 2 * HEADS * DIM * 4  # fp32 bytes of one token's KV


def _prompt_row(length: int) -> RowKV:
    return RowKV([torch.ones(HEADS, length, DIM) for _ in range(LAYERS)],
                 [torch.ones(HEADS, length, DIM) for _ in range(LAYERS)], length)


def _new_job(i: int, prompt: int, max_new: int, n: int) -> Job:
    job = Job(f"j{i}", [1] * prompt, SamplingParams(max_new_tokens=max_new, n=n), "greedy")
    job.seqs = [Sequence(job, k) for k in range(n)]
    return job


def simulate(specs: list[tuple[int, int, int, int]], budget_tokens: int, config: EngineConfig,
             on_step=None) -> tuple[list[Job], int]:
    """Run jobs (prompt, max_new_tokens, n, abort at step or 0) through the scheduler and the
    rolling batch as the engine does, one column a decode step, checking after each layout
    that the slabs and the prompts' KV hold at most the batch's budget. Returns the jobs and
    the most rows that ran at once."""
    kv = KvBudget(budget_tokens * CELL, CELL, 0)
    sched, batch = Scheduler(config, kv=kv), RollingBatch()
    jobs = [_new_job(i, p, m, n) for i, (p, m, n, _) in enumerate(specs)]
    for job in jobs:
        check_kv_budget(len(job.prompt_ids), job.params, "greedy", kv)
        sched.submit(job)
    prompts: dict[Job, RowKV] = {}
    most_rows = 0
    while sched.has_work:
        plan = sched.schedule()
        for job, (*_, abort_at) in zip(jobs, specs):
            if abort_at == plan.step:
                sched.request_abort(job.job_id)
        for job in plan.aborted:
            prompts.pop(job, None)
        if plan.groups is not None:
            joined = {job: prompts.pop(job) for job in plan.joined}
            rows = {s: row for job, row in joined.items() for s in job.seqs}
            batch.regroup(plan.groups, rows, plan.kv_limit)
        batch.make_room(plan.kv_limit)
        for chunk in plan.chunks:
            prompts.setdefault(chunk.job, _prompt_row(len(chunk.job.prompt_ids)))
        assert batch.allocated_bytes() <= plan.kv_limit
        assert batch.allocated_bytes() + sum(r.length for r in prompts.values()) * CELL \
            <= kv.batch
        assert batch.kv_bytes() <= kv.batch
        most_rows = max(most_rows, sched.slots_taken())
        if on_step is not None:
            on_step(sched)
        _decode(batch)
        _prefill(plan, prompts)
    return jobs, most_rows


def _decode(batch: RollingBatch) -> None:
    for sb in batch.sub_batches:
        new = torch.ones(sb.size, HEADS, 1, DIM)
        for layer in sb.cache.layers:
            layer.update(new, new)  # raises when the slab has no room for the column
        sb.advance()
        sb.commit([0] * sb.size)
        for s in sb.seqs:
            s.generated.append(1)
            if s.tokens_left == 0:
                s.status = SeqStatus.LENGTH


def _prefill(plan, prompts: dict[Job, RowKV]) -> None:
    for chunk in plan.chunks:
        job = chunk.job
        job.computed = chunk.stop
        if chunk.last:
            for s in job.seqs:
                s.kv_len, s.generated = len(job.prompt_ids), [1]
                if s.tokens_left == 0:
                    s.status = SeqStatus.LENGTH
            if job.done:
                prompts.pop(job)


job_specs = st.lists(st.tuples(st.integers(1, 80), st.integers(1, 60), st.integers(1, 3),
                               st.sampled_from([0, 0, 0, 3, 9, 20])), min_size=1, max_size=14)


@pytest.mark.parametrize("lazy", [False, True], ids=["device-policy", "cpu-policy"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=job_specs, spare=st.integers(0, 400), splits=st.integers(1, 3),
       max_sparsity=st.sampled_from([0.0, 0.1, 0.33, 1.0]), rows=st.integers(3, 12))
def test_the_batch_never_holds_more_than_its_budget(lazy, specs, spare, splits, max_sparsity,
                                                    rows):
    """Whatever the jobs, the partition and the joins, the slabs' blocks (spare rows and
    reserved columns included) plus the prompts being prefilled stay within the budget, and
    every job runs to its end. The budget fits the largest job alone plus `spare` tokens."""
    alone = max(n * (p + m) for p, m, n, _ in specs)
    config = EngineConfig(max_rolling_batch_size=max(rows, 3), max_splits=splits,
                          max_sparsity=max_sparsity, max_num_batched_tokens=64)
    with pytest.MonkeyPatch.context() as mp:
        for module in (batch_module, sizing_module):
            mp.setattr(module, "pages_on_write", lambda device: lazy)
        jobs, _ = simulate(specs, alone + spare, config)
    for job, (_, max_new, _, abort_at) in zip(jobs, specs):
        if not abort_at:
            assert all(len(s.generated) == max_new for s in job.seqs), job.job_id


def test_admission_charges_every_row_the_longest_reservation(monkeypatch):
    """A budget of 8 rows of 100 tokens runs 8 such jobs at once; while a 100-token job runs,
    8 rows at most, however short the others; with only 20-token jobs, the rows cap binds."""
    for module in (batch_module, sizing_module):
        monkeypatch.setattr(module, "pages_on_write", lambda device: False)
    config = EngineConfig(max_rolling_batch_size=32, max_num_batched_tokens=512)
    _, most = simulate([(80, 20, 1, 0)] * 20, 8 * 100, config)
    assert most == 8
    _, most = simulate([(10, 10, 1, 0)] * 40, 8 * 100, config)
    assert most == 32  # 32 rows of 20 tokens are 640 of the 800
    long_running = []

    def rows_beside_the_long_job(sched):
        jobs = {s.job.job_id for s in sched.running} | {j.job_id for j in sched.prefilling}
        if "j0" in jobs:
            long_running.append(sched.slots_taken())

    simulate([(80, 20, 1, 0)] + [(10, 30, 1, 0)] * 30, 8 * 100, config, rows_beside_the_long_job)
    assert max(long_running) == 8
    compacts = []
    real = SubBatch.compact

    def spy(self):
        compacts.append(self.size)
        real(self)

    monkeypatch.setattr(SubBatch, "compact", spy)
    # A workload (found by search) where a slab must grow while another holds spare room.
    simulate([(5, 15, 1, 0), (2, 42, 2, 0), (56, 12, 2, 0), (51, 29, 2, 0), (69, 3, 1, 0),
              (62, 11, 1, 0)], 329, EngineConfig(max_rolling_batch_size=8, max_splits=1,
                                                 max_num_batched_tokens=64))
    assert compacts, "a sub-batch should have given back its spare room"


# -- the engine --------------------------------------------------------------------------------

def greedy(n: int) -> SamplingParams:
    return SamplingParams(strategy="greedy", max_new_tokens=n)


@pytest.mark.parametrize("lazy", [True, False], ids=["cpu-policy", "device-policy"])
def test_a_budget_of_eight_rows_serves_32_jobs_as_an_unbudgeted_run(smollm2, make_engine,
                                                                   monkeypatch, lazy):
    """Under the device policy the measured bytes are the slabs' whole blocks."""
    for module in (batch_module, sizing_module):
        monkeypatch.setattr(module, "pages_on_write", lambda device: lazy)
    prompts = budget_workload(smollm2.tokenizer)
    want = unbudgeted_outputs(smollm2, prompts)
    budget = eight_rows_budget(smollm2, prompts)
    eng = make_engine(smollm2, max_rolling_batch_size=32, kv_cache_bytes=budget)
    assert eng.kv_budget.total == budget
    batch_budget = eng.kv_budget.batch
    assert eng.prefix_cache.capacity_bytes == budget - batch_budget
    handles = [eng.submit(p, greedy(BUDGET_NEW_TOKENS)) for p in prompts]
    stats = eng.run_until_idle()
    assert all(s.kv_bytes <= batch_budget for s in stats)
    assert 0 < eng.stats().peak_kv_bytes <= batch_budget
    assert eng.stats().kv_budget_bytes == batch_budget
    assert 8 <= max(s.running for s in stats) < 32, "the budget, not the rows cap, binds"
    for i, h in enumerate(handles):
        assert collect(h)[0]["tokens"] == want[i]["tokens"], f"job {i}"


def test_on_a_device_the_whole_blocks_stay_within_the_budget(tiny_model, make_engine,
                                                             monkeypatch):
    """Under the device policy a slab's whole block counts (spare rows, reserved columns);
    contrastive rows write their candidates' columns too."""
    for module in (batch_module, sizing_module):
        monkeypatch.setattr(module, "pages_on_write", lambda device: False)
    per_token = kv_bytes_per_token(tiny_model.model.config, tiny_model.dtype)
    eng = make_engine(tiny_model, max_rolling_batch_size=16, prompt_cache_bytes=0,
                      kv_cache_bytes=6 * 160 * per_token, max_sparsity=0.0)
    handles = []
    for i in range(12):
        params = SamplingParams(strategy="contrastive" if i % 3 == 0 else "greedy",
                                max_new_tokens=20 + 7 * i % 40, min_new_tokens=5, top_k=3)
        handles.append(eng.submit(list(range(1, 2 + 9 * i % 100)), params))
    stats = eng.run_until_idle()
    assert all(s.kv_bytes <= eng.kv_budget.batch for s in stats)
    assert max(s.running for s in stats) >= 3
    assert all(collect(h)[0]["finish"] in ("stop", "length") for h in handles)


def test_a_job_too_large_for_the_budget_is_refused_at_submission(tiny_model, make_engine):
    per_token = kv_bytes_per_token(tiny_model.model.config, tiny_model.dtype)
    eng = make_engine(tiny_model, prompt_cache_bytes=0, kv_cache_bytes=100 * per_token)
    with pytest.raises(KvBudgetExceeded) as err:
        eng.submit(list(range(1, 51)), greedy(51))
    assert err.value.param == "max_new_tokens" and err.value.limit == 100
    with pytest.raises(KvBudgetExceeded) as err:
        eng.submit(list(range(1, 101)), greedy(1))
    assert err.value.param == "prompt"
    h = eng.submit(list(range(1, 51)), greedy(50))  # exactly the budget
    eng.run_until_idle()
    assert len(collect(h)[0]["tokens"]) >= 1


def test_a_budget_below_one_token_stops_startup(tiny_model, make_engine):
    with pytest.raises(ConfigError, match="kv_cache_bytes"):
        make_engine(tiny_model, kv_cache_bytes=1)
