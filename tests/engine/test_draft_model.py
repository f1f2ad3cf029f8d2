"""Speculative decoding with a draft model (`speculative_model`): a second model sharing the
tokenizer drafts each row's next tokens, its greedy continuation, verified in the step's forward
as prompt-lookup drafts are. Greedy output equals `generate` whatever the draft model; one that
is the served model itself has its drafts kept; a draft model with another tokenizer is refused
by name at start."""

from __future__ import annotations

import copy

import pytest
import torch

from engine import ConfigError, EngineConfig, SamplingParams
from engine.errors import ModelLoadError
from engine.model.loader import embedded_model_path
from engine.sample import speculative
from tests.engine.helpers import collect, reference_greedy
from tests.engine.test_speculative import COPYING


@pytest.fixture(autouse=True)
def drafts_always_pay(monkeypatch):
    """These tests are about what drafts do, so every step may draft."""
    monkeypatch.setattr(speculative.Payoff, "length", lambda self, rows: self.k)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(strategy="greedy", max_new_tokens=n)


def save_model(model, tokenizer, path) -> str:
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory, smollm2) -> str:
    """A 2-layer random Llama with the served model's tokenizer: its drafts are mostly wrong."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    cfg = LlamaConfig(vocab_size=smollm2.model.config.vocab_size, hidden_size=64,
                      intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=2048)
    return save_model(LlamaForCausalLM(cfg).eval(), smollm2.tokenizer,
                      tmp_path_factory.mktemp("random-draft"))


@pytest.mark.slow
def test_the_served_model_as_its_own_draft_keeps_its_drafts_and_its_output(smollm2,
                                                                           make_engine):
    """The embedded model drafting for itself: greedy output equals `generate` alone and three
    rows together, nearly every drafted token is kept (so the draft is the continuation of the
    row's context, position for position), and the caches of finished rows go."""
    prompts = [smollm2.tokenizer.encode(t) for t in
               (COPYING[0], "Once upon a time, in a quiet village,", "Write a haiku about rain.")]
    want = [reference_greedy(smollm2.model, p, 16) for p in prompts]
    eng = make_engine(smollm2, num_speculative_tokens=4, max_sparsity=1.0,
                      speculative_model=str(embedded_model_path()))
    for p, w in zip(prompts[:2], want):
        h = eng.submit(p, greedy(16))
        eng.run_until_idle()
        assert collect(h)[0]["tokens"] == w
    stats = eng.stats()
    assert stats.spec_proposed_tokens >= 20
    assert stats.spec_accepted_tokens >= 0.9 * stats.spec_proposed_tokens
    handles = [eng.submit(p, greedy(16)) for p in prompts]
    eng.run_until_idle()
    assert [collect(h)[0]["tokens"] for h in handles] == want
    assert eng.speculator.draft_model.rows <= len(prompts)
    h = eng.submit(prompts[1], greedy(12))
    for _ in range(3):  # the prompt, then two decode steps
        eng.step()
    assert eng.speculator.draft_model.rows == 1  # the three finished rows' caches went
    eng.run_until_idle()
    assert collect(h)[0]["tokens"] == want[1][:12]


def test_a_draft_model_that_guesses_wrong_leaves_greedy_output_unchanged(smollm2, make_engine,
                                                                         random_draft):
    prompts = [smollm2.tokenizer.encode(t) for t in COPYING[:2]]
    want = [reference_greedy(smollm2.model, p, 16) for p in prompts]
    eng = make_engine(smollm2, num_speculative_tokens=3, max_sparsity=1.0,
                      speculative_model=random_draft)
    h = eng.submit(prompts[0], greedy(16))
    eng.run_until_idle()
    assert collect(h)[0]["tokens"] == want[0]
    handles = [eng.submit(p, greedy(16)) for p in prompts]
    eng.run_until_idle()
    assert [collect(h)[0]["tokens"] for h in handles] == want
    stats = eng.stats()
    assert 0 <= stats.spec_accepted_tokens < stats.spec_proposed_tokens


def test_a_draft_model_with_another_tokenizer_is_refused_by_name(smollm2, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine import Engine

    tok = copy.deepcopy(smollm2.tokenizer)
    tok.add_tokens(["<seqgate-extra-token>"])
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    path = save_model(LlamaForCausalLM(cfg), tok, tmp_path / "other")
    with pytest.raises(ModelLoadError, match="speculative_model.*tokenizer differs"):
        Engine(EngineConfig(speculative_model=path), loaded=smollm2)


def test_a_draft_model_is_refused_with_tensor_parallelism():
    with pytest.raises(ConfigError, match="speculative_model"):
        EngineConfig(speculative_model="draft", tensor_parallel_degree=2)


def test_a_failing_draft_model_leaves_the_row_decoding_without_drafts(smollm2, make_engine,
                                                                      random_draft):
    ids = smollm2.tokenizer.encode(COPYING[2])
    eng = make_engine(smollm2, num_speculative_tokens=3, speculative_model=random_draft)

    def broken(**kwargs):
        raise RuntimeError("injected: out of memory")

    eng.speculator.draft_model.model = broken
    h = eng.submit(ids, greedy(8))
    eng.run_until_idle()
    out = collect(h)[0]
    assert out["finish"] == "length" and out["tokens"] == reference_greedy(smollm2.model, ids, 8)
    assert eng.stats().spec_proposed_tokens == 0 and eng.speculator.draft_model.rows == 0
