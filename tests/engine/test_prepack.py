"""Prepacked bf16 linear layers compute what `F.linear` computes, keep tied weights tied and
hooked layers alone, and stack with the lean layers; quantised layers' large forwards use them."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from engine import EngineConfig, SamplingParams, load_model
from engine.model import llama_layers as lean
from engine.model import prepack
from engine.model.loader import LoadedModel
from engine.model.prepack import PrepackedLinear
from engine.model.quantize import PackedLinear, quantize_model
from tests.engine.helpers import collect

pytestmark = pytest.mark.skipif(not prepack.supported(torch.empty(0, dtype=torch.bfloat16)),
                                reason="this CPU's oneDNN has no bf16 matrix products")

# On the machines measured the products were equal bit for bit; oneDNN does not promise it
# across CPUs, so the tests ask for bf16 closeness (torch.testing's bf16 tolerances).


@pytest.mark.parametrize(("out_features", "in_features"),
                         [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)])
@pytest.mark.parametrize("rows", [1, 5, 32])
def test_prepacked_products_match_f_linear(out_features, in_features, rows):
    gen = torch.Generator().manual_seed(rows)
    linear = torch.nn.Linear(in_features, out_features, bias=rows == 5, dtype=torch.bfloat16)
    x = torch.randn(2, rows, in_features, generator=gen).to(torch.bfloat16)
    with torch.inference_mode():
        want = F.linear(x, linear.weight, linear.bias)
        got = PrepackedLinear(linear)(x)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(PrepackedLinear(linear)(x[:, ::2]), want[:, ::2])  # strided


def tiny_llama(dtype: torch.dtype) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                      tie_word_embeddings=True, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).to(dtype).eval()


def test_install_replaces_bf16_linears_and_keeps_ties_and_hooks():
    model = tiny_llama(torch.bfloat16)
    model.model.layers[1].mlp.up_proj.register_forward_hook(lambda *a: None)
    assert prepack.install(model) == 2 * 7 + 1 - 1  # 7 per layer and the head, less the hooked
    assert type(model.model.layers[1].mlp.up_proj) is torch.nn.Linear
    assert type(model.lm_head) is PrepackedLinear
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert prepack.install(tiny_llama(torch.float32)) == 0  # bf16 only


def test_prepacked_and_lean_model_matches_the_plain_one():
    plain = tiny_llama(torch.bfloat16)
    fast = copy.deepcopy(plain)
    prepack.install(fast)
    assert lean.install(fast) == 2
    stacked = vars(fast.model.layers[0])["_lean_stacked"]
    assert type(stacked.qkv) is PrepackedLinear and type(stacked.gate_up) is PrepackedLinear
    assert fast.model.layers[0].self_attn.q_proj.packed is None  # the stacked copy serves
    ids = torch.randint(0, 256, (3, 11), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        torch.testing.assert_close(fast(input_ids=ids).logits, plain(input_ids=ids).logits)
        with lean.original_layers(fast):  # the original layers run on the prepacked modules
            torch.testing.assert_close(fast(input_ids=ids).logits, plain(input_ids=ids).logits)


def test_quantised_layers_use_prepacked_weights_past_their_kernels_rows():
    model = tiny_llama(torch.bfloat16)
    quantize_model(model, "int4")
    assert prepack.install(model) == 2 * 7 + 1
    layer = model.model.layers[0].mlp.down_proj
    assert type(layer) is PackedLinear and layer.dense_packed is not None
    x = torch.randn(1, 9, 256).to(torch.bfloat16)  # 9 rows: past the int4 kernel's 4
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight))
    assert lean.install(model) == 2
    stacked = vars(model.model.layers[0])["_lean_stacked"]
    assert stacked.gate_up.dense_packed is not None
    assert model.model.layers[0].mlp.gate_proj.dense_packed is None


def test_a_bf16_engine_generates_with_prepacked_layers(smollm2, make_engine):
    # A fresh copy: engines made on the shared fixture replace its layers with block kernels.
    model = load_model(EngineConfig(dtype="fp32")).model.to(torch.bfloat16)
    loaded = LoadedModel(model, smollm2.tokenizer, "bf16", smollm2.source, smollm2.device,
                         torch.bfloat16, 0.0, False)
    eng = make_engine(loaded)
    assert eng.prepacked_layers == 30 * 7 + 1 and eng.lean_layers == 30
    ids = smollm2.tokenizer.encode("The capital of France is")
    handle = eng.submit(ids, SamplingParams(strategy="greedy", max_new_tokens=8))
    eng.run_until_idle()
    assert "Paris" in collect(handle)[0]["text"]
