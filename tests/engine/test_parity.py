"""Greedy output equals transformers `generate`, token for token: alone, in a rolling batch with
joins at different steps and max-sparsity splitting, and with the radix prefix cache (shared
system prompts, later turns of a conversation, prompts sharing only part of a head)."""

from __future__ import annotations

import pytest

from engine import SamplingParams
from tests.engine.helpers import collect, reference_greedy, varied_prompts


@pytest.fixture(scope="module")
def reference(smollm2):
    """`reference_greedy` over the embedded model, remembered: the four splitting cases run
    the same fourteen jobs, and generate's answer to a job does not change between them."""
    known: dict[tuple, list[int]] = {}

    def ref(ids: list[int], max_new: int, min_new: int = 0) -> list[int]:
        key = (tuple(ids), max_new, min_new)
        if key not in known:
            known[key] = reference_greedy(smollm2.model, ids, max_new, min_new)
        return known[key]

    return ref


def greedy(n: int, min_new: int = 0) -> SamplingParams:
    return SamplingParams(strategy="greedy", max_new_tokens=n, min_new_tokens=min_new)


def _render(tokenizer, msgs: list[dict[str, str]]) -> list[int]:
    return tokenizer.encode(
        tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    )


def _chat(tokenizer, system: str, user: str) -> list[int]:
    return _render(tokenizer, [{"role": "system", "content": system},
                               {"role": "user", "content": user}])


