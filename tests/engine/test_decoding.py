"""Decoding strategies and stop conditions on the real model."""

from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from engine.sample.sampling import filter_logits, sample_rows
from tests.engine.helpers import collect, prompt_of


def run(eng, ids, **params):
    h = eng.submit(ids, SamplingParams(**params))
    eng.run_until_idle()
    return collect(h)


def contrastive_reference(
    model, ids: list[int], steps: int, k: int, alpha: float, eos: int
) -> list[int]:
    """Contrastive search from its definition, one sequence, no cache: for each of the top-k
    candidates v, score (1-alpha)·p(v) − alpha·max_j cos(h_v, h_j) over the context's last-layer
    hidden states h_j, where h_v is v's last-layer state after the context."""
    ctx, out = list(ids), []
    with torch.inference_mode():
        for _ in range(steps):
            res = model(torch.tensor([ctx]), output_hidden_states=True)
            probs = res.logits[0, -1].float().softmax(-1)
            context_h = res.hidden_states[-1][0].float()
            top = probs.topk(k)
            scores = []
            for p, v in zip(top.values.tolist(), top.indices.tolist()):
                h_v = model(torch.tensor([ctx + [v]]), output_hidden_states=True).hidden_states[-1][
                    0, -1
                ]
                sim = torch.nn.functional.cosine_similarity(
                    h_v.float()[None], context_h, dim=-1
                ).max()
                scores.append((1 - alpha) * p - alpha * float(sim))
            best = top.indices[int(torch.tensor(scores).argmax())].item()
            out.append(best)
            ctx.append(best)
            if best == eos:
                break
    return out


def test_contrastive_equals_reference(smollm2, make_engine):
    eng = make_engine(smollm2)
    tok = smollm2.tokenizer
    ids = tok.encode("The best way to learn a new language is")
    got = run(eng, ids, strategy="contrastive", top_k=4, penalty_alpha=0.6, max_new_tokens=12)[0]
    ref = contrastive_reference(smollm2.model, ids, 12, 4, 0.6, tok.eos_token_id)
    assert got["tokens"] == ref
    # It is not greedy in disguise: alpha=0 is greedy, and the outputs differ for this prompt.
    greedy = run(eng, ids, strategy="greedy", max_new_tokens=12)[0]
    alpha0 = run(eng, ids, strategy="contrastive", top_k=4, penalty_alpha=0.0, max_new_tokens=12)[0]
    assert alpha0["tokens"] == greedy["tokens"]
    assert got["tokens"] != greedy["tokens"]


