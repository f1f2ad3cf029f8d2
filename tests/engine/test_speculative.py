"""Speculative decoding by prompt lookup: drafts from n-grams of the row's own context, verified
in the step's forward. Greedy output equals `generate` with it on; rows that are not plain
greedy never draft; a stop inside a verified draft ends the output where it would have ended."""

from __future__ import annotations

import pytest

from engine import ConfigError, EngineConfig, SamplingParams
from engine.sample.speculative import propose, verify
from tests.engine.helpers import collect, reference_greedy

# Answers that copy from the prompt: drafts are found and accepted.
COPYING = [
    "Repeat this list exactly: red apples, green pears, yellow bananas, purple plums, orange "
    "mandarins. Repeat this list exactly: red apples,",
    "Repeat this list exactly: blue cars, white boats, black trains, silver planes, brown "
    "bikes. Repeat this list exactly: blue cars,",
    "Repeat this list exactly: north road, south lane, east street, west avenue, central "
    "square. Repeat this list exactly: north road,",
    "The code is 7 1 4 9 2 8 3 6. Say the code again: 7 1 4",
]


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(strategy="greedy", max_new_tokens=n, **kw)


def test_a_draft_is_what_followed_the_latest_earlier_occurrence_of_the_longest_tail():
    assert propose([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 3) == [7, 5, 1]  # the latest one
    assert propose([5, 6, 7, 8, 0, 6, 7, 8], 2) == [0, 6]  # a 3-gram
    assert propose([4, 4, 9, 1, 4, 9], 5) == [1, 4, 9]  # cut at the end of the context
    assert propose([1, 2, 3, 4], 4) == []  # nothing recurs
    assert propose([1, 2], 4) == []


def test_a_sub_batch_keeps_the_drafted_tokens_every_row_agreed_with():
    out = verify([[5, 6, 7], [8, 9, 1]], [[5, 6, 0, 3], [8, 2, 2, 2]])
    assert out.kept == 1 and out.tokens == [[5, 6], [8, 2]]
    out = verify([[5, 6]], [[5, 6, 4]])
    assert out.kept == 2 and out.tokens == [[5, 6, 4]]
    assert verify([[3]], [[4, 0]]).tokens == [[4]]


def test_greedy_output_equals_generate_with_speculation_on(smollm2, make_engine):
    """One row at a time and four together (one sub-batch and split), prompts that copy."""
    prompts = [smollm2.tokenizer.encode(t) for t in COPYING] + \
        [smollm2.tokenizer.encode("Once upon a time, in a quiet village,")]
    want = [reference_greedy(smollm2.model, p, 24) for p in prompts]
    eng = make_engine(smollm2, num_speculative_tokens=4)
    for p, w in zip(prompts, want):
        h = eng.submit(p, greedy(24))
        eng.run_until_idle()
        assert collect(h)[0]["tokens"] == w
    alone = eng.stats()
    assert alone.spec_accepted_tokens >= 10, "the copying prompts accept drafts"
    # Together (a sub-batch drafts only when every row of it has a draft: the copying ones).
    for max_sparsity in (1.0, 0.0):  # one sub-batch; as many as max_splits allows
        eng = make_engine(smollm2, num_speculative_tokens=4, max_sparsity=max_sparsity)
        handles = [eng.submit(p, greedy(24)) for p in prompts[:3]]
        steps = eng.run_until_idle()
        assert [collect(h)[0]["tokens"] for h in handles] == want[:3]
        assert eng.stats().spec_accepted_tokens > 0
        assert max_sparsity or max(s.sub_batches for s in steps) > 1


def test_rows_that_are_not_plain_greedy_never_draft_and_do_not_change(smollm2, make_engine):
    """Logprobs, a penalty and min_new_tokens rows beside plain ones in one sub-batch: no draft
    is fed (one row without a draft would keep the sub-batch to none), and every output equals
    the run with speculation off."""
    ids = smollm2.tokenizer.encode(COPYING[0])
    params = [greedy(12), greedy(12, logprobs=True, top_logprobs=2),
              greedy(12, repetition_penalty=1.3), greedy(12, min_new_tokens=12)]

    def run(k: int):
        eng = make_engine(smollm2, num_speculative_tokens=k, max_sparsity=1.0)
        handles = [eng.submit(ids, p) for p in params]
        eng.run_until_idle()
        return [collect(h)[0] for h in handles], eng.stats()

    (off, _), (on, stats) = run(0), run(4)
    assert [o["tokens"] for o in on] == [o["tokens"] for o in off]
    assert [len(o["logprobs"]) for o in on] == [0, 12, 0, 0]
    assert stats.spec_proposed_tokens == 0


def test_a_stop_inside_a_verified_draft_ends_the_output_where_it_would_have(smollm2,
                                                                         make_engine):
    """A stop string, a stop token and max_tokens that fall inside a kept draft; the prefix
    cache then serves the finished answer to a second turn with the same output."""
    ids = smollm2.tokenizer.encode(COPYING[0])
    plain = reference_greedy(smollm2.model, ids, 16)
    text = smollm2.tokenizer.decode(plain)
    cases = [greedy(16, stop=[text[6:12]]), greedy(16, stop_token_ids=[plain[5]]), greedy(7)]

    def run(k: int) -> list[dict]:
        eng = make_engine(smollm2, num_speculative_tokens=k)
        outs = []
        for p in cases:
            h = eng.submit(ids, p)
            eng.run_until_idle()
            outs.append(collect(h)[0])
        again = eng.submit(ids + plain[:7] + ids[:5], greedy(8))  # a turn that reuses the cache
        eng.run_until_idle()
        return outs + [collect(again)[0]]

    off, on = run(0), run(4)
    assert [(o["text"], o["finish"]) for o in on] == [(o["text"], o["finish"]) for o in off]
    assert len(on[2]["tokens"]) == 7


def test_speculation_options_are_checked():
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        EngineConfig(num_speculative_tokens=-1)
    with pytest.raises(ConfigError, match="speculative_max_rows"):
        EngineConfig(speculative_max_rows=-2)
