"""Decoding strategies and stop conditions on the real model."""

from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from engine.sampling import filter_logits
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
