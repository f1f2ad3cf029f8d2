"""Constrained decoding in the engine: outputs match their grammar under every strategy, rows
without a grammar are untouched by their neighbours', and grammars compile once."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from engine import SamplingParams
from engine.errors import InvalidGrammar
from engine.sample.grammar import (
    MAX_MASK_SECONDS,
    Grammar,
    GrammarCompiler,
    mask_limit,
    unpack_bitmask,
)
from tests.engine.helpers import collect

# Every kind of constraint the issue names: nested objects, arrays with min/max items, enums,
# required fields, numbers with bounds, strings with patterns.
NESTED = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,12}$"},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                 "minItems": 1, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 16},
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}


def chat_prompt(tokenizer, text: str) -> list[int]:
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    return tokenizer.encode(rendered, add_special_tokens=False)


def test_sampled_outputs_validate_against_a_nested_schema(smollm2, make_engine):
    eng = make_engine(smollm2, max_rolling_batch_size=24)
    compiled = eng.grammars.compile(Grammar.json_schema(NESTED))
    ids = chat_prompt(smollm2.tokenizer, "Describe a user of our site as JSON.")
    handles = [eng.submit(ids, SamplingParams(strategy="sample", temperature=1.0, seed=seed,
                                              max_new_tokens=160, grammar=compiled))
               for seed in range(20)]
    handles += [eng.submit(ids, SamplingParams(strategy=s, max_new_tokens=160, grammar=compiled))
                for s in ("greedy", "contrastive")]
    eng.run_until_idle()
    outputs = [collect(h)[0] for h in handles]
    for out in outputs:
        assert out["finish"] == "stop", out
        jsonschema.validate(json.loads(out["text"]), NESTED)
    assert len({o["text"] for o in outputs[:20]}) > 10  # the seeds did sample
    stats = eng.stats()
    assert stats.grammar_masked_tokens == sum(len(o["tokens"]) for o in outputs)


@pytest.mark.parametrize(("grammar", "check"), [
    (Grammar.regex(r"[0-9]{3}-[0-9]{4}"), lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t)),
    (Grammar.choice(["yes", "no", "maybe later"]), lambda t: t in ("yes", "no", "maybe later")),
    (Grammar.json_object(), lambda t: isinstance(json.loads(t), dict)),
])
def test_regex_choice_and_any_object(smollm2, make_engine, grammar, check):
    eng = make_engine(smollm2)
    compiled = eng.grammars.compile(grammar)
    ids = chat_prompt(smollm2.tokenizer, "Answer in the required format.")
    handles = [eng.submit(ids, SamplingParams(strategy="sample", seed=s, max_new_tokens=64,
                                              grammar=compiled)) for s in range(3)]
    eng.run_until_idle()
    for h in handles:
        out = collect(h)[0]
        assert out["finish"] == "stop" and check(out["text"]), out["text"]


def test_rows_without_a_grammar_are_unaffected(smollm2, make_engine):
    """A free row's greedy output is the same alone and batched beside constrained rows."""
    ids = chat_prompt(smollm2.tokenizer, "Name three rivers.")
    alone = make_engine(smollm2)
    h = alone.submit(ids, SamplingParams(strategy="greedy", max_new_tokens=24))
    alone.run_until_idle()
    expected = collect(h)[0]["tokens"]

    eng = make_engine(smollm2)
    compiled = eng.grammars.compile(Grammar.json_object())
    constrained = [eng.submit(ids, SamplingParams(strategy="greedy", max_new_tokens=24,
                                                  grammar=compiled)) for _ in range(2)]
    free = eng.submit(ids, SamplingParams(strategy="greedy", max_new_tokens=24))
    eng.run_until_idle()
    assert collect(free)[0]["tokens"] == expected
    assert all(collect(h)[0]["text"].startswith("{") for h in constrained)


def test_a_complete_grammar_wins_over_min_tokens(smollm2, make_engine):
    """min_tokens blocks EOS; a grammar whose output is complete allows nothing else. The
    grammar wins and the row ends when its output is complete."""
    eng = make_engine(smollm2)
    compiled = eng.grammars.compile(Grammar.choice(["yes", "no"]))
    ids = chat_prompt(smollm2.tokenizer, "Yes or no?")
    h = eng.submit(ids, SamplingParams(strategy="greedy", max_new_tokens=10, min_new_tokens=5,
                                       grammar=compiled))
    eng.run_until_idle()
    out = collect(h)[0]
    assert out["finish"] == "stop" and out["text"] in ("yes", "no")


