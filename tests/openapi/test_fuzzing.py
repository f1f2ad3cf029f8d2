"""The fuzz tests' request shaping (tests/openapi/fuzzing.py): cheap, and honest about types."""

from __future__ import annotations

from tests.openapi.fuzzing import MAX_NEW_TOKENS, bound_generation, steer_to_generation


def test_caps_integers_and_adds_a_missing_limit():
    body = bound_generation("/v1/chat/completions", {"max_completion_tokens": 10**9, "n": 7})
    assert body == {"max_completion_tokens": MAX_NEW_TOKENS, "n": 2}
    assert bound_generation("/v1/completions", {"prompt": "x"})["max_tokens"] == MAX_NEW_TOKENS
    # An explicit null is no limit either (clients send nulls for absent fields).
    body = bound_generation("/v1/chat/completions", {"max_completion_tokens": None})
    assert body["max_tokens"] == MAX_NEW_TOKENS


def test_leaves_wrong_types_for_the_server_to_refuse():
    body = {"max_tokens": "lots", "n": True, "min_tokens": -5}
    assert bound_generation("/v1/completions", dict(body)) == body
    assert bound_generation("/v1/completions", ["not", "an", "object"]) == ["not", "an", "object"]


def test_caps_djl_parameters():
    body = bound_generation("/invocations", {"inputs": "x", "parameters": {"max_new_tokens": 999}})
    assert body["parameters"] == {"max_new_tokens": MAX_NEW_TOKENS}
    assert bound_generation("/invocations", {"inputs": "x"}) == {"inputs": "x"}


def test_steering_narrows_requests_and_keeps_responses(document):
    steered = steer_to_generation(document, "the-model")
    assert sorted(steered["paths"]) == ["/v1/chat/completions", "/v1/completions"]
    for path, item in steered["paths"].items():
        request = item["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert request["properties"]["model"] == {"enum": ["the-model"]}
        assert "stream_options" not in request["properties"]
        assert item["post"]["responses"] == document["paths"][path]["post"]["responses"]