def test_contrastive_in_a_mixed_batch(smollm2, make_engine):
    eng = make_engine(smollm2)
    tok = smollm2.tokenizer
    ids = tok.encode("The best way to learn a new language is")
    other = prompt_of(tok, 6, "what is measured?")
    hs = [
        eng.submit(
            ids,
            SamplingParams(strategy="contrastive", top_k=4, penalty_alpha=0.6, max_new_tokens=10),
        ),
        eng.submit(other, SamplingParams(strategy="greedy", max_new_tokens=10)),
        eng.submit(other, SamplingParams(strategy="sample", seed=3, max_new_tokens=10)),
    ]
    eng.run_until_idle()
    ref = contrastive_reference(smollm2.model, ids, 10, 4, 0.6, tok.eos_token_id)
    assert collect(hs[0])[0]["tokens"] == ref


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "forward-per-group"])
def test_contrastive_with_splitting_prefix_cache_and_chunks(smollm2, make_engine, fuse):
    """Contrastive rows of different lengths (in separate sub-batches) beside greedy and sampled
    rows, prompts cut into chunks, one prompt's prefix (with its hidden states) from the cache,
    written there by a finished contrastive answer: each contrastive output still equals the
    reference, and logprobs report the chosen tokens."""
    tok = smollm2.tokenizer
    eng = make_engine(smollm2, max_rolling_batch_size=8, max_sparsity=0.05, max_splits=3,
                      max_num_batched_tokens=37, fuse_sub_batches=fuse)
    long = prompt_of(tok, 3, "what is measured?")
    cached = run(eng, long, strategy="contrastive", top_k=4, penalty_alpha=0.6, max_new_tokens=2)
    extended = long + cached[0]["tokens"] + tok.encode(" Tell me more.")
    fresh = tok.encode(" ".join(["The best way to learn a new language is to read daily."] * 4))
    contrastive = dict(strategy="contrastive", penalty_alpha=0.6, max_new_tokens=8)
    # A row already decodes when the others arrive, so their prompts go in chunks (`fresh` in
    # two at least; the others share sentences with `long`, and most of their KV is cached).
    hs = [eng.submit(prompt_of(tok, 1, "why?"), SamplingParams(max_new_tokens=16,
                                                                min_new_tokens=16))]
    steps = [eng.step(), eng.step()]
    hs += [
        eng.submit(extended, SamplingParams(top_k=4, **contrastive)),
        eng.submit(fresh, SamplingParams(top_k=3, logprobs=True, top_logprobs=2, **contrastive)),
        eng.submit(prompt_of(tok, 5, "who?"), SamplingParams(strategy="sample", seed=1,
                                                              max_new_tokens=8)),
    ]
    steps += eng.run_until_idle()
    assert max(st.sub_batches for st in steps) > 1 and sum(st.prefill_chunks for st in steps) > 5
    assert eng.stats().cached_tokens >= len(long)
    got = [collect(h)[0] for h in hs]
    assert got[1]["tokens"] == _reference(smollm2, tuple(extended), 8, 4)
    assert got[2]["tokens"] == _reference(smollm2, tuple(fresh), 8, 3)
    assert [lp.token_id for lp in got[2]["logprobs"]] == got[2]["tokens"]
    assert all(len(lp.top) == 2 for lp in got[2]["logprobs"])


_REFERENCES: dict[tuple, list[int]] = {}  # the reference is slow: computed once per session


def _reference(loaded, ids: tuple[int, ...], steps: int, k: int) -> list[int]:
    if (ids, steps, k) not in _REFERENCES:
        _REFERENCES[ids, steps, k] = contrastive_reference(loaded.model, list(ids), steps, k, 0.6,
                                                           loaded.tokenizer.eos_token_id)
    return _REFERENCES[ids, steps, k]


def test_seeded_sampling_is_reproducible(smollm2, make_engine):
    eng = make_engine(smollm2)
    ids = smollm2.tokenizer.encode("Write a sentence about cats:")
    params = dict(strategy="sample", temperature=1.0, top_p=0.95, seed=1234, max_new_tokens=16)
    a = run(eng, ids, **params)[0]["tokens"]
    b = run(eng, ids, **params)[0]["tokens"]
    # The same seed inside a busier batch gives the same tokens too.
    hs = [
        eng.submit(ids, SamplingParams(**params)),
        eng.submit(prompt_of(smollm2.tokenizer, 3, "why?"), SamplingParams(max_new_tokens=16)),
    ]
    eng.run_until_idle()
    c = collect(hs[0])[0]["tokens"]
    assert a == b == c
    others = {tuple(run(eng, ids, **{**params, "seed": s})[0]["tokens"]) for s in range(1, 5)}
    assert len(others | {tuple(a)}) > 1, "different seeds should not all give the same text"


def test_n_sequences_share_the_prompt(smollm2, make_engine):
    eng = make_engine(smollm2, max_rolling_batch_size=4)
    ids = smollm2.tokenizer.encode("List three colours:")
    out = run(eng, ids, strategy="sample", seed=7, n=3, max_new_tokens=12)
    assert sorted(out) == [0, 1, 2]
    assert all(o["finish"] in ("stop", "length") for o in out.values())
    assert len({tuple(o["tokens"]) for o in out.values()}) > 1
    assert eng.stats().prompt_tokens == len(ids)  # one prefill for all three


