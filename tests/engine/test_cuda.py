"""The CUDA path (marked `gpu`; skipped where torch sees no CUDA device). `scripts/gpu_check.sh`
runs these inside the GPU check (bench/gpu_check.py), which points SEQGATE_GPU_MODEL at the
SmolLM2-shaped model it made; without it the embedded SmolLM2-135M is loaded.

cuBLAS chooses kernels by shape, so even fp32 with TF32 off is not batch-invariant on a GPU: greedy
parity is asserted by the top-2-margin rule (each engine token is the reference's argmax given the
engine's prefix, or within MARGIN of it). bf16 and fp16 are judged against fp32 by next-token KL
and top-1 agreement, and their logprobs must be finite.
"""

from __future__ import annotations

import math
import os
import statistics

import pytest
import torch

from bench.gpu_check import MARGIN, forward_logits, kl_top1, margin_report
from engine import EngineConfig, SamplingParams, load_model
from engine.model.quantize import PackedLinear
from tests.engine.helpers import collect, varied_prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SYSTEM = ("You are a careful assistant for a shipping company. Answer briefly, cite the policy "
          "section when you can, and never invent tracking numbers. Be polite and concise.")


def _chat(tok, user: str) -> list[int]:
    text = tok.apply_chat_template([{"role": "system", "content": SYSTEM},
                                    {"role": "user", "content": user}],
                                   tokenize=False, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


def _load(dtype: str, **kw):
    return load_model(EngineConfig(model_id=os.environ.get("SEQGATE_GPU_MODEL"), device="cuda",
                                   dtype=dtype, **kw))


@pytest.fixture(scope="module")
def cuda_fp32():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return _load("fp32")


def _greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(strategy="greedy", max_new_tokens=n, min_new_tokens=n, **kw)


# Mean next-token KL(fp32 || half) bounds, with room over what the GPU check measured.
HALF_KL = {"bf16": 5e-3, "fp16": 1e-3}


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_half_precision_is_close_to_fp32(dtype, cuda_fp32, make_engine):
    """The engine in half precision serves whole budgets with finite logprobs, and its model's
    next-token distributions on those outputs stay near fp32's."""
    loaded = _load(dtype)
    want = torch.bfloat16 if dtype == "bf16" else torch.float16
    assert loaded.device.type == "cuda"
    assert {p.dtype for p in loaded.model.parameters()} == {want}
    eng = make_engine(loaded, max_sparsity=0.05)
    prompts = varied_prompts(loaded.tokenizer, 6)
    handles = [eng.submit(ids, _greedy(12, logprobs=True)) for ids in prompts]
    eng.run_until_idle()
    kls = []
    for ids, h in zip(prompts, handles):
        out = collect(h)[0]
        assert len(out["tokens"]) == 12 and out["finish"] == "length"
        assert all(math.isfinite(lp.logprob) for lp in out["logprobs"]), "non-finite logprobs"
        ref = forward_logits(cuda_fp32.model, ids + out["tokens"])[len(ids) - 1:]
        kl, _ = kl_top1(ref, forward_logits(loaded.model, ids + out["tokens"])[len(ids) - 1:])
        kls += kl
    assert all(math.isfinite(k) for k in kls)
    assert statistics.fmean(kls) < HALF_KL[dtype], f"mean KL {statistics.fmean(kls):.3g}"


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "forward-per-group"])
def test_rolling_batch_with_splitting_and_cache_keeps_greedy(cuda_fp32, make_engine, fuse):
    """Prompts of 5 to 500 tokens and chats sharing a cached system prompt, cut into chunks by a
    37-token budget, split into sub-batches, on the GPU: every token is greedy's (margin rule)."""
    tok = cuda_fp32.tokenizer
    eng = make_engine(cuda_fp32, max_rolling_batch_size=16, max_sparsity=0.05, max_splits=3,
                      fuse_sub_batches=fuse, max_num_batched_tokens=37)
    assert eng.packed_forward == fuse
    # The packed forward replays CUDA graphs between attentions; one forward per group has none.
    assert eng.cuda_graphs == fuse and (eng.runner.graphs is not None) == fuse
    jobs = varied_prompts(tok, 8)
    first = eng.submit(_chat(tok, "Where is my parcel?"), _greedy(8))
    eng.run_until_idle()  # the system prompt is cached now
    chats = [_chat(tok, q) for q in ("Can I change the address?", "What is a depot?")]
    jobs += chats
    budgets = [8 + 2 * i for i in range(len(jobs))]
    handles = []
    for i, (ids, n) in enumerate(zip(jobs, budgets)):
        handles.append(eng.submit(ids, _greedy(n)))
        if i % 3 == 2:
            eng.step()  # later jobs join a running batch
    stats = eng.run_until_idle()
    assert collect(first)[0]["tokens"]
    assert max(s.sub_batches for s in stats) > 1, "splitting never happened"
    assert eng.stats().cached_tokens > 0, "the prompt cache was never hit"
    if fuse:
        assert eng.runner.graphs.stats.captured > 0 and eng.runner.graphs.stats.forwards > 0
    for h, ids, n in zip(handles, jobs, budgets):
        tokens = collect(h)[0]["tokens"]
        assert len(tokens) == n
        report = margin_report(cuda_fp32.model, ids, tokens)
        assert report["violations"] == 0, f"a token beyond the {MARGIN} margin: {report}"


def test_enforce_eager_turns_graphs_off(cuda_fp32, make_engine):
    eng = make_engine(cuda_fp32, enforce_eager=True)
    assert not eng.cuda_graphs and eng.runner.graphs is None


def test_quantize_is_ignored_on_cuda():
    loaded = _load("bf16", quantize="int4")
    assert not any(isinstance(m, PackedLinear) for m in loaded.model.modules())