def test_grammars_compile_once_and_bad_ones_are_refused(smollm2):
    compiler = GrammarCompiler(smollm2.tokenizer, smollm2.model.config.vocab_size, [2],
                               capacity=2)
    a = compiler.compile(Grammar.json_schema({"type": "object", "properties": {"a": {}}}))
    again = compiler.compile(Grammar.json_schema({"type": "object", "properties": {"a": {}}}))
    assert again is a and compiler.compiled == 1
    compiler.compile(Grammar.regex("a+"))
    compiler.compile(Grammar.regex("b+"))
    assert len(compiler) == 2  # bounded: the oldest went
    for bad in (Grammar.json_schema({"type": "objectx"}), Grammar.regex("(("),
                Grammar.json_schema({"$ref": "#/nowhere"}), Grammar.lark("start: undefined_rule")):
        with pytest.raises(InvalidGrammar):
            compiler.compile(bad)
    compiled = compiler.compiled
    with pytest.raises(InvalidGrammar):
        compiler.compile(Grammar.lark("start: undefined_rule"))
    assert compiler.compiled == compiled  # the refusal came from the cache


def test_a_grammar_too_costly_per_token_is_refused(smollm2):
    """A counted repetition of a counted repetition explodes the lexer: every mask would cost
    tens of milliseconds on the engine thread. It is refused at compile."""
    compiler = GrammarCompiler(smollm2.tokenizer, smollm2.model.config.vocab_size, [2])
    with pytest.raises(InvalidGrammar, match="too expensive to enforce"):
        compiler.compile(Grammar.regex("(a{1000}){1000}"))
    big_enum = Grammar.json_schema({"enum": [f"value number {i}" for i in range(5000)]})
    assert compiler.compile(big_enum).matcher() is not None  # large but cheap per token


def test_the_mask_cost_limit_follows_the_engines_step(smollm2):
    """The limit is a quarter of the engine's decode step, within 1 and 20 ms: a grammar
    a CPU engine accepts can be too costly for a GPU engine's few-millisecond step."""
    assert mask_limit(0.0) == MAX_MASK_SECONDS  # nothing measured yet
    assert mask_limit(0.100) == pytest.approx(0.020)
    assert mask_limit(0.008) == pytest.approx(0.002)
    assert mask_limit(0.0001) == pytest.approx(0.001)
    vocab = smollm2.model.config.vocab_size
    grammar = Grammar.json_schema({"enum": [f"value number {i}" for i in range(5000)]})
    slow = GrammarCompiler(smollm2.tokenizer, vocab, [2], step_seconds=lambda: 0.1)
    assert slow.compile(grammar).matcher() is not None
    fast = GrammarCompiler(smollm2.tokenizer, vocab, [2], step_seconds=lambda: 1e-9)
    with pytest.raises(InvalidGrammar, match="too expensive to enforce"):
        # A 5000-value enum's mask costs more than the 1 ms floor only on a slow machine:
        # the floor is lowered here to make the check's effect visible.
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr("engine.sample.grammar.MIN_MASK_SECONDS", 1e-7)
            fast.compile(grammar)


def test_engine_publishes_its_step_cost_to_the_compiler(smollm2, make_engine):
    eng = make_engine(smollm2)
    ids = smollm2.tokenizer.encode("Count: one, two, three")
    eng.submit(ids, SamplingParams(strategy="greedy", max_new_tokens=12, min_new_tokens=12))
    eng.run_until_idle()
    assert eng.decode_step_seconds > 0
    assert eng.grammars._step_seconds() == eng.decode_step_seconds


def test_unpacked_bitmask_matches_bits():
    torch.manual_seed(0)
    vocab = 100
    mask = torch.randint(-(2**31), 2**31 - 1, (3, 4), dtype=torch.int32)
    allowed = unpack_bitmask(mask, vocab)
    for r in range(3):
        for t in range(vocab):
            assert bool(allowed[r, t]) == bool((int(mask[r, t // 32]) >> (t % 32)) & 1)
    wider = unpack_bitmask(mask, 130)  # a model vocabulary past the tokenizer's: forbidden
    assert wider.shape == (3, 130) and not wider[:, 128:].any()
