"""A KV cache narrower than the model (`kv_cache_dtype`): fp16 keys and values under an fp32
model, which the decode-attention kernel widens as it reads and prompt chunks widen for SDPA.
Greedy output equals transformers `generate` over keys and values rounded to fp16 as they are
stored."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from transformers import DynamicCache

from engine import ConfigError, EngineConfig, SamplingParams
from engine.kernels import native
from engine.model import packed_forward
from engine.model.loader import default_cache_dir, kv_cache_dtype
from engine.model.prepare import original_model
from tests.engine.helpers import collect, fresh_copy, varied_prompts

CPU = torch.device("cpu")


class Fp16Cache(DynamicCache):
    """transformers' cache holding what an fp16 KV cache holds: each key and value rounded to
    fp16 when it is stored, before the attention reads it (the token's own too)."""

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return super().update(key_states.half().to(key_states.dtype),
                              value_states.half().to(value_states.dtype), layer_idx,
                              *args, **kwargs)


def generate_over_fp16_kv(model, ids: list[int], max_new: int) -> list[int]:
    with torch.inference_mode(), original_model(model):
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new, min_new_tokens=max_new,
                             do_sample=False, cache=Fp16Cache())
    return out[0, len(ids):].tolist()


def test_auto_keeps_the_models_dtype_except_for_a_quantised_fp32_cpu_model():
    f32, bf16 = torch.float32, torch.bfloat16
    assert kv_cache_dtype(EngineConfig(), f32, CPU) == f32
    assert kv_cache_dtype(EngineConfig(), bf16, CPU) == bf16
    for mode in ("int4", "int8", "w8a8"):
        assert kv_cache_dtype(EngineConfig(quantize=mode), f32, CPU) == torch.float16
        assert kv_cache_dtype(EngineConfig(quantize=mode), bf16, CPU) == bf16
        assert kv_cache_dtype(EngineConfig(quantize=mode), f32, torch.device("cuda")) == f32
    assert kv_cache_dtype(EngineConfig(quantize="int4", kv_cache_dtype="fp32"), f32, CPU) == f32
    assert kv_cache_dtype(EngineConfig(kv_cache_dtype="bf16"), f32, CPU) == bf16
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int8")


def test_auto_narrows_the_kv_only_where_the_decode_kernel_reads_it(smollm2, make_engine,
                                                                    caplog):
    """int4 on the fp32 model: fp16 KV with the packed forward and the kernel; the model's dtype
    without the kernel (every step would widen a copy) or without the packed forward (nothing
    would widen it), where asking for fp16 by hand is refused."""
    kernel = native.kernels(default_cache_dir()) is not None
    for config, narrowed in (({}, kernel), ({"decode_attention": "sdpa"}, False),
                             ({"fuse_sub_batches": False}, False)):
        # int4 rounds the layers in place: a copy each time, the shared model untouched
        eng = make_engine(fresh_copy(smollm2), quantize="int4", **config)
        assert eng.kv_dtype == (torch.float16 if narrowed else torch.float32), config
    with pytest.raises(ConfigError, match="kv_cache_dtype.*packed forward is off"):
        make_engine(smollm2, kv_cache_dtype="fp16", fuse_sub_batches=False)
    # fp16 asked for with SDPA: kept, each step widening a copy, which the log says
    with caplog.at_level(logging.WARNING, logger="seqgate.engine"):
        assert make_engine(smollm2, kv_cache_dtype="fp16", decode_attention="sdpa").kv_dtype \
            == torch.float16
    assert "widens a copy" in caplog.text


