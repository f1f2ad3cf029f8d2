import pytest

from adapters.errors import CHAT_NAMES, ApiError
from adapters.openai_params import (
    check_model,
    logit_bias_ids,
    max_tokens_for,
    sampling_params,
    strategy_for,
)
from adapters.openai_types import ChatCompletionRequest, ChatMessage, StreamOptions

MSG = [ChatMessage(role="user", content="hi")]


def req(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=MSG, **kw)


@pytest.mark.parametrize(("kw", "expected"), [
    ({}, None),  # neither given: the server's option.decoding_strategy
    ({"temperature": 0.0}, "greedy"),
    ({"temperature": 0.7}, "sample"),
    ({"top_p": 0.9}, "sample"),
    ({"temperature": 0.0, "top_p": 0.9}, "greedy"),
    ({"temperature": 0.7, "decoding_strategy": "contrastive"}, "contrastive"),
    ({"decoding_strategy": "greedy", "temperature": 1.0}, "greedy"),
])
def test_strategy_follows_vllm_with_explicit_override(kw, expected):
    assert strategy_for(req(**kw)) == expected


def test_unknown_strategy_names_the_parameter():
    with pytest.raises(ApiError) as info:
        sampling_params(req(decoding_strategy="beam"), CHAT_NAMES, max_tokens=4)
    assert info.value.param == "decoding_strategy"


def test_sampling_params_carry_every_field():
    p = sampling_params(req(temperature=0.5, top_p=0.8, top_k=5, min_p=0.1, seed=7, n=2,
                            stop="\n", presence_penalty=0.5, frequency_penalty=-0.5,
                            repetition_penalty=1.1, logit_bias={"42": 5.0}, min_tokens=2,
                            ignore_eos=True, penalty_alpha=0.4, stop_token_ids=[3], priority=-3),
                        CHAT_NAMES, max_tokens=9, logprobs=True, top_logprobs=3)
    assert (p.strategy, p.temperature, p.top_p, p.top_k, p.min_p, p.seed, p.n) == (
        "sample", 0.5, 0.8, 5, 0.1, 7, 2)
    assert p.stop == ["\n"] and p.stop_token_ids == [3] and p.logit_bias == {42: 5.0}
    assert (p.max_new_tokens, p.min_new_tokens, p.ignore_eos, p.penalty_alpha) == (9, 2, True, 0.4)
    assert p.logprobs and p.top_logprobs == 3 and p.priority == -3


@pytest.mark.parametrize(("kw", "param"), [
    ({"temperature": 3.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"n": 0}, "n"),
    ({"presence_penalty": 5.0}, "presence_penalty"),
    ({"stop": ["a", ""]}, "stop"),
    ({"logit_bias": {"x": 1.0}}, "logit_bias"),
    ({"stream_options": StreamOptions(include_usage=True)}, "stream_options"),
    ({"priority": 2**40}, "priority"),
    ({"min_tokens": 9}, "min_tokens"),  # the engine's min_new_tokens, as the API names it
])
def test_out_of_range_values_name_the_parameter(kw, param):
    with pytest.raises(ApiError) as info:
        sampling_params(req(**kw), CHAT_NAMES, max_tokens=4)
    assert info.value.status == 400 and info.value.param == param


def test_max_tokens_default_is_the_rest_of_the_context():
    assert max_tokens_for(None, 100, 8192, CHAT_NAMES) == 8092
    assert max_tokens_for(10, 100, 8192, CHAT_NAMES) == 10


def test_context_overflow_is_context_length_exceeded():
    with pytest.raises(ApiError) as info:
        max_tokens_for(9000, 100, 8192, CHAT_NAMES)
    err = info.value
    assert err.status == 400 and err.code == "context_length_exceeded"
    assert "maximum context length is 8192" in err.message
    assert "context_length_exceeded" in err.message
    assert err.param == "messages"
    with pytest.raises(ApiError) as info:
        max_tokens_for(None, 8192, 8192, CHAT_NAMES)
    assert info.value.code == "context_length_exceeded"


def test_max_tokens_below_one():
    names = CHAT_NAMES.renaming(max_new_tokens="max_completion_tokens")
    with pytest.raises(ApiError) as info:
        sampling_params(req(), names, max_tokens=max_tokens_for(0, 10, 100, names))
    assert info.value.param == "max_completion_tokens"


def test_model_check():
    check_model(None, "m")
    check_model("m", "m")
    with pytest.raises(ApiError) as info:
        check_model("gpt-4o", "m")
    assert (info.value.status, info.value.code, info.value.param) == (404, "model_not_found",
                                                                      "model")


def test_logit_bias_keys_are_token_ids():
    assert logit_bias_ids({"1": 2, "30": -100}) == {1: 2.0, 30: -100.0}
    assert logit_bias_ids(None) == {}
