"""The lean decoder layer computes exactly what transformers' Llama layer computes: the same
logits and KV bit for bit, in fp32 and bf16, with plain and packed int4 linear layers, with its
projections stacked and (where the int4 packing keeps them apart) without."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
from transformers.cache_utils import DynamicCache

from engine.model import llama_layers as lean
from engine.model.quantize import quantize_model
from engine.model.runner import cache_keyword


# Head sizes: 16 (key and value projections of 32 rows, which the CPU int4 layout cannot stack
# where it packs rows in blocks of 64, as on AVX512) and 64 (SmolLM2's; every projection stacks).
def tiny_llama(dtype: torch.dtype, head_dim: int = 16) -> LlamaForCausalLM:
    torch.manual_seed(0)
    heads, kv_heads = (4, 2) if head_dim == 16 else (2, 1)
    cfg = LlamaConfig(vocab_size=128, hidden_size=heads * head_dim, intermediate_size=128,
                      num_hidden_layers=3, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, max_position_embeddings=64,
                      attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).to(dtype).eval()


def int4_packs_rows_apart(rows: int, columns: int = 64) -> bool:
    """Whether this host's int4 layout packs two blocks of `rows` rows as it packs each alone
    (the layout is chosen by ISA: AVX512 interleaves rows in blocks of 64, AVX2 does not)."""
    q = torch.randint(0, 16, (2 * rows, columns), dtype=torch.int32,
                      generator=torch.Generator().manual_seed(0))
    pack = torch.ops.aten._convert_weight_to_int4pack_for_cpu
    return torch.equal(pack(q, 2), torch.cat([pack(q[:rows], 2), pack(q[rows:], 2)]))


def run(model, ids: torch.Tensor) -> tuple[list[torch.Tensor], DynamicCache]:
    """A 7-token prefill, then two one-token decode steps; every step's logits and last hidden
    states (contrastive search reads them)."""
    cache, logits = DynamicCache(), []
    with torch.inference_mode():
        for chunk in (ids[:, :7], ids[:, 7:8], ids[:, 8:9]):
            out = model(input_ids=chunk, **{cache_keyword(model): cache}, use_cache=True,
                        output_hidden_states=True)
            logits += [out.logits, out.hidden_states[-1]]
    return logits, cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("quantize", ["none", "int4"])
@pytest.mark.parametrize("head_dim", [16, 64])
def test_lean_layers_match_the_original_bit_for_bit(dtype, quantize, head_dim):
    original = tiny_llama(dtype, head_dim)
    quantize_model(original, quantize)
    leaned = copy.deepcopy(original)
    with torch.inference_mode():  # transformers hooks its output capture in on a first forward
        leaned(input_ids=torch.tensor([[1, 2]]), output_hidden_states=True)
    assert lean.install(leaned) == 3
    stacked = [vars(layer)["_lean_stacked"] for layer in leaned.model.layers]
    unstackable = quantize == "int4" and head_dim == 16 and not int4_packs_rows_apart(32)
    assert all((s is None) == unstackable for s in stacked)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    want, want_cache = run(original, ids)
    got, got_cache = run(leaned, ids)
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a, b)
    for i in range(3):
        assert torch.equal(want_cache.layers[i].keys, got_cache.layers[i].keys)
        assert torch.equal(want_cache.layers[i].values, got_cache.layers[i].values)


def test_only_plain_llama_layers_get_it():
    hooked = tiny_llama(torch.float32)
    hooked.model.layers[1].mlp.up_proj.register_forward_hook(lambda *a: None)
    assert lean.install(hooked) == 2  # the layer with a hook keeps its own forward
    assert "forward" not in vars(hooked.model.layers[1])
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64))
    assert lean.install(gpt2) == 0


def test_the_engine_gives_smollm2_lean_layers_and_the_reference_sets_them_aside(smollm2,
                                                                                make_engine):
    eng = make_engine(smollm2)
    layers = smollm2.model.config.num_hidden_layers
    assert eng.lean_layers == layers  # transformers' own output-capture hooks do not count
    with lean.original_layers(smollm2.model) as set_aside:
        assert set_aside == layers
        assert not any("forward" in vars(m) for m in smollm2.model.model.layers)
    assert all("forward" in vars(m) for m in smollm2.model.model.layers)