def test_stop_string_across_tokens_is_cut(smollm2, make_engine):
    eng = make_engine(smollm2)
    tok = smollm2.tokenizer
    ids = tok.encode("Once upon a time, in a land far, far away, there lived a")
    full = run(eng, ids, strategy="greedy", max_new_tokens=24)[0]
    text = full["text"]
    # A stop string that spans a token boundary: the end of one token and the start of the next.
    pieces = [tok.decode([t]) for t in full["tokens"]]
    cut = len(pieces[0]) + len(pieces[1]) + len(pieces[2])
    stop = text[cut - 2 : cut + 2]
    assert len(stop) == 4 and stop in text
    got = run(eng, ids, strategy="greedy", max_new_tokens=24, stop=[stop])[0]
    assert got["finish"] == "stop"
    assert got["text"] == text[: text.index(stop)]
    assert stop not in got["text"]


def test_stop_token_ids_min_tokens_and_ignore_eos(smollm2, make_engine):
    eng = make_engine(smollm2)
    tok = smollm2.tokenizer
    ids = tok.encode("1, 2, 3,")
    full = run(eng, ids, strategy="greedy", max_new_tokens=8)[0]["tokens"]
    stopped = run(eng, ids, strategy="greedy", max_new_tokens=8, stop_token_ids=[full[2]])[0]
    assert stopped["tokens"] == full[:3] and stopped["finish"] == "stop"
    blocked = run(
        eng, ids, strategy="greedy", max_new_tokens=8, min_new_tokens=8, stop_token_ids=[full[2]]
    )[0]
    assert len(blocked["tokens"]) == 8 and blocked["finish"] == "length"
    chat = tok.encode(
        tok.apply_chat_template(
            [{"role": "user", "content": "Say hi."}], tokenize=False, add_generation_prompt=True
        )
    )
    natural = run(eng, chat, strategy="greedy", max_new_tokens=64)[0]
    assert natural["finish"] == "stop" and natural["tokens"][-1] == tok.eos_token_id
    forced = run(
        eng, chat, strategy="greedy", max_new_tokens=len(natural["tokens"]) + 4, ignore_eos=True
    )[0]
    assert forced["finish"] == "length" and len(forced["tokens"]) == len(natural["tokens"]) + 4


def test_logprobs_and_penalties(smollm2, make_engine):
    eng = make_engine(smollm2)
    ids = smollm2.tokenizer.encode("The colour of the sky is")
    got = run(eng, ids, strategy="greedy", max_new_tokens=6, logprobs=True, top_logprobs=3)[0]
    assert len(got["logprobs"]) == 6
    for tok, lp in zip(got["tokens"], got["logprobs"]):
        assert lp.token_id == tok and lp.logprob <= 0
        assert lp.top[0][0] == tok and abs(lp.top[0][1] - lp.logprob) < 1e-5  # greedy = the top one
        assert len(lp.top) == 3 and lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]
    plain = run(eng, ids, strategy="greedy", max_new_tokens=12)[0]["tokens"]
    biased = run(eng, ids, strategy="greedy", max_new_tokens=12, logit_bias={plain[0]: -100})[0]
    assert biased["tokens"][0] != plain[0]
    rep = run(eng, ids, strategy="greedy", max_new_tokens=12, frequency_penalty=2.0)[0]["tokens"]
    assert len(set(rep)) >= len(set(plain))


def test_filters_apply_per_row_in_a_batch():
    """Each row's temperature, top-k, top-p and min-p apply to that row alone (a batch of rows
    filters as each row would alone)."""
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    args = (torch.tensor([0.7, 1.0, 1.3]), torch.tensor([0, 5, 0]),
            torch.tensor([1.0, 1.0, 0.8]), torch.tensor([0.1, 0.0, 0.05]))
    batched = filter_logits(logits, *args)
    for i in range(3):
        alone = filter_logits(logits[i : i + 1], *(a[i : i + 1] for a in args))
        assert torch.equal(batched[i], alone[0])


