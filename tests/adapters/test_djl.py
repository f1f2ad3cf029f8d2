import json

import pytest

from adapters.djl import DjlAssembler, build_djl_jobs, decode_djl, djl_params
from adapters.errors import ApiError
from adapters.token_text import TokenText
from engine import JobDelta, TokenLogprob

SEED_BODY = json.dumps({
    "inputs": "The new movie that got Oscar this year",
    "parameters": {"max_new_tokens": 50, "do_sample": True},
    "cached_prompt": "This is a prompt that will be cached and appended to the front of the "
                     "inputs strings.",
}).encode()


def test_seed_request_decodes_to_a_cached_prefix_job(tokenizer):
    req, opts = decode_djl(SEED_BODY)
    (job,) = build_djl_jobs(req, opts, tokenizer, 8192)
    head = tokenizer.encode(req.cached_prompt)
    assert job.prompt_ids[: len(head)] == head  # the same ids whatever follows: cached
    assert job.params.strategy == "sample" and job.params.max_new_tokens == 50
    assert job.params.logprobs  # DJL reports every token's log_prob


@pytest.mark.parametrize(("parameters", "strategy"), [
    ({}, None),
    ({"do_sample": False}, "greedy"),
    ({"do_sample": True, "decoding_strategy": "contrastive"}, "contrastive"),
])
def test_strategy_mapping(parameters, strategy):
    _, opts = decode_djl(json.dumps({"inputs": "x", "parameters": parameters}).encode())
    assert djl_params(opts).strategy == strategy


def test_defaults_stop_sequences_and_unknown_parameters():
    _, opts = decode_djl(b'{"inputs": "x", "parameters": {"stop_sequences": ["\\n"], '
                         b'"typical_p": 0.5, "top_k": 3}}')
    p = djl_params(opts)
    assert p.stop == ["\n"] and p.top_k == 3 and p.max_new_tokens == 30


@pytest.mark.parametrize(("body", "param"), [
    (b'{"inputs": "x", "parameters": {"max_new_tokens": "many"}}', "parameters"),
    (b'{"inputs": "x", "parameters": {"max_new_tokens": 0}}', "parameters.max_new_tokens"),
    (b'{"inputs": "x", "parameters": {"decoding_strategy": "beam"}}',
     "parameters.decoding_strategy"),
    (b'{"parameters": {}}', "inputs"),
])
def test_bad_requests_name_the_parameter(body, param):
    with pytest.raises(ApiError) as info:
        _, opts = decode_djl(body)
        djl_params(opts)
    assert info.value.param == param


def test_context_overflow(tokenizer):
    req, opts = decode_djl(b'{"inputs": "hello", "parameters": {"max_new_tokens": 40}}')
    with pytest.raises(ApiError) as info:
        build_djl_jobs(req, opts, tokenizer, 16)
    assert info.value.code == "context_length_exceeded"


def run(tokenizer, details, deltas, eos=frozenset({2})):
    _, opts = decode_djl(json.dumps({"inputs": "Hi", "parameters": {"details": details}}).encode())
    a = DjlAssembler("Hi", opts, TokenText(tokenizer), set(eos))
    lines = [json.loads(line) for d in deltas for line in a.add(d)]
    return a, lines


def lps(*values):
    return [TokenLogprob(token_id=0, logprob=v) for v in values]


def test_json_and_jsonlines_shapes(tokenizer):
    deltas = [JobDelta("j", 0, [28, 29], "ab", None, lps(-0.1, -0.2), 2, 0, 2),
              JobDelta("j", 0, [2], "", "stop", lps(-0.3), 2, 0, 3)]
    a, lines = run(tokenizer, True, deltas)
    assert [line["token"]["id"] for line in lines] == [28, 29, 2]
    assert lines[0]["token"]["log_prob"] == -0.1 and "generated_text" not in lines[0]
    assert lines[-1]["generated_text"] == "ab"
    assert lines[-1]["details"] == {"finish_reason": "eos_token", "generated_tokens": 3,
                                    "inputs": "Hi"}
    result = a.result()
    assert result["generated_text"] == "ab" and len(result["details"]["tokens"]) == 3
    a, lines = run(tokenizer, False, deltas)
    assert "details" not in lines[-1] and a.result() == {"generated_text": "ab"}


def test_finish_reasons(tokenizer):
    a, _ = run(tokenizer, True, [JobDelta("j", 0, [28], "a", "stop", lps(-1), 1, 0, 1)])
    assert a.result()["details"]["finish_reason"] == "stop_sequence"
    a, _ = run(tokenizer, True, [JobDelta("j", 0, [28], "a", "length", lps(-1), 1, 0, 1)])
    assert a.result()["details"]["finish_reason"] == "length"
