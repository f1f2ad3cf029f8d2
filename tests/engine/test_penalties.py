"""Presence, frequency and repetition penalties, alone and together, equal a reference written
from their published definitions, token for token (greedy, tiny random model, fp32).

- presence / frequency (OpenAI): `logit[t] -= presence * (count[t] > 0) + frequency * count[t]`,
  `count` over the tokens generated so far (not the prompt).
- repetition (CTRL, as transformers and vLLM apply it): every token seen so far, prompt and
  output, has its logit divided by `r` where it is positive and multiplied by `r` where it is not.
- together: repetition first, then presence and frequency (vLLM's order).

The reference runs transformers' own forward on a plain copy of the model (an engine built over
a shared model changes its layers in place) and applies the penalties itself. Each case also
checks that the usual misreadings (a parameter dropped, negated or swapped with another, the
repetition penalty inverted or over the output alone, the additive penalties applied first) give
other tokens, so that the case can fail.
"""

from __future__ import annotations

import copy
import functools
from collections import Counter

import pytest
import torch

from engine import InvalidParams, SamplingParams

NEW_TOKENS = 24
NEUTRAL = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}

# Values chosen so that every misreading listed in `misreadings` changes the first prompt's
# greedy tokens (checked in the test); the tiny model's logits spread ~0.16, so these are large.
CASES = {
    "presence": {"presence_penalty": 0.5},
    "frequency": {"frequency_penalty": 0.3},
    "repetition": {"repetition_penalty": 2.0},
    "all-three": {"presence_penalty": -0.5, "frequency_penalty": 0.3, "repetition_penalty": 2.0},
    "all-three-repetition-below-1": {
        "presence_penalty": 0.5, "frequency_penalty": 0.6, "repetition_penalty": 0.7,
    },
}

TEXTS = [
    "The river ran quietly past the old mill, carrying leaves from the trees.",
    "Question: what did the engineers measure twice? Answer:",
]


@pytest.fixture(autouse=True)
def one_thread():
    """The tiny model's products are too small for a second thread to pay off, and one thread
    keeps this file fast when another process shares the cores (two threads then waited on each
    other: 250 vs 3 ms a forward)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def plain_copy(model: torch.nn.Module) -> torch.nn.Module:
    """`model` as transformers builds it (its config and weights, SDPA attention, fp32), without
    whatever an engine installed in it."""
    from transformers import AutoModelForCausalLM

    fresh = AutoModelForCausalLM.from_config(copy.deepcopy(model.config),
                                             attn_implementation="sdpa", dtype=torch.float32)
    fresh.load_state_dict(model.state_dict())
    return fresh.eval()


def penalise(logits: torch.Tensor, prompt: list[int], generated: list[int], *,
             presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
             repetition_penalty: float = 1.0, repetition_covers_prompt: bool = True,
             repetition_first: bool = True) -> torch.Tensor:
    """The definitions, one token at a time (the keyword options describe misreadings)."""
    out = logits.clone()

    def repetition() -> None:
        seen = set(generated) | (set(prompt) if repetition_covers_prompt else set())
        for t in seen:
            v = float(out[t])
            out[t] = v / repetition_penalty if v > 0 else v * repetition_penalty

    def additive() -> None:
        for t, count in Counter(generated).items():
            out[t] -= presence_penalty * (count > 0) + frequency_penalty * count

    for apply in (repetition, additive) if repetition_first else (additive, repetition):
        apply()
    return out


@pytest.fixture(scope="module")
def reference(tiny_model):
    """`reference(prompt, **penalties)`: greedy tokens with the penalties applied to fp32 logits
    of transformers' forward (EOS does not stop it, as with `ignore_eos`); memoised."""
    model = plain_copy(tiny_model.model)

    @functools.cache
    def greedy(prompt: tuple[int, ...], **options) -> list[int]:
        generated: list[int] = []
        with torch.inference_mode():
            for _ in range(NEW_TOKENS):
                ids = torch.tensor([list(prompt) + generated])
                logits = model(input_ids=ids, logits_to_keep=1).logits[0, -1].float()
                generated.append(int(penalise(logits, list(prompt), generated, **options).argmax()))
        return generated

    def run(prompt: list[int], **options) -> list[int]:
        return list(greedy(tuple(prompt), **options))

    run.model = model
    return run


