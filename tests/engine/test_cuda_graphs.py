"""The piecewise graphs' forward (engine.model.cuda_graphs), run eagerly on the CPU: the padding to
a bucket, the static buffers and the hand-over between pieces and attention give the same tokens
as the model's own forward and as `generate`. Capture itself needs CUDA (scripts/gpu_check.sh)."""

from __future__ import annotations

import pytest

from engine import SamplingParams
from tests.engine.helpers import collect, reference_greedy, varied_prompts


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


def test_greedy_through_the_pieces_equals_generate(smollm2, make_engine):
    """Decode rows in up to three sub-batches and 37-token prompt chunks, padded to buckets
    (several sizes, and steps over the largest running eagerly): every output equals
    `generate`'s."""
    prompts = varied_prompts(smollm2.tokenizer, 9)
    eng = _engine(make_engine, smollm2, 24, max_rolling_batch_size=8, max_num_batched_tokens=37,
                  max_splits=3, max_sparsity=0.05)
    n = [10 + 3 * (i % 4) for i in range(len(prompts))]
    outs = _run(eng, prompts, lambda i: SamplingParams(strategy="greedy", max_new_tokens=n[i],
                                                       min_new_tokens=n[i]))
    stats = eng.runner.graphs.stats
    assert stats.forwards >= 10 and stats.eager > 0  # 37-token steps exceed the 24-token bucket
    for ids, out, k in zip(prompts, outs, n):
        assert out[0]["tokens"] == reference_greedy(smollm2.model, ids, k, k)


@pytest.mark.parametrize("params", [
    dict(strategy="contrastive", top_k=4, penalty_alpha=0.6),
    dict(strategy="sample", temperature=0.8, seed=7, logprobs=3),
])
def test_hidden_states_and_logprobs_through_the_pieces_equal_the_model_forward(
        smollm2, make_engine, params):
    """Contrastive search reads the last hidden states, and logprobs the logits: the pieces
    give what the model's own forward gives."""
    prompts = varied_prompts(smollm2.tokenizer, 5)

    def params_of(i: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=12, min_new_tokens=12, **params)

    want = _run(_engine(make_engine, smollm2, None, max_rolling_batch_size=4), prompts,
                params_of)
    eng = _engine(make_engine, smollm2, 512, max_rolling_batch_size=4)
    got = _run(eng, prompts, params_of)
    assert eng.runner.graphs.stats.forwards > 10 and eng.runner.graphs.stats.eager == 0
    for g, w in zip(got, want):
        assert g[0]["tokens"] == w[0]["tokens"]
        assert len(g[0]["logprobs"]) == len(w[0]["logprobs"])
        for a, b in zip(g[0]["logprobs"], w[0]["logprobs"]):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_a_failed_capture_leaves_its_bucket_eager(smollm2, make_engine, monkeypatch):
    """A capture that fails (injected: out of memory cannot be produced on demand on the CPU)
    sends that bucket's steps to the model's own forward; the other buckets keep the pieces and
    every output still equals `generate`'s."""
    prompts = varied_prompts(smollm2.tokenizer, 4)
    eng = _engine(make_engine, smollm2, 64, max_rolling_batch_size=4,
                  num_speculative_tokens=0)
    graphs = eng.runner.graphs
    graphs.capture = True  # the pieces go through `_captured`, which fails for one size

    tries = []

    def captured(pieces):
        tries.append(len(tries))
        if len(tries) == 1:
            raise RuntimeError("CUDA out of memory (injected)")
        return pieces

    monkeypatch.setattr(graphs, "_captured", captured)
    n = 12
    outs = _run(eng, prompts, lambda i: SamplingParams(strategy="greedy", max_new_tokens=n,
                                                       min_new_tokens=n))
    assert graphs.stats.failed == 1 and len(graphs._failed) == 1
    assert graphs.stats.forwards > 0 and graphs.stats.eager > 0
    for ids, out in zip(prompts, outs):
        assert out[0]["tokens"] == reference_greedy(smollm2.model, ids, n, n)


def test_buckets_cover_the_limit(tiny_model, make_engine):
    """A step pads to the smallest bucket that holds its tokens; the largest bucket is the first
    at or above the limit, and a step beyond it has none (it runs eagerly)."""
    eng = make_engine(tiny_model, linear_kernel="torch")
    for limit in (1, 24, 25, 512, 700):
        assert eng.runner.use_graphs(limit, capture=False)
        graphs = eng.runner.graphs
        assert graphs.sizes[0] == 1 and graphs.sizes[-1] >= limit
        assert all(b < limit for b in graphs.sizes[:-1])
        assert graphs.bucket(1) == 1 and graphs.bucket(graphs.sizes[-1] + 1) is None
        for n in (3, 17, limit):
            b = graphs.bucket(n)
            if n > graphs.sizes[-1]:
                assert b is None
                continue
            assert b in graphs.sizes and b >= n
            assert all(s < n for s in graphs.sizes if s < b)