def test_an_fp16_kv_cache_decodes_as_generate_over_fp16_keys_and_values(smollm2, make_engine):
    """Three jobs together (a rolling batch, prompt chunks of 37 tokens beside decoding rows,
    no drafts) and one with drafts: every token as generate's over the rounded KV."""
    tok = smollm2.tokenizer
    wide = make_engine(smollm2)
    eng = make_engine(smollm2, kv_cache_dtype="fp16", max_num_batched_tokens=37, stall_ratio=0,
                      num_speculative_tokens=0)
    assert (eng.kv_dtype, wide.kv_dtype) == (torch.float16, torch.float32)
    assert eng.kv_budget.per_token * 2 == wide.kv_budget.per_token
    if wide.decode_kernel_layers:  # the kernel takes fp16 KV where it takes fp32
        assert eng.decode_kernel_layers == wide.decode_kernel_layers
    prompts = varied_prompts(tok, 3)
    handles = [eng.submit(p, SamplingParams(strategy="greedy", max_new_tokens=20,
                                            min_new_tokens=20)) for p in prompts]
    eng.run_until_idle()
    got = [collect(h)[0]["tokens"] for h in handles]
    want = [generate_over_fp16_kv(smollm2.model, p, 20) for p in prompts]
    assert got == want
    drafting = make_engine(smollm2, kv_cache_dtype="fp16")
    echo = tok.encode("Repeat after me: the quick brown fox jumps over the lazy dog. "
                      "The quick brown fox", add_special_tokens=False)
    h = drafting.submit(echo, SamplingParams(strategy="greedy", max_new_tokens=16,
                                             min_new_tokens=16))
    drafting.run_until_idle()
    assert collect(h)[0]["tokens"] == generate_over_fp16_kv(smollm2.model, echo, 16)


def test_an_eager_attention_model_reads_the_fp16_kv_widened(smollm2, make_engine):
    """A model on transformers' eager attention (no SDPA, so no decode kernel): the packed
    dispatcher hands it the KV in the query's dtype. Installing it there leaves the shared SDPA
    model's attention as it was (one registered function for every model had redirected the
    SDPA one to the eager attention installed last)."""
    shared = smollm2.model
    assert packed_forward.install(shared)
    ids = torch.tensor([smollm2.tokenizer.encode("Each model keeps its own attention.")])
    with torch.inference_mode():
        before = shared(ids).logits
    loaded = fresh_copy(smollm2)
    loaded.model.set_attn_implementation("eager")
    eng = make_engine(loaded, kv_cache_dtype="fp16", num_speculative_tokens=0)
    assert (eng.kv_dtype, eng.decode_kernel_layers) == (torch.float16, 0)
    prompts = varied_prompts(smollm2.tokenizer, 2)
    handles = [eng.submit(p, SamplingParams(strategy="greedy", max_new_tokens=12,
                                            min_new_tokens=12)) for p in prompts]
    eng.run_until_idle()
    assert [collect(h)[0]["tokens"] for h in handles] == \
        [generate_over_fp16_kv(loaded.model, p, 12) for p in prompts]
    with torch.inference_mode():
        assert torch.equal(shared(ids).logits, before)
    # A model built from an installed one's config (which names the dispatcher) has no
    # attention of its own kept: it runs the dispatcher's default, SDPA.
    config = copy.deepcopy(shared.config)
    config.num_hidden_layers = 2
    built = type(shared)(config).eval()
    assert built.config._attn_implementation == packed_forward.FUSED_ATTENTION
    with torch.inference_mode():
        got = built(ids).logits
        built.set_attn_implementation("sdpa")
        assert torch.equal(got, built(ids).logits)


def test_values_past_fp16s_range_saturate_in_an_fp16_kv_cache():
    """A key or value beyond fp16's range is stored as its largest finite value, not as an
    infinity (which would turn the attention over it to NaN); the rest are rounded to fp16."""
    from engine.kv.slabs import SlabLayer

    buf = [torch.zeros(2, 3, 8, 4, dtype=torch.float16) for _ in range(2)]
    layer = SlabLayer(*buf, end=0)
    keys = torch.randn(2, 3, 2, 4)
    values = torch.randn(2, 3, 2, 4)
    keys[0, 1, 0, 2], values[1, 2, 1, 3] = 1e6, -3e5
    got_k, got_v = layer.update(keys, values)
    assert torch.isfinite(got_k).all() and torch.isfinite(got_v).all()
    big = torch.finfo(torch.float16).max
    assert float(got_k[0, 1, 0, 2]) == big and float(got_v[1, 2, 1, 3]) == -big
    keys[0, 1, 0, 2], values[1, 2, 1, 3] = 0.0, 0.0
    got_k[0, 1, 0, 2], got_v[1, 2, 1, 3] = 0.0, 0.0
    assert torch.equal(got_k, keys.half()) and torch.equal(got_v, values.half())
