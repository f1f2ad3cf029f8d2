from adapters.errors import ApiError, draining_error, from_engine_error
from engine import ContextLengthExceeded, EngineStopped, InvalidParams, QueueFull


def test_envelope_has_all_four_fields_and_a_string_code():
    body = ApiError.bad_request("bad", param="n").body()
    assert body == {"error": {"message": "bad", "type": "invalid_request_error", "param": "n",
                              "code": "invalid_value"}}


def test_queue_full_is_429_with_retry_after():
    err = from_engine_error(QueueFull(10))
    assert err.status == 429 and err.code == "rate_limit_exceeded"
    assert err.headers["Retry-After"] == "1" and "x-should-retry" not in err.headers


def test_context_length_keeps_the_words_langchain_looks_for():
    err = from_engine_error(ContextLengthExceeded(9000, 10, 8192))
    assert err.status == 400 and err.code == "context_length_exceeded"
    assert "maximum context length" in err.message
    assert err.headers["x-should-retry"] == "false"


def test_invalid_params_and_stopped():
    err = from_engine_error(InvalidParams("top_k", "top_k must be >= 0"))
    assert (err.status, err.param) == (400, "top_k")
    err = from_engine_error(EngineStopped("draining"))
    assert err.status == 503 and err.headers["Retry-After"] and err == draining_error()
    assert from_engine_error(RuntimeError("boom")).status == 500


def test_unsupported_names_the_parameter():
    err = ApiError.unsupported("tools", " (no tool calling)")
    assert err.status == 400 and err.param == "tools" and err.code == "unsupported_parameter"
    assert "'tools'" in err.message
