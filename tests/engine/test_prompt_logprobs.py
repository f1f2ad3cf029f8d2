"""The prompt's log-probabilities computed in the chunked prefill equal a plain transformers
forward in fp32: in chunks, in the step's packed forward beside decoding rows, and with the
prompt in the prefix cache (which a scored prompt does not read)."""

from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from engine.model.prepare import original_model
from tests.engine.helpers import collect, reference_greedy

TOP = 3


def _prompt(tokenizer) -> list[int]:
    text = ("The history of the printing press begins in the fifteenth century, when Johannes "
            "Gutenberg combined movable metal type with an oil-based ink and a screw press.")
    return tokenizer(text)["input_ids"]


def _reference(model, ids: list[int]) -> torch.Tensor:
    """log_softmax of a plain fp32 forward: row i scores token i + 1."""
    with torch.inference_mode(), original_model(model):
        logits = model(torch.tensor([ids], device=model.device)).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def _scored(max_new: int = 4) -> SamplingParams:
    return SamplingParams(strategy="greedy", max_new_tokens=max_new, prompt_logprobs=TOP)


def _check(entries, ids: list[int], ref: torch.Tensor) -> None:
    assert entries[0] is None and len(entries) == len(ids)
    for i, entry in enumerate(entries[1:], start=1):
        row = ref[i - 1]
        assert entry.token_id == ids[i]
        assert entry.logprob == pytest.approx(row[ids[i]].item(), abs=1e-4)
        assert entry.rank == int((row > row[ids[i]]).sum()) + 1
        want = row.topk(TOP)
        assert [t for t, _ in entry.top] == want.indices.tolist()
        assert [v for _, v in entry.top] == pytest.approx(want.values.tolist(), abs=1e-4)


@pytest.mark.parametrize("chunk", [16, 2048], ids=["chunked", "whole"])
def test_prompt_logprobs_equal_a_plain_forward(smollm2, make_engine, chunk):
    ids = _prompt(smollm2.tokenizer)
    eng = make_engine(smollm2, max_num_batched_tokens=chunk, max_rolling_batch_size=4,
                      prompt_cache_bytes=0)
    handle = eng.submit(ids, _scored())
    eng.run_until_idle()
    out = collect(handle)[0]
    _check(out["deltas"][0].prompt_logprobs, ids, _reference(smollm2.model, ids))
    assert all(d.prompt_logprobs is None for d in out["deltas"][1:])  # sent once
    assert out["tokens"] == reference_greedy(smollm2.model, ids, 4)  # the answer is unchanged


def test_beside_decoding_rows_and_with_the_prompt_cached(smollm2, make_engine):
    """The packed forward scores a chunk beside a decoding row; a prompt already in the prefix
    cache is computed whole again (cached_tokens 0) and scores the same."""
    ids = _prompt(smollm2.tokenizer)
    eng = make_engine(smollm2, max_num_batched_tokens=24, max_rolling_batch_size=4)
    plain = SamplingParams(strategy="greedy", max_new_tokens=40, min_new_tokens=40)
    running = eng.submit(ids[:10], plain)
    for _ in range(3):
        eng.step()  # the first job decodes while the scored one is prefilled in chunks
    scored = eng.submit(ids, _scored())
    eng.run_until_idle()
    ref = _reference(smollm2.model, ids)
    _check(collect(scored)[0]["deltas"][0].prompt_logprobs, ids, ref)
    assert len(collect(running)[0]["tokens"]) == 40
    warm = eng.submit(ids, SamplingParams(strategy="greedy", max_new_tokens=2))
    eng.run_until_idle()
    again = eng.submit(ids, _scored())
    eng.run_until_idle()
    warm, again = collect(warm)[0], collect(again)[0]
    assert warm["deltas"][0].cached_tokens > 0 and again["deltas"][0].cached_tokens == 0
    _check(again["deltas"][0].prompt_logprobs, ids, ref)


def test_a_one_token_prompt_has_only_its_null(smollm2, make_engine):
    eng = make_engine(smollm2)
    handle = eng.submit([smollm2.tokenizer.bos_token_id or 1], _scored(2))
    eng.run_until_idle()
    out = collect(handle)[0]
    assert out["deltas"][0].prompt_logprobs == [None]
