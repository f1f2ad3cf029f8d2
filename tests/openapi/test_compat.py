"""openapi/checks/compat.py on small hand-written schemas: each rule, in both directions."""

from __future__ import annotations

from openapi.checks.compat import compare

OPENAI = {
    "components": {"schemas": {
        "Base": {"type": "object", "properties": {"model": {"type": "string"}},
                 "required": ["model"]},
        "Request": {"allOf": [{"$ref": "#/components/schemas/Base"}, {
            "type": "object",
            "properties": {
                "n": {"type": "integer", "nullable": True},
                "temperature": {"type": "number", "nullable": True},
                "stop": {"oneOf": [{"type": "string"}, {"type": "array",
                                                        "items": {"type": "string"}}]},
                "mode": {"type": "string", "enum": ["a", "b"]},
            }}]},
        "Response": {"type": "object", "required": ["id", "object", "choices"], "properties": {
            "id": {"type": "string"},
            "object": {"type": "string", "enum": ["thing"]},
            "choices": {"type": "array", "items": {
                "type": "object", "required": ["finish_reason"],
                "properties": {"finish_reason": {"type": "string", "enum": ["stop", "length"]}},
            }},
        }},
    }},
}


def openai(name: str) -> dict:
    return OPENAI["components"]["schemas"][name]


def nullable(t: str) -> dict:
    return {"anyOf": [{"type": t}, {"type": "null"}]}


def request(**props) -> dict:
    base = {"model": nullable("string"), "n": nullable("integer"),
            "temperature": nullable("number"),
            "stop": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}},
                               {"type": "null"}]},
            "mode": {"enum": ["a", "b", "c"]}}
    return {"type": "object", "properties": {**base, **props}, "required": []}


def check_request(ours: dict):
    return compare(ours, ours, openai("Request"), OPENAI, "request")


def test_compatible_request_has_no_problems_and_lists_extensions():
    result = check_request(request(top_k=nullable("integer")))
    assert result.problems == [] and result.extensions == ["top_k"]


def test_request_must_accept_the_nulls_openai_allows():
    result = check_request(request(n={"type": "integer"}))
    assert [(p.path, p.kind) for p in result.problems] == [("n", "type")]


def test_integer_fits_number_but_not_the_other_way():
    assert check_request(request(n=nullable("number"))).problems == []
    problems = check_request(request(temperature=nullable("integer"))).problems
    assert [p.path for p in problems] == ["temperature"]


def test_request_must_accept_every_openai_enum_value():
    problems = check_request(request(mode={"enum": ["a"]})).problems
    assert [(p.path, p.kind) for p in problems] == [("mode", "enum")]
    assert "'b'" in str(problems[0])


def test_request_must_not_require_what_openai_leaves_optional():
    ours = request()
    ours["required"] = ["model", "n"]  # model is required by OpenAI (through allOf), n is not
    problems = check_request(ours).problems
    assert [(p.path, p.kind) for p in problems] == [("n", "required")]


def response(finish: dict, required=("id", "object", "choices")) -> dict:
    return {"$ref": "#/$defs/R", "$defs": {"R": {
        "type": "object", "required": list(required), "properties": {
            "id": {"type": "string"}, "object": {"const": "thing"},
            "choices": {"type": "array", "items": {"$ref": "#/$defs/C"}},
            "usage": {"type": "object"}}},
        "C": {"type": "object", "required": ["finish_reason"],
              "properties": {"finish_reason": finish}}}}


def check_response(ours: dict):
    return compare(ours, ours, openai("Response"), OPENAI, "response")


def test_compatible_response_follows_refs_into_array_items():
    result = check_response(response({"type": "string"}))
    assert result.problems == [] and result.extensions == ["usage"]


def test_response_must_not_send_null_where_openai_does_not():
    problems = check_response(response(nullable("string"))).problems
    assert [(p.path, p.kind) for p in problems] == [("choices[].finish_reason", "type")]


def test_response_enum_must_stay_inside_openai_values():
    problems = check_response(response({"enum": ["stop", "eos"]})).problems
    assert [(p.path, p.kind) for p in problems] == [("choices[].finish_reason", "enum")]


def test_response_must_promise_what_openai_requires():
    problems = check_response(response({"type": "string"}, required=("id", "choices"))).problems
    assert [(p.path, p.kind) for p in problems] == [("object", "required")]
    assert "not promised" in problems[0].message