@pytest.fixture(scope="module")
def prompts(tiny_model) -> list[list[int]]:
    return [tiny_model.tokenizer.encode(t) for t in TEXTS]


def params(**penalties) -> SamplingParams:
    return SamplingParams(strategy="greedy", max_new_tokens=NEW_TOKENS, ignore_eos=True,
                          **penalties)


def tokens_of(handle) -> list[int]:
    out: list[int] = []
    for delta in handle.iter_sync(timeout=0):
        out += delta.token_ids
    return out


def misreadings(case: dict[str, float]) -> dict[str, dict]:
    """Ways an implementation could get `case` wrong, as `penalise` options."""
    out: dict[str, dict] = {"no penalties": dict(NEUTRAL)}
    for name, value in case.items():
        out[f"{name} dropped"] = {**case, name: NEUTRAL[name]}
        if name != "repetition_penalty":
            out[f"{name} negated"] = {**case, name: -value}
    if {"presence_penalty", "frequency_penalty"} & case.keys():
        out["presence and frequency swapped"] = {
            **case, "presence_penalty": case.get("frequency_penalty", 0.0),
            "frequency_penalty": case.get("presence_penalty", 0.0)}
    if "repetition_penalty" in case:
        r = case["repetition_penalty"]
        out["repetition inverted"] = {**case, "repetition_penalty": 1 / r}
        out["repetition over the output only"] = {**case, "repetition_covers_prompt": False}
        if len(case) > 1:
            out["additive penalties first"] = {**case, "repetition_first": False}
    return out


@pytest.mark.parametrize(
    ("field", "value", "ok"),
    [("presence_penalty", 2.0, True), ("presence_penalty", -2.0, True),
     ("presence_penalty", 2.01, False), ("presence_penalty", -2.01, False),
     ("frequency_penalty", 2.0, True), ("frequency_penalty", -2.0, True),
     ("frequency_penalty", 2.5, False), ("frequency_penalty", -3.0, False),
     ("repetition_penalty", 0.01, True), ("repetition_penalty", 10.0, True),
     ("repetition_penalty", 0.0, False), ("repetition_penalty", -1.0, False)],
)
def test_penalty_ranges(field, value, ok):
    """OpenAI's [-2, 2] for presence and frequency; any positive repetition penalty."""
    p = params(**{field: value})
    if ok:
        p.validate()
    else:
        with pytest.raises(InvalidParams) as err:
            p.validate()
        assert err.value.param == field


@pytest.mark.parametrize("case", list(CASES))
def test_penalised_greedy_equals_the_definition(case, tiny_model, make_engine, reference,
                                                prompts):
    penalties = CASES[case]
    prompt = prompts[0]
    want = reference(prompt, **penalties)
    for name, options in misreadings(penalties).items():
        assert reference(prompt, **options) != want, (
            f"{case}: reading it as '{name}' gives the same tokens, so this case cannot catch it")

    eng = make_engine(tiny_model)
    h = eng.submit(prompt, params(**penalties))
    eng.run_until_idle()
    assert tokens_of(h) == want


def test_repetition_reference_equals_transformers(reference, prompts):
    """The reference's reading of the repetition penalty is transformers' own (`generate` with
    `repetition_penalty`, whose processor covers prompt and output)."""
    r = CASES["repetition"]["repetition_penalty"]
    for prompt in prompts:
        with torch.inference_mode():
            out = reference.model.generate(
                torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                do_sample=False, repetition_penalty=r, pad_token_id=0)
        assert out[0, len(prompt):].tolist() == reference(prompt, repetition_penalty=r)


def test_penalties_apply_per_row_in_a_batch(tiny_model, make_engine, reference, prompts):
    """Every case and an unpenalised row, for two prompts, in one rolling batch: each row decodes
    with its own penalties and its own counts."""
    jobs = [(prompt, penalties) for prompt in prompts
            for penalties in [{}, *CASES.values()]]
    eng = make_engine(tiny_model)
    handles = [eng.submit(prompt, params(**penalties)) for prompt, penalties in jobs]
    eng.run_until_idle()
    for (prompt, penalties), h in zip(jobs, handles):
        assert tokens_of(h) == reference(prompt, **penalties), penalties
