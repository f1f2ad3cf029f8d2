import msgspec
import pytest

from adapters.errors import ApiError
from adapters.openai_completions import (
    CompletionAssembler,
    CompletionChunker,
    Prompt,
    build_completion_jobs,
    parse_prompts,
)
from adapters.openai_params import ResponseMeta
from adapters.openai_types import CompletionRequest
from adapters.token_text import TokenText
from engine import JobDelta, TokenLogprob
from tests.app.schema import conforms_as_completion_chunk, without_echo_nulls

META = ResponseMeta("cmpl-test", 1700000000, "SmolLM2-135M-Instruct", "fp_test")


def as_json(obj):
    return msgspec.json.decode(msgspec.json.encode(obj))


def test_every_prompt_shape(tokenizer):
    ids = tokenizer.encode("Hello there")
    assert [p.ids for p in parse_prompts("Hello there", tokenizer)] == [ids]
    assert len(parse_prompts(["a", "b", "c"], tokenizer)) == 3
    assert [p.ids for p in parse_prompts(ids, tokenizer)] == [ids]
    got = parse_prompts([ids, ids[:1]], tokenizer)
    assert [p.ids for p in got] == [ids, ids[:1]] and got[0].text == "Hello there"


@pytest.mark.parametrize("prompt", [[], ["a", 1], [[1], ["a"]], [[]], [10**9], [True]])
def test_bad_prompts_name_prompt(tokenizer, prompt):
    with pytest.raises(ApiError) as info:
        parse_prompts(prompt, tokenizer)
    assert info.value.status == 400 and info.value.param == "prompt"


@pytest.mark.parametrize(("kw", "param"), [
    ({"suffix": "tail"}, "suffix"),
    ({"best_of": 3}, "best_of"),
    ({"logprobs": 50}, "logprobs"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
])
def test_unsupported_or_invalid(tokenizer, kw, param):
    with pytest.raises(ApiError) as info:
        build_completion_jobs(CompletionRequest(prompt="x", **kw), tokenizer, 8192)
    assert info.value.param == param


def test_one_job_per_prompt_with_openai_default_budget(tokenizer):
    jobs, prompts = build_completion_jobs(CompletionRequest(prompt=["a", "b"], n=2, logprobs=2),
                                          tokenizer, 8192)
    assert len(jobs) == 2 and len(prompts) == 2
    assert all(j.params.max_new_tokens == 16 and j.params.n == 2 for j in jobs)
    assert jobs[0].params.logprobs and jobs[0].params.top_logprobs == 2


def test_context_check_covers_every_prompt_before_submission(tokenizer):
    with pytest.raises(ApiError) as info:
        build_completion_jobs(CompletionRequest(prompt=["short", "x " * 40], max_tokens=4),
                              tokenizer, 32)
    assert info.value.code == "context_length_exceeded" and info.value.param == "prompt"


def two_prompt_deltas(index, text, finish=None, n_done=1):
    lp = [TokenLogprob(token_id=28, logprob=-0.25, top=[(29, -2.0)])]
    return JobDelta(f"job{index}", 0, [28], text, finish, lp, 4, 0, n_done)


def test_assembler_orders_choices_prompt_major_and_conforms(tokenizer, schema_errors):
    prompts = [Prompt([1, 2], "P0"), Prompt([3], "P1")]
    a = CompletionAssembler(META, prompts, 1, echo=False, token_text=TokenText(tokenizer),
                            logprobs=True)
    a.add(1, two_prompt_deltas(1, "b", "length"))
    a.add(0, two_prompt_deltas(0, "a"))
    a.add(0, two_prompt_deltas(0, "c", "stop", 2))
    body = as_json(a.response())
    assert schema_errors("CreateCompletionResponse", body) == []
    assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "ac", "stop"), (1, "b", "length")]
    lp = body["choices"][0]["logprobs"]
    assert lp["token_logprobs"] == [-0.25, -0.25] and len(lp["tokens"]) == 2
    assert lp["text_offset"][0] == 0 and lp["text_offset"][1] == len(lp["tokens"][0])
    assert set(lp["top_logprobs"][0]) == {lp["tokens"][0], TokenText(tokenizer).text(29)}
    assert body["usage"]["prompt_tokens"] == 8 and body["usage"]["completion_tokens"] == 3


