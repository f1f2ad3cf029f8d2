"""Tensor parallelism: one engine over 2 ranks (gloo, CPU) gives the single process's greedy
tokens; models that cannot be split are refused at start-up by name."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from engine import Engine, EngineConfig, SamplingParams
from engine.errors import ModelLoadError
from engine.sample.grammar import Grammar

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], list(range(100, 140)), [42] * 20, list(range(7, 300, 9))]


def save_llama(path, tokenizer, heads: int, kv_heads: int) -> str:
    """A small random Llama (untied output layer, so its greedy tokens vary) with SmolLM2's
    tokenizer, saved as a model directory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=16 * heads, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, max_position_embeddings=512,
                      tie_word_embeddings=False, initializer_range=0.2)
    LlamaForCausalLM(cfg).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def greedy(config: EngineConfig) -> list[list[int]]:
    engine = Engine(config)
    engine.start()
    try:
        k_proj = engine.loaded.model.model.layers[0].self_attn.k_proj.weight
        if config.tensor_parallel_degree > 1:  # this rank holds half of each layer
            from torch.distributed.tensor import DTensor

            assert torch.distributed.get_world_size() == config.tensor_parallel_degree
            assert isinstance(k_proj, DTensor)
            assert k_proj.to_local().shape[0] * 2 == k_proj.shape[0]
        handles = [engine.submit(p, SamplingParams(strategy="greedy", max_new_tokens=12,
                                                   ignore_eos=True)) for p in PROMPTS]
        # under a grammar (each rank compiles its own) and sampled (rank 0 seeds it for all)
        handles.append(engine.submit(PROMPTS[1], SamplingParams(
            strategy="greedy", max_new_tokens=12,
            grammar=engine.grammars.compile(Grammar.regex("[a-z]{3,8}")))))
        sampled = engine.submit(PROMPTS[2], SamplingParams(strategy="sample", max_new_tokens=12,
                                                           ignore_eos=True))
        # one job aborted mid-way: every rank drops it at the same step
        doomed = engine.submit(PROMPTS[0], SamplingParams(strategy="greedy", max_new_tokens=400,
                                                          ignore_eos=True))
        engine.abort(doomed.job_id)
        out = [[t for d in h.iter_sync(timeout=120) for t in d.token_ids] for h in handles]
        assert [d.finish_reason for d in doomed.iter_sync(timeout=120)][-1] == "abort"
        assert sum(len(d.token_ids) for d in sampled.iter_sync(timeout=120)) == 12
        return out
    finally:
        engine.stop()


def test_two_ranks_give_the_single_process_greedy_tokens(smollm2, tmp_path):
    model = save_llama(tmp_path / "llama", smollm2.tokenizer, heads=4, kv_heads=2)
    base = dict(model_id=model, dtype="fp32", num_threads=1)
    single = greedy(EngineConfig(**base))
    assert len({tuple(s) for s in single[:len(PROMPTS)]}) == len(PROMPTS), \
        "the test model answers alike"
    assert greedy(EngineConfig(**base, tensor_parallel_degree=2)) == single


def test_a_degree_that_does_not_divide_the_heads_is_refused_before_ranks_start(smollm2,
                                                                              tmp_path):
    model = save_llama(tmp_path / "llama", smollm2.tokenizer, heads=3, kv_heads=3)
    before = children(os.getpid())
    with pytest.raises(ModelLoadError, match="tensor_parallel_degree=2 does not divide the "
                                             "model's num_attention_heads=3"):
        Engine(EngineConfig(model_id=model, tensor_parallel_degree=2))
    assert children(os.getpid()) <= before, "a rank was started for a model that cannot split"
    assert not torch.distributed.is_initialized()


def test_gguf_models_and_clocked_policies_are_refused():
    from engine import ConfigError
    from engine.model.loader import load_model

    with pytest.raises(ModelLoadError, match="needs a model directory or hub id"):
        load_model(EngineConfig(tensor_parallel_degree=2))
    with pytest.raises(ConfigError, match="fifo when tensor_parallel_degree > 1"):
        EngineConfig(tensor_parallel_degree=2, scheduling_policy="shortest")
    with pytest.raises(ConfigError, match="none when tensor_parallel_degree > 1"):
        EngineConfig(tensor_parallel_degree=2, quantize="int4")



def children(pid: int) -> set[int]:
    """Direct children of `pid` (Linux /proc)."""
    out: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        out.update(int(c) for c in (task / "children").read_text().split())
    return out


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def test_seqgate_serve_starts_its_ranks_and_stops_them_on_sigterm(smollm2, tmp_path):
    """The CLI path: the lifespan's load thread starts rank 1; the API answers; SIGTERM ends
    both processes and the server exits 0."""
    model = save_llama(tmp_path / "llama", smollm2.tokenizer, heads=4, kv_heads=2)
    proc = subprocess.Popen(
        [sys.executable, "-m", "app", "serve", "--port", "0", "--model", model, "--dtype", "fp32",
         "--num-threads", "1", "--tensor-parallel-degree", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        for line in proc.stdout:
            if "seqgate is serving" in line:
                break
        else:
            pytest.fail("the server exited before it was ready")
        url = line.split(" at ")[1].split()[0]
        ranks = children(proc.pid)
        assert ranks, "rank 1 is not a child of the server"
        reply = httpx.post(url + "/v1/completions", timeout=60, json={
            "prompt": "Hello there", "max_tokens": 6, "temperature": 0}).json()
        assert reply["usage"]["completion_tokens"] == 6
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        deadline = time.monotonic() + 10
        while any(alive(p) for p in ranks) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(alive(p) for p in ranks), "a rank outlived the server"
    finally:
        if proc.poll() is None:
            proc.kill()