def test_filters_skip_rows_without_one():
    """Rows with every filter off get temperature only, beside rows that sort (the mixed case
    filters a subset of rows in place)."""
    torch.manual_seed(1)
    logits = torch.randn(4, 50)
    temp = torch.tensor([0.5, 1.0, 2.0, 1.0])
    top_k, top_p, min_p = (torch.tensor([0, 3, 0, 0]), torch.tensor([1.0, 1.0, 1.0, 0.5]),
                           torch.zeros(4))
    out = filter_logits(logits, temp, top_k, top_p, min_p)
    for i in (0, 2):
        torch.testing.assert_close(out[i], logits[i] / temp[i])
    assert int(torch.isfinite(out[1]).sum()) == 3
    for i in (1, 3):
        alone = filter_logits(logits[i : i + 1], temp[i : i + 1], top_k[i : i + 1],
                              top_p[i : i + 1], min_p[i : i + 1])
        assert torch.equal(out[i], alone[0])


def _rows(n: int, seed: int | None = None, **params):
    from types import SimpleNamespace

    p = SimpleNamespace(**{"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, **params})
    return [SimpleNamespace(params=p, generator=None if seed is None else
                            torch.Generator().manual_seed(seed)) for _ in range(n)]


def test_sampling_draws_from_the_distribution():
    """The batched draw follows each row's probabilities, never picks a filtered token, and a
    seeded row draws the same tokens whatever rows it shares the batch with."""
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0])
    logits = probs.log()[None].expand(4000, -1).clone()
    gen = torch.Generator().manual_seed(0)
    picks = torch.tensor(sample_rows(logits, _rows(4000), gen))
    freq = torch.bincount(picks, minlength=4).float() / len(picks)
    assert freq[3] == 0
    torch.testing.assert_close(freq, probs, atol=0.03, rtol=0)
    # top_k=1 leaves one choice
    assert set(sample_rows(logits[:50], _rows(50, top_k=1), gen)) == {0}

    alone = [sample_rows(logits[:1], _rows(1, seed), gen)[0] for seed in range(20)]
    mixed = [sample_rows(logits[:4], _rows(3) + _rows(1, seed), gen)[3] for seed in range(20)]
    assert mixed == alone and len(set(alone)) > 1


def _reference_filter(logits, temperature, top_k, top_p, min_p):
    """The filters from their definitions, one row at a time over a full sort."""
    out = []
    for row, t, k, p, m in zip(logits, temperature, top_k, top_p, min_p):
        scaled = row / t
        probs = scaled.softmax(-1)
        order = probs.argsort(descending=True)
        keep = torch.zeros_like(probs, dtype=torch.bool)
        mass = 0.0
        for rank, tok in enumerate(order.tolist()):
            if rank == 0 or ((k == 0 or rank < k) and (p >= 1 or mass < p)
                             and probs[tok] >= m * probs[order[0]]):
                keep[tok] = True
            elif m == 0 and (k and rank >= k or p < 1 and mass >= p):
                break
            mass += float(probs[tok])
        out.append(scaled.masked_fill(~keep, float("-inf")))
    return torch.stack(out)


@pytest.mark.parametrize("spread", [0.3, 3.0, 12.0], ids=["flat", "usual", "peaked"])
def test_filters_match_their_definitions(spread):
    """Over flat distributions (the top-p cut lies beyond the partial sort's candidates) and
    peaked ones, every mix of filters keeps exactly the tokens the definitions keep."""
    torch.manual_seed(int(spread * 10))
    rows = 12
    logits = torch.randn(rows, 1000) * spread
    temperature = torch.tensor([0.7, 1.0, 1.5] * 4)
    top_k = torch.tensor([0, 0, 5, 0, 40, 0, 0, 300, 1, 0, 0, 2])
    top_p = torch.tensor([1.0, 0.9, 1.0, 0.5, 0.95, 1.0, 0.99, 1.0, 1.0, 0.3, 0.8, 0.9])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.1, 0.0, 0.05, 0.0, 0.0, 0.0, 0.0, 0.2, 0.0])
    got = filter_logits(logits, temperature, top_k, top_p, min_p)
    want = _reference_filter(logits, temperature, top_k, top_p, min_p)
    assert torch.equal(torch.isfinite(got), torch.isfinite(want))
    torch.testing.assert_close(got[torch.isfinite(got)], want[torch.isfinite(want)])
