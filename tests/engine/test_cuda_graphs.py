"""The piecewise graphs' forward (engine.model.cuda_graphs), run eagerly on the CPU: the padding to
a bucket, the static buffers and the hand-over between pieces and attention give the same tokens
as the model's own forward and as `generate`. Capture itself needs CUDA (scripts/gpu_check.sh)."""

from __future__ import annotations

import pytest
import torch

from engine import EngineConfig, SamplingParams, load_model
from engine.model import cuda_graphs
from tests.engine.helpers import collect, reference_greedy, varied_prompts


@pytest.fixture(scope="module")
def model():
    """The embedded model loaded for this module alone: the session's copy may carry another
    engine's block layers and native lean halves, which the graphs do not take."""
    return load_model(EngineConfig(dtype="fp32"))


def _engine(make_engine, loaded, graphs: int | None, **config):
    eng = make_engine(loaded, linear_kernel="torch", **config)
    assert not eng.cuda_graphs  # CUDA only, by default
    if graphs is not None:
        assert eng.runner.use_graphs(graphs, capture=False)
    return eng


def _run(eng, prompts, params_of) -> list[dict]:
    handles = []
    for i, ids in enumerate(prompts):
        handles.append(eng.submit(ids, params_of(i)))
        if i % 3 == 2:
            eng.step()  # later jobs join a running batch
    eng.run_until_idle()
    return [collect(h) for h in handles]


def _addresses(graphs) -> dict[str, int]:
    return {name: t.data_ptr() for name, t in vars(graphs).items() if isinstance(t, torch.Tensor)}


def test_greedy_through_the_pieces_equals_generate(model, make_engine):
    """Decode rows in up to three sub-batches and 37-token prompt chunks, padded to buckets
    (several sizes, and steps over the largest running eagerly): every output equals
    `generate`'s."""
    prompts = varied_prompts(model.tokenizer, 9)
    eng = _engine(make_engine, model, 24, max_rolling_batch_size=8, max_num_batched_tokens=37,
                  max_splits=3, max_sparsity=0.05)
    addresses = _addresses(eng.runner.graphs)
    n = [10 + 3 * (i % 4) for i in range(len(prompts))]
    outs = _run(eng, prompts, lambda i: SamplingParams(strategy="greedy", max_new_tokens=n[i],
                                                       min_new_tokens=n[i]))
    stats = eng.runner.graphs.stats
    assert stats.forwards >= 10 and stats.eager > 0  # 37-token steps exceed the 24-token bucket
    # A captured graph holds the buffers' addresses: a piece must write into them, not rebind.
    assert _addresses(eng.runner.graphs) == addresses
    for ids, out, k in zip(prompts, outs, n):
        assert out[0]["tokens"] == reference_greedy(model.model, ids, k, k)


@pytest.mark.parametrize("params", [
    dict(strategy="contrastive", top_k=4, penalty_alpha=0.6),
    dict(strategy="sample", temperature=0.8, seed=7, logprobs=3),
])
def test_hidden_states_and_logprobs_through_the_pieces_equal_the_model_forward(
        model, make_engine, params):
    """Contrastive search reads the last hidden states, and logprobs the logits: the pieces
    give what the model's own forward gives."""
    prompts = varied_prompts(model.tokenizer, 5)

    def params_of(i: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=12, min_new_tokens=12, **params)

    # 37-token steps: prompts take several chunks, and contrastive rows keep the hidden states
    # of earlier steps, which the pieces' buffers overwrite.
    want = _run(_engine(make_engine, model, None, max_rolling_batch_size=4,
                        max_num_batched_tokens=37), prompts, params_of)
    eng = _engine(make_engine, model, 512, max_rolling_batch_size=4, max_num_batched_tokens=37)
    got = _run(eng, prompts, params_of)
    assert eng.runner.graphs.stats.forwards > 10 and eng.runner.graphs.stats.eager == 0
    for g, w in zip(got, want):
        assert g[0]["tokens"] == w[0]["tokens"]
        assert len(g[0]["logprobs"]) == len(w[0]["logprobs"])
        for a, b in zip(g[0]["logprobs"], w[0]["logprobs"]):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_a_failed_capture_leaves_its_bucket_eager(model, make_engine, monkeypatch):
    """A capture that fails for good (injected: the CPU cannot capture) sends that bucket's
    steps to the model's own forward; the other buckets keep the pieces and every output still
    equals `generate`'s."""
    prompts = varied_prompts(model.tokenizer, 4)
    eng = _engine(make_engine, model, 64, max_rolling_batch_size=4,
                  num_speculative_tokens=0)
    graphs = eng.runner.graphs
    graphs.capture = True  # the pieces go through `_captured`, which fails for one size
    tries = 0

    def captured(pieces):
        nonlocal tries
        tries += 1
        if tries == 1:
            raise RuntimeError("an operation a graph cannot hold (injected)")
        return pieces

    monkeypatch.setattr(graphs, "_captured", captured)
    n = 12
    outs = _run(eng, prompts, lambda i: SamplingParams(strategy="greedy", max_new_tokens=n,
                                                       min_new_tokens=n))
    assert graphs.stats.failed == 1 and len(graphs._failed) == 1
    assert graphs.stats.forwards > 0 and graphs.stats.eager > 0
    for ids, out in zip(prompts, outs):
        assert out[0]["tokens"] == reference_greedy(model.model, ids, n, n)


