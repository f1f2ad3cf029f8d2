"""Shared fixtures: the real SmolLM2 (embedded GGUF, cached as safetensors), a tiny random model."""

from __future__ import annotations

import os

import pytest
import torch

from engine import Engine, EngineConfig, LoadedModel, load_model


def pytest_configure(config: pytest.Config) -> None:
    """The suite runs on the CPU, also on a machine with a GPU: its parity anchors and limits are
    the CPU's. A run that selects the `gpu` tests (`-m gpu`, scripts/gpu_check.sh) sees the GPU."""
    if "gpu" not in (config.option.markexpr or "").replace("not gpu", ""):
        os.environ["CUDA_VISIBLE_DEVICES"] = ""


@pytest.fixture(scope="session")
def ops():
    """The native library's operators (engine.kernels.native); skips where it is not built."""
    from engine.kernels import native
    from engine.model.loader import default_cache_dir

    built = native.kernels(default_cache_dir()) if native.instruction_set() else None
    if built is None:
        pytest.skip("no native kernels on this machine")
    return built


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    """The embedded default model, loaded once per test session.

    fp32 unless SEQGATE_TEST_DTYPE says otherwise: the parity anchor (greedy == `generate`) is
    asserted where the arithmetic is exact enough for token-for-token equality.
    """
    return load_model(EngineConfig(dtype=os.environ.get("SEQGATE_TEST_DTYPE", "fp32")))


@pytest.fixture(scope="session")
def tiny_model(smollm2: LoadedModel) -> LoadedModel:
    """A 2-layer randomly initialised Llama with SmolLM2's tokenizer: fast, for scheduling tests."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=smollm2.model.config.vocab_size, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=2048, eos_token_id=smollm2.model.config.eos_token_id,
        bos_token_id=smollm2.model.config.bos_token_id, tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(cfg).eval()
    return LoadedModel(model, smollm2.tokenizer, "tiny", "random", torch.device("cpu"),
                       torch.float32, 0.0, False)


@pytest.fixture
def make_engine():
    """Build engines over a loaded model; each is stopped at teardown.

    `make_engine(loaded, background=False, **config)`: without a background thread the test drives
    the engine with `step()` / `run_until_idle()`.
    """
    engines: list[Engine] = []

    def make(loaded: LoadedModel, background: bool = False, **config) -> Engine:
        eng = Engine(EngineConfig(**config), loaded=loaded)
        eng.start(background=background)
        engines.append(eng)
        return eng

    yield make
    for eng in engines:
        eng.stop(drain=False)
