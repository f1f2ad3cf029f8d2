import pytest

from adapters.errors import (
    CHAT_NAMES,
    COMPLETION_NAMES,
    DJL_NAMES,
    ApiError,
    draining_error,
    from_engine_error,
)
from engine import (
    ContextLengthExceeded,
    EngineStopped,
    InvalidParams,
    KvBudgetExceeded,
    QueueFull,
    SamplingParams,
)


def test_envelope_has_all_four_fields_and_a_string_code():
    body = ApiError.bad_request("bad", param="n").body()
    assert body == {"error": {"message": "bad", "type": "invalid_request_error", "param": "n",
                              "code": "invalid_value"}}


def test_queue_full_is_429_with_retry_after():
    err = from_engine_error(QueueFull(10), CHAT_NAMES)
    assert err.status == 429 and err.code == "rate_limit_exceeded"
    assert err.headers["Retry-After"] == "1" and "x-should-retry" not in err.headers


def test_context_length_keeps_the_words_langchain_looks_for():
    err = from_engine_error(ContextLengthExceeded(9000, 10, 8192), CHAT_NAMES)
    assert err.status == 400 and err.code == "context_length_exceeded"
    assert err.param == "messages"
    assert "maximum context length" in err.message
    assert err.headers["x-should-retry"] == "false"


def test_a_job_too_large_for_the_kv_budget_is_a_context_length_400():
    for param, names, name in (("max_new_tokens", CHAT_NAMES, "max_tokens"),
                               ("prompt", CHAT_NAMES, "messages"),
                               ("prompt", DJL_NAMES, "inputs")):
        err = from_engine_error(KvBudgetExceeded(param, 900, 200, 1, 1100, 1000), names)
        assert (err.status, err.code, err.param) == (400, "context_length_exceeded", name)
        assert err.message.startswith(f"{name} is too large for this server's KV cache")
        assert err.headers["x-should-retry"] == "false"


def test_invalid_params_and_stopped():
    err = from_engine_error(InvalidParams("top_k", "{param} must be >= 0"), CHAT_NAMES)
    assert (err.status, err.param, err.message) == (400, "top_k", "top_k must be >= 0")
    err = from_engine_error(EngineStopped("draining"), CHAT_NAMES)
    assert err.status == 503 and err.headers["Retry-After"] and err == draining_error()
    assert from_engine_error(RuntimeError("boom"), CHAT_NAMES).status == 500


@pytest.mark.parametrize(("names", "prompt", "max_new"), [
    (CHAT_NAMES, "messages", "max_tokens"),
    (COMPLETION_NAMES, "prompt", "max_tokens"),
    (DJL_NAMES, "inputs", "parameters.max_new_tokens"),
])
def test_each_protocol_names_the_engine_parameters_its_way(names, prompt, max_new):
    """The engine says max_new_tokens and prompt; each protocol's error says its own name, in
    the param field and in the message."""
    with pytest.raises(InvalidParams) as info:
        SamplingParams(max_new_tokens=0).validate()
    err = from_engine_error(info.value, names)
    assert err.param == max_new and err.message.startswith(f"{max_new} must be >= 1")
    err = from_engine_error(ContextLengthExceeded(9000, 10, 8192), names)
    assert err.param == prompt and err.code == "context_length_exceeded"
    stop = from_engine_error(InvalidParams("stop", "{param} takes at most 16"), names)
    assert stop.param == ("parameters.stop" if names is DJL_NAMES else "stop")


def test_a_message_quoting_braces_is_not_a_format_string():
    with pytest.raises(InvalidParams) as info:
        SamplingParams(strategy="{0}{param}").validate()
    err = from_engine_error(info.value, DJL_NAMES)
    assert err.param == "parameters.decoding_strategy" and "'{0}{param}'" in err.message


def test_unsupported_names_the_parameter():
    err = ApiError.unsupported("tools", " (no tool calling)")
    assert err.status == 400 and err.param == "tools" and err.code == "unsupported_parameter"
    assert "'tools'" in err.message
