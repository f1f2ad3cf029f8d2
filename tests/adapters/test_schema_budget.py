"""A schema bounded to the answer's token budget: the bounds it gets, that its longest answer
fits the budget in the model's tokens, and what it leaves alone (the embedded model's tokenizer,
no engine)."""

from __future__ import annotations

import json

import pytest
from openai.lib._pydantic import to_strict_json_schema
from pydantic import BaseModel, Field

from adapters.schema_budget import INTEGER_BOUND, NUMBER_TOKENS, within_budget


class Step(BaseModel):
    explanation: str
    output: str


class Answer(BaseModel):
    title: str = Field(max_length=20)
    steps: list[Step]
    tags: list[str]
    score: int | None
    ratio: float = Field(ge=0, le=1)
    final: str


@pytest.fixture
def count(tokenizer):
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False))


def _longest(schema, defs):
    """The longest answer the bounded schema admits (strings of 'x' at their bound, arrays at
    theirs, numbers of NUMBER_TOKENS digits), as JSON text."""
    def value(s):
        if "$ref" in s:
            return value(defs[s["$ref"].rsplit("/", 1)[-1]])
        if "anyOf" in s:
            return max((value(o) for o in s["anyOf"]), key=lambda v: len(json.dumps(v)))
        kind = s.get("type")
        if kind == "object":
            return {k: value(v) for k, v in s["properties"].items()}
        if kind == "array":
            return [value(s["items"])] * s["maxItems"]
        if kind == "string":
            return "x" * s["maxLength"]
        if kind in ("integer", "number"):
            return int("9" * NUMBER_TOKENS)
        return None
    return json.dumps(value(schema), separators=(", ", ": "))


@pytest.mark.parametrize("budget", [200, 400, 800])
def test_the_longest_bounded_answer_fits_the_budget(count, budget):
    schema = to_strict_json_schema(Answer)
    bounded = within_budget(schema, budget, count)
    assert bounded is not schema and schema == to_strict_json_schema(Answer)  # a copy
    assert count(_longest(bounded, bounded["$defs"])) <= budget
    props = bounded["properties"]
    assert props["title"]["maxLength"] == 20  # a bound the schema has is kept
    assert props["steps"]["maxItems"] == 4 and props["tags"]["maxItems"] == 8
    length = props["final"]["maxLength"]
    assert props["tags"]["items"]["maxLength"] == length
    assert bounded["$defs"]["Step"]["properties"]["output"]["maxLength"] == length
    integer = props["score"]["anyOf"][0]
    assert (integer["minimum"], integer["maximum"]) == (-INTEGER_BOUND, INTEGER_BOUND)
    assert "maxLength" not in props["ratio"] and props["ratio"]["maximum"] == 1


def test_a_larger_budget_gives_longer_strings(count):
    schema = to_strict_json_schema(Answer)
    small, large = (within_budget(schema, b, count)["properties"]["final"]["maxLength"]
                    for b in (200, 2000))
    assert 1 <= small < large


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": True},
    {"type": "object", "patternProperties": {"^x": {"type": "string"}}},
    {"$ref": "#/$defs/node", "$defs": {"node": {"type": "object", "properties": {
        "next": {"$ref": "#/$defs/node"}}}}},
    {"type": "object", "properties": {"a": {"type": "string", "pattern": "^[a-z]+$"}}},
    {"allOf": [{"type": "string"}]},
    {"type": "object", "properties": {"a": {"type": "string"}} | {
        f"k{i}": {"type": "string"} for i in range(200)}},  # not a character each in 200 tokens
])
def test_what_cannot_be_bounded_is_left_as_it_is(count, schema):
    assert within_budget(schema, 200, count) is schema