def test_echo_prepends_the_prompt(tokenizer):
    a = CompletionAssembler(META, [Prompt([1], "Say:")], 1, echo=True,
                            token_text=TokenText(tokenizer), logprobs=False)
    a.add(0, JobDelta("j", 0, [5], " hi", "stop", None, 1, 0, 1))
    assert as_json(a.response())["choices"][0]["text"] == "Say: hi"


def test_stream_chunks_conform_and_end_with_usage(tokenizer, schema_errors):
    c = CompletionChunker(META, [Prompt([1], "Say:")], 2, echo=True,
                          token_text=TokenText(tokenizer), logprobs=False, include_usage=True)
    chunks = [as_json(x) for x in c.start()]
    chunks += [as_json(x) for x in c.on_delta(0, JobDelta("j", 1, [5], " a", "stop", None, 1,
                                                              0, 1))]
    chunks += [as_json(x) for x in c.finish()]
    for chunk in chunks[:-1]:
        assert "usage" not in chunk
        assert conforms_as_completion_chunk(schema_errors, chunk), chunk
    assert [ch["choices"][0]["text"] for ch in chunks[:2]] == ["Say:", "Say:"]
    assert chunks[2]["choices"][0] == {"index": 1, "text": " a", "logprobs": None,
                                       "finish_reason": "stop"}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 2


@pytest.mark.parametrize(("kw", "want"), [
    ({}, None), ({"logprobs": 2}, None), ({"echo": True}, None),
    ({"echo": True, "logprobs": 2}, 2), ({"prompt_logprobs": 0}, 0),
    ({"echo": True, "logprobs": 3, "prompt_logprobs": 1}, 3),
])
def test_prompt_logprobs_are_asked_by_echo_with_logprobs_or_by_name(tokenizer, kw, want):
    jobs, _ = build_completion_jobs(CompletionRequest(prompt="a b c", **kw), tokenizer, 8192)
    assert jobs[0].params.prompt_logprobs == want


def _prompt_delta(prompt_ids, token_ids) -> JobDelta:
    entries = [None] + [TokenLogprob(t, -1.0 * i, [(t, -1.0 * i), (7, -9.0)], 1)
                        for i, t in enumerate(prompt_ids[1:], start=1)]
    d = JobDelta("j", 0, token_ids, " x", "length", [TokenLogprob(token_ids[0], -0.5,
                                                                   [(token_ids[0], -0.5)])],
                 len(prompt_ids), 0, 1)
    d.prompt_logprobs = entries
    return d


def test_echo_with_logprobs_leads_with_the_prompt_tokens(tokenizer, schema_errors):
    ids = tokenizer.encode("Roses are red")
    text = TokenText(tokenizer)
    a = CompletionAssembler(META, [Prompt(ids, "Roses are red")], 1, echo=True, token_text=text,
                            logprobs=True, top=1)
    a.add(0, _prompt_delta(ids, [ids[0]]))
    body = as_json(a.response())
    assert schema_errors("CreateCompletionResponse", without_echo_nulls(body)) == []
    lp = body["choices"][0]["logprobs"]
    assert lp["tokens"] == [text.text(t) for t in ids] + [text.text(ids[0])]
    assert lp["token_logprobs"] == [None, *(-1.0 * i for i in range(1, len(ids))), -0.5]
    assert lp["top_logprobs"][0] is None and len(lp["top_logprobs"][1]) == 1  # top=1
    assert lp["text_offset"][0] == 0 and lp["text_offset"][1] == len(text.text(ids[0]))
    assert body["choices"][0]["text"] == "Roses are red x" and "prompt_logprobs" not in \
        body["choices"][0]


def test_vllm_prompt_logprobs_in_the_choice(tokenizer):
    ids = tokenizer.encode("Roses are red")
    a = CompletionAssembler(META, [Prompt(ids, "Roses are red")], 1, echo=False,
                            token_text=TokenText(tokenizer), logprobs=False, prompt_logprobs=1)
    a.add(0, _prompt_delta(ids, [ids[0]]))
    choice = as_json(a.response())["choices"][0]
    entries = choice["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids) and choice["logprobs"] is None
    first = entries[1]
    assert first[str(ids[1])] == {"logprob": -1.0, "rank": 1,
                                  "decoded_token": TokenText(tokenizer).text(ids[1])}
    assert len(first) == 1  # k=1 alternatives, the prompt's token among them
