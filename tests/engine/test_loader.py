"""Model loading: the embedded default, its safetensors cache, dtype choice, and clear failures."""

from __future__ import annotations

import logging

import pytest
import torch

from engine import EngineConfig, ModelLoadError, load_model
from engine.loader import cpu_has_native_bf16, embedded_model_path, resolve_dtype


def test_embedded_model_second_load_reads_the_safetensors_cache(smollm2):
    # The session fixture loaded it once (writing the cache if this machine had none).
    again = load_model(EngineConfig(dtype="fp32"))
    assert again.from_cache and again.name == "SmolLM2-135M-Instruct"
    assert again.load_seconds < 10
    ids = smollm2.tokenizer.encode("cache check")
    with torch.inference_mode():
        a = smollm2.model(torch.tensor([ids])).logits
        b = again.model(torch.tensor([ids])).logits
    assert torch.equal(a, b)


def test_explicit_gguf_path_is_the_same_model():
    loaded = load_model(EngineConfig(model_id=str(embedded_model_path())))
    assert loaded.name == "SmolLM2-135M-Instruct.Q4_1" and loaded.from_cache


@pytest.mark.parametrize("model_id", ["/nonexistent/model-dir", "/nonexistent/model.gguf"])
def test_missing_model_says_which_and_why(model_id):
    with pytest.raises(ModelLoadError) as err:
        load_model(EngineConfig(model_id=model_id))
    assert model_id in str(err.value)


def test_half_precision_on_cpu_falls_back_with_a_log_line(caplog):
    with caplog.at_level(logging.WARNING, logger="seqgate.loader"):
        assert resolve_dtype("fp16", torch.device("cpu")) == torch.float32
    assert "fp16" in caplog.text
    assert resolve_dtype("bf16", torch.device("cpu")) == torch.bfloat16
    assert resolve_dtype("fp32", torch.device("cpu")) == torch.float32
    auto = torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    assert resolve_dtype("auto", torch.device("cpu")) == auto


def test_first_load_in_bf16_still_caches_fp32_weights(smollm2, tmp_path):
    """The cache holds the fp32 de-quantisation whatever dtype the first start asked for."""
    first = load_model(EngineConfig(cache_dir=str(tmp_path), dtype="bf16"))
    assert not first.from_cache and next(first.model.parameters()).dtype == torch.bfloat16
    second = load_model(EngineConfig(cache_dir=str(tmp_path), dtype="fp32"))
    assert second.from_cache
    for (name, a), (_, b) in zip(smollm2.model.named_parameters(), second.model.named_parameters()):
        assert torch.equal(a, b), name
