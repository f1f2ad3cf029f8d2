"""The piecewise graphs' forward (engine.model.cuda_graphs), run eagerly on the CPU: the padding to
a bucket, the static buffers and the hand-over between pieces and attention give the same tokens
as the model's own forward and as `generate`. Capture itself needs CUDA (scripts/gpu_check.sh)."""

from __future__ import annotations

import pytest

from engine import SamplingParams
from engine.model import cuda_graphs
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


def test_buckets_cover_the_limit():
    """Bucket sizes rise to the first one at or above the limit."""
    assert cuda_graphs.BUCKETS[0] == 1
    for limit in (1, 24, 25, 512, 700):
        g = cuda_graphs.LayerGraphs.__new__(cuda_graphs.LayerGraphs)
        sizes = [b for b in cuda_graphs.BUCKETS if b < limit] + [
            next(b for b in cuda_graphs.BUCKETS if b >= limit)]
        assert sizes[-1] >= limit and all(b < limit for b in sizes[:-1]) and g is not None