def test_a_capture_out_of_memory_is_tried_again_later(model, make_engine, monkeypatch):
    """A capture that ran out of memory (injected) leaves its bucket eager for a while, then it
    is captured after all; outputs equal `generate`'s throughout."""
    monkeypatch.setattr(cuda_graphs, "RETRY_AFTER", 3)
    prompts = varied_prompts(model.tokenizer, 2)
    eng = _engine(make_engine, model, 64, max_rolling_batch_size=2, num_speculative_tokens=0)
    graphs = eng.runner.graphs
    graphs.capture = True
    tries = 0

    def captured(pieces):
        nonlocal tries
        tries += 1
        if tries == 2:  # the first decode step's bucket (the first was the prompts')
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return pieces

    monkeypatch.setattr(graphs, "_captured", captured)
    n = 16
    outs = _run(eng, prompts, lambda i: SamplingParams(strategy="greedy", max_new_tokens=n,
                                                       min_new_tokens=n))
    assert graphs.stats.failed == 1 and graphs.stats.eager >= cuda_graphs.RETRY_AFTER
    assert not graphs._failed  # tried again, and captured
    assert graphs.stats.captured == len(graphs._pieces) == tries - 1 == 2
    for ids, out in zip(prompts, outs):
        assert out[0]["tokens"] == reference_greedy(model.model, ids, n, n)


def test_a_lone_group_beyond_the_buckets_runs_its_own_forward(model, make_engine):
    """A step with one group and more tokens than the largest bucket (a long prompt's chunk,
    alone) runs the forward it ran without graphs, not the packed one."""
    ids = varied_prompts(model.tokenizer, 9)[6]  # about 300 tokens
    eng = _engine(make_engine, model, 24, max_rolling_batch_size=2)
    graphs = eng.runner.graphs
    handle = eng.submit(ids, SamplingParams(strategy="greedy", max_new_tokens=4,
                                            min_new_tokens=4))
    eng.step()  # the whole prompt in one chunk, alone
    assert graphs.stats.forwards == graphs.stats.eager == 0
    eng.run_until_idle()
    assert graphs.stats.forwards > 0
    assert collect(handle)[0]["tokens"] == reference_greedy(model.model, ids, 4, 4)


def test_buckets_cover_the_limit(tiny_model, make_engine):
    """A step pads to the smallest bucket that holds its tokens; the largest bucket is the first
    at or above the limit, and a step beyond it has none (it runs eagerly)."""
    eng = make_engine(tiny_model, linear_kernel="torch")
    for limit in (1, 24, 25, 512, 700, 2049, 5000):
        assert eng.runner.use_graphs(limit, capture=False)
        graphs = eng.runner.graphs
        assert graphs.sizes[0] == 1 and graphs.sizes[-1] >= limit
        assert all(b < limit for b in graphs.sizes[:-1])
        assert graphs.sizes == sorted(set(graphs.sizes))
        assert graphs.bucket(1) == 1 and graphs.bucket(graphs.sizes[-1] + 1) is None
        for n in (3, 17, limit):
            b = graphs.bucket(n)
            if n > graphs.sizes[-1]:
                assert b is None
                continue
            assert b in graphs.sizes and b >= n
            assert all(s < n for s in graphs.sizes if s < b)


def test_a_step_that_captures_teaches_no_costs(model, make_engine, monkeypatch):
    """A step that captured a bucket paid a one-off cost: the scheduler's step costs and the
    decode-step average learn nothing from it; the next plain step is learnt from again."""
    prompts = varied_prompts(model.tokenizer, 2)
    eng = _engine(make_engine, model, 64, max_rolling_batch_size=2, num_speculative_tokens=0)
    graphs = eng.runner.graphs
    graphs.capture = True
    monkeypatch.setattr(graphs, "_captured", lambda pieces: pieces)  # counted, not captured
    observed = []
    real = eng.scheduler.cost.observe
    monkeypatch.setattr(eng.scheduler.cost, "observe", lambda *a: (observed.append(a), real(*a)))
    for ids in prompts:
        eng.submit(ids, SamplingParams(strategy="greedy", max_new_tokens=20, min_new_tokens=20))
    for _ in range(6):  # prompts done, both rows decoding in a settled layout
        eng.step()
    learnt, average = len(observed), eng.decode_step_seconds
    assert learnt and average
    graphs._pieces.clear()  # the next plain decode step captures its bucket again
    captured = graphs.stats.captured
    eng.step()
    assert graphs.stats.captured == captured + 1
    assert len(observed) == learnt and eng.decode_step_seconds == average
    eng.step()
    assert len(observed) == learnt + 1 and eng.decode_step_seconds != average