def _common(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


SYSTEM = (
    "You are a careful assistant for a shipping company. Answer briefly, cite the policy "
    "section when you can, and never invent tracking numbers. Be polite and concise."
)
QUESTIONS = [
    "Where is my parcel?",
    "Can I change the delivery address after dispatch?",
    "What does 'held at depot' mean?",
    "How do I return a damaged item?",
]


def test_single_jobs_equal_generate(smollm2, make_engine):
    eng = make_engine(smollm2)
    for ids in varied_prompts(smollm2.tokenizer, 3):
        h = eng.submit(ids, greedy(24))
        eng.run_until_idle()
        got = collect(h)[0]
        assert got["tokens"] == reference_greedy(smollm2.model, ids, 24)
        assert got["text"] == smollm2.tokenizer.decode(got["tokens"], skip_special_tokens=True)


@pytest.mark.parametrize(("fuse", "budget"), [(False, 512), (True, 512), (False, 37), (True, 37)],
                         ids=["forward-per-group", "fused", "forward-per-group-37", "fused-37"])
def test_rolling_batch_with_splitting_and_cache_equals_generate(smollm2, make_engine, reference,
                                                                 fuse, budget):
    """With a budget of 37 tokens a step, prompts are cut into chunks of 21 to 36 tokens (what
    the running rows leave), at places that move with the batch."""
    tok = smollm2.tokenizer
    # stall_ratio=0: chunks by the token budget alone, not by step costs timed on this machine,
    # so when jobs join (asserted below) does not move with the machine's speed.
    eng = make_engine(smollm2, max_rolling_batch_size=16, max_sparsity=0.05, max_splits=3,
                      fuse_sub_batches=fuse, max_num_batched_tokens=budget, stall_ratio=0)
    assert eng.packed_forward == fuse
    # Ten plain prompts of 5 to 500 tokens, and four chats sharing one cached system prompt.
    jobs = list(varied_prompts(tok, 10))
    jobs[2:2] = [_chat(tok, SYSTEM, q) for q in QUESTIONS]
    # Every job runs its whole budget (EOS blocked, on both sides): they leave at different steps.
    budgets = [10 + 3 * i for i in range(len(jobs))]
    handles, stats, i = {}, [], 0

    def submit(i: int) -> None:
        handles[i] = eng.submit(jobs[i], greedy(budgets[i], budgets[i]))

    # Three jobs start together; the rest join one every third step while the batch runs.
    for _ in range(3):
        submit(i)
        i += 1
    while eng.scheduler.has_work or i < len(jobs):
        if i < len(jobs) and len(stats) % 3 == 2:
            submit(i)
            i += 1
        stats.append(eng.step())
    assert len({s.step for s in stats if s.admitted}) >= 8, "jobs should join at different steps"
    assert max(s.sub_batches for s in stats) >= 2, "splitting should be active"
    # (A prompt prefilled over many steps joins later: fewer rows overlap at a small budget.)
    assert max(s.running for s in stats) >= (8 if budget > 100 else 6)
    assert sum(s.cached_prompt_tokens > 0 for s in stats) >= 3, "the prompt cache should hit"
    mixed = [s for s in stats if s.prefill_chunks and s.decode_rows]
    assert len(mixed) >= 5, "prompt chunks should run in the same steps as decoding rows"
    # (A step with no row decoding may take up to ALONE_TOKENS: nothing can stall.)
    assert all(s.prefill_tokens + s.decode_rows <= budget for s in stats if s.decode_rows)
    for j, h in handles.items():
        got = collect(h)[0]
        ref = reference(jobs[j], budgets[j], budgets[j])
        assert got["tokens"] == ref, f"job {j}"


def test_prompt_cache_hits_and_equals_generate(smollm2, make_engine):
    tok = smollm2.tokenizer
    eng = make_engine(smollm2, max_rolling_batch_size=8)
    jobs = [_chat(tok, SYSTEM, q) for q in QUESTIONS]
    first = eng.submit(jobs[0], greedy(20))
    eng.run_until_idle()
    rest = [eng.submit(ids, greedy(20)) for ids in jobs[1:]]
    eng.run_until_idle()
    outs = [collect(first)[0]] + [collect(h)[0] for h in rest]
    assert outs[0]["deltas"][-1].cached_tokens == 0  # the miss that filled the cache
    for i, got in enumerate(outs[1:], 1):
        # The longest head it shares with any prompt before it (all were cached).
        shared = max(_common(jobs[i], jobs[j]) for j in range(i))
        assert got["deltas"][-1].cached_tokens == shared > len(tok.encode(SYSTEM))
    for ids, got in zip(jobs, outs):
        assert got["tokens"] == reference_greedy(smollm2.model, ids, 20)
    assert eng.prefix_cache.hits == 3
    eng.prefix_cache.check_integrity()


def test_prompt_cache_off_gives_same_output(smollm2, make_engine):
    tok = smollm2.tokenizer
    on = make_engine(smollm2)
    off = make_engine(smollm2, prompt_cache_bytes=0)
    ids = _chat(tok, SYSTEM, QUESTIONS[1])
    outs = []
    for eng in (on, on, off):
        h = eng.submit(ids, greedy(16))
        eng.run_until_idle()
        outs.append(collect(h)[0])
    assert outs[1]["deltas"][-1].cached_tokens == len(ids) - 1  # all but the last token
    assert outs[2]["deltas"][-1].cached_tokens == 0
    assert outs[0]["tokens"] == outs[1]["tokens"] == outs[2]["tokens"]


def test_later_turns_and_partly_shared_heads_equal_generate(smollm2, make_engine):
    """A three-turn conversation (each turn sent with the whole history, as chat clients do)
    and system prompts that share only part of their text: each later prompt reuses what the
    earlier ones cached, and every output equals `generate` and the cache-off engine's."""
    tok = smollm2.tokenizer
    on = make_engine(smollm2, max_rolling_batch_size=8)
    off = make_engine(smollm2, max_rolling_batch_size=8, prompt_cache_bytes=0)
    history = [{"role": "system", "content": SYSTEM}]
    prompts: list[list[int]] = []
    cached_seqs: list[list[int]] = []  # what the cache holds: each prompt and prompt + answer
    for question in QUESTIONS[:3]:
        history.append({"role": "user", "content": question})
        ids = _render(tok, history)
        h = on.submit(ids, greedy(12))
        on.run_until_idle()
        got = collect(h)[0]
        if prompts:  # the previous turn, its answer included, came from the cache
            cached = got["deltas"][-1].cached_tokens
            assert cached == min(max(_common(c, ids) for c in cached_seqs), len(ids) - 1)
            assert cached > len(prompts[-1])
        prompts.append(ids)
        # A finished sequence is cached up to its last token (never fed to the model).
        cached_seqs += [ids, ids + got["tokens"][:-1]]
        assert got["tokens"] == reference_greedy(smollm2.model, ids, 12)
        history.append({"role": "assistant", "content": got["text"]})
    # Another system prompt with the same first two sentences: only that head is shared.
    other = SYSTEM.rsplit(" Be polite", 1)[0] + " Reply in French, in under ten words."
    ids = _chat(tok, other, QUESTIONS[0])
    shared = _common(ids, prompts[0])
    assert 16 <= shared < len(tok.encode(SYSTEM))
    handles = [eng.submit(ids, greedy(12)) for eng in (on, off)]
    on.run_until_idle()
    off.run_until_idle()
    with_cache, without = (collect(h)[0] for h in handles)
    assert with_cache["deltas"][-1].cached_tokens == shared
    assert with_cache["tokens"] == without["tokens"] == reference_greedy(smollm2.model, ids, 12)
    on.prefix_cache.check_integrity()
