"""The packed forward's attention helpers, against transformers' own SDPA attention."""

from types import SimpleNamespace

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from engine.model.packed_forward import _sdpa


@pytest.mark.parametrize("rows,q_len,masked", [(1, 1, False), (4, 1, True), (4, 1, False),
                                               (2, 5, True)])
def test_single_query_attention_on_key_value_heads_equals_transformers(rows, q_len, masked):
    """One query per row runs with the query heads of a key-value group stacked (GQA without
    `enable_gqa`); the output is transformers' SDPA attention's, shape and values."""
    torch.manual_seed(0)
    module = SimpleNamespace(num_key_value_groups=3, is_causal=True)
    q = torch.randn(rows, 9, q_len, 64)
    width = 40
    # KV as the engine holds it: a view into a slab with spare columns
    k = torch.randn(rows, 3, width + 16, 64)[:, :, :width]
    v = torch.randn(rows, 3, width + 16, 64)[:, :, :width]
    mask = None
    if masked:
        mask = torch.rand(rows, 1, q_len, width) > 0.3
        mask[..., -1] = True
    got, _ = _sdpa(module, q, k, v, mask, scaling=0.125)
    want, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.125)
    assert got.shape == want.shape == (rows, q_len, 9, 64)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_len,prior", [(7, 0), (33, 50), (130, 0)])
def test_a_masked_prompt_chunk_on_key_value_heads_equals_transformers_bit_for_bit(dtype, q_len,
                                                                                 prior):
    """A prompt chunk with its causal mask runs GQA in the kernel (`enable_gqa`) instead of
    repeating the KV heads; the output is transformers' SDPA attention's, bit for bit."""
    torch.manual_seed(0)
    module = SimpleNamespace(num_key_value_groups=3, is_causal=True)
    width = prior + q_len
    q = torch.randn(1, 9, q_len, 64, dtype=dtype)
    k = torch.randn(1, 3, width + 16, 64, dtype=dtype)[:, :, :width]  # a view into a slab
    v = torch.randn(1, 3, width + 16, 64, dtype=dtype)[:, :, :width]
    mask = (torch.arange(q_len)[:, None] + prior >= torch.arange(width)[None, :])[None, None]
    got, _ = _sdpa(module, q, k, v, mask, scaling=0.125)
    want, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.125)
    assert got.shape == want.shape == (1, q_len, 9, 64) and got.is_contiguous()
    assert torch.equal(got, want)
