"""Weight-only quantisation (option.quantize): the packed kernels compute the layer of the
de-quantised weights, both paths agree, and greedy decoding of a quantised model equals
transformers' `generate` on that same model, alone and in a rolling batch."""

from __future__ import annotations

import copy

import pytest
import torch

from engine import EngineConfig, LoadedModel, SamplingParams
from engine.errors import ConfigError
from engine.model.quantize import GROUP, PackedLinear, quantize_int4, quantize_model
from tests.engine.helpers import collect, reference_greedy, varied_prompts


def _linear(rows: int, cols: int, bias: bool = False) -> torch.nn.Linear:
    torch.manual_seed(rows + cols)
    layer = torch.nn.Linear(cols, rows, bias=bias)
    return layer.float()


def test_int4_groups_on_a_4_bit_grid_are_exact():
    """Weights that already sit on a 4-bit grid per group of 32 (as the embedded GGUF's Q4_1
    blocks do) come back exactly."""
    torch.manual_seed(0)
    q = torch.randint(0, 16, (64, 4 * GROUP)).float()
    q[:, ::GROUP] = 0  # every group spans the whole grid, so min/max find its scale
    q[:, 1::GROUP] = 15
    scale = torch.rand(64, 4).repeat_interleave(GROUP, dim=1) + 0.1
    low = torch.randn(64, 4).repeat_interleave(GROUP, dim=1)
    weight = q * scale + low
    _, _, dequant = quantize_int4(weight)
    torch.testing.assert_close(dequant, weight, rtol=0, atol=1e-5)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 40])
def test_packed_linear_computes_the_dequantised_layer(bits, rows):
    """Few rows go through the packed kernel, many through the de-quantised weights: both
    compute x @ dequant(W).T (+ bias)."""
    layer = _linear(96, 2 * GROUP, bias=True)
    packed = PackedLinear(layer, bits, max_rows=4)
    x = torch.randn(rows, 2 * GROUP)
    want = torch.nn.functional.linear(x, packed.weight, packed.bias)
    torch.testing.assert_close(packed(x), want, rtol=1e-4, atol=1e-4)
    # and in a [batch, tokens, features] layout, as models call it
    torch.testing.assert_close(packed(x[None]), want[None], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bits", [4, 8])
def test_quantisation_error_is_small(bits):
    layer = _linear(128, 4 * GROUP)
    packed = PackedLinear(layer, bits)
    err = (packed.weight - layer.weight).abs().max() / layer.weight.abs().max()
    assert err < (0.07 if bits == 4 else 0.005)


def test_quantize_model_replaces_every_linear(tiny_model):
    model = copy.deepcopy(tiny_model.model)
    head = model.get_output_embeddings()
    report = quantize_model(model, "int4")
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert not linears
    assert report.int4_layers + report.int8_layers == len(packed) > 0
    # the output head keeps 8 bits; the embedding it was tied to keeps its own weights
    assert model.get_output_embeddings().bits == 8 and report.int8_layers == 1
    assert model.get_input_embeddings().weight is head.weight
    assert quantize_model(copy.deepcopy(tiny_model.model), "int8").int4_layers == 0


def test_quantize_is_validated():
    with pytest.raises(ConfigError, match="quantize"):
        EngineConfig(quantize="int3")


@pytest.fixture(scope="module")
def smollm2_int4(smollm2) -> LoadedModel:
    model = copy.deepcopy(smollm2.model)
    quantize_model(model, "int4")
    return LoadedModel(model, smollm2.tokenizer, smollm2.name, smollm2.source, smollm2.device,
                       smollm2.dtype, 0.0, False)


@pytest.mark.slow
def test_quantised_greedy_equals_generate_alone_and_batched(smollm2_int4, make_engine):
    """The anchor holds with quantisation on: one job at a time (the packed kernels decode) and
    a rolling batch of 6 (de-quantised weights for most steps, packed ones at the tail when
    few rows are left) both give generate's tokens on the same quantised model."""
    tok = smollm2_int4.tokenizer
    prompts = varied_prompts(tok, 6)
    budgets = [8 + 3 * i for i in range(len(prompts))]
    want = [reference_greedy(smollm2_int4.model, ids, n, n) for ids, n in zip(prompts, budgets)]

    eng = make_engine(smollm2_int4, prompt_cache_bytes=0)
    for ids, n, ref in list(zip(prompts, budgets, want))[:2]:
        h = eng.submit(ids, SamplingParams(strategy="greedy", max_new_tokens=n,
                                           min_new_tokens=n))
        eng.run_until_idle()
        assert collect(h)[0]["tokens"] == ref

    eng = make_engine(smollm2_int4, max_sparsity=0.05)
    handles = [eng.submit(ids, SamplingParams(strategy="greedy", max_new_tokens=n,
                                              min_new_tokens=n))
               for ids, n in zip(prompts, budgets)]
    eng.run_until_idle()
    for h, ref in zip(handles, want):
        assert collect(h)[0]["tokens"] == ref


@pytest.mark.slow
def test_quantised_model_agrees_with_the_full_precision_one(smollm2, smollm2_int4):
    """int4 layers with an int8 head stay close to fp32: the next-token distribution moves
    little and the greedy choice of most prompts' first tokens is the same."""
    tok = smollm2.tokenizer
    same = 0
    prompts = varied_prompts(tok, 8)
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            p = smollm2.model(input_ids=x).logits[0, -1].float().log_softmax(-1)
            q = smollm2_int4.model(input_ids=x).logits[0, -1].float().log_softmax(-1)
            kl = torch.sum(p.exp() * (p - q)).item()
            assert kl < 0.05, kl
            same += int(p.argmax() == q.argmax())
    assert same >= len(prompts) - 1
