"""The CUDA path (marked `gpu`; skipped where torch sees no CUDA device). `scripts/gpu_check.sh`
runs these and the engine benchmarks on a GPU machine in one command.

The model is the embedded SmolLM2-135M (it fits any GPU). Parity with `generate` is asserted in
fp32 with TF32 off: reduced-precision kernels pick different tile orders for different batch
shapes, so bf16 and fp16 are checked for loading and finishing, not token equality.
"""

from __future__ import annotations

import pytest
import torch

from engine import EngineConfig, SamplingParams, load_model
from engine.model.quantize import PackedLinear
from tests.engine.helpers import collect, reference_greedy, varied_prompts

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


@pytest.fixture(scope="module")
def cuda_fp32():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return load_model(EngineConfig(device="cuda", dtype="fp32"))


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(strategy="greedy", max_new_tokens=n, min_new_tokens=n)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_loads_and_serves_in_half_precision(dtype, make_engine):
    loaded = load_model(EngineConfig(device="cuda", dtype=dtype))
    want = torch.bfloat16 if dtype == "bf16" else torch.float16
    assert loaded.device.type == "cuda"
    assert {p.dtype for p in loaded.model.parameters()} == {want}
    assert all(p.is_cuda for p in loaded.model.parameters())
    eng = make_engine(loaded, max_sparsity=0.05)
    prompts = varied_prompts(loaded.tokenizer, 6)
    handles = [eng.submit(ids, _greedy(12)) for ids in prompts]
    eng.run_until_idle()
    for h in handles:
        out = collect(h)[0]
        assert len(out["tokens"]) == 12 and out["finish"] == "length"


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "forward-per-group"])
def test_rolling_batch_with_splitting_and_cache_equals_generate(cuda_fp32, make_engine, fuse):
    """Prompts of 5 to 500 tokens and chats sharing a cached system prompt, cut into chunks by a
    37-token budget, split into sub-batches, on the GPU: each equals generate on the GPU."""
    tok = cuda_fp32.tokenizer
    eng = make_engine(cuda_fp32, max_rolling_batch_size=16, max_sparsity=0.05, max_splits=3,
                      fuse_sub_batches=fuse, max_num_batched_tokens=37)
    assert eng.packed_forward == fuse
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
    for h, ids, n in zip(handles, jobs, budgets):
        assert collect(h)[0]["tokens"] == reference_greedy(cuda_fp32.model, ids, n, n)


def test_quantize_is_ignored_on_cuda():
    loaded = load_model(EngineConfig(device="cuda", dtype="bf16", quantize="int4"))
    assert not any(isinstance(m, PackedLinear) for m in loaded.model.modules())
