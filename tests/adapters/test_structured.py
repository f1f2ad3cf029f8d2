"""The guided_* extras as the adapters read them, without a model."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from adapters.errors import ApiError
from adapters.structured import MAX_SCHEMA_DEPTH, check_depth, guided_grammar


def fields(**given) -> SimpleNamespace:
    names = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
    return SimpleNamespace(**{n: given.get(n) for n in names})


@pytest.mark.parametrize("schema", [True, False, {}, {"type": "object"}])
def test_boolean_and_empty_schemas_are_schemas(schema):
    """`true` and `false` are JSON schemas (anything, nothing); the fuzzer sent `true` and the
    depth check iterated over it (a 500)."""
    grammar, name = guided_grammar(fields(guided_json=schema))
    assert name == "guided_json" and grammar is not None


def test_depth_is_bounded_and_leaves_are_not_walked():
    for leaf in (True, 3, "x", None):
        check_depth(leaf, "p")
    deep: dict = {}
    node = deep
    for _ in range(MAX_SCHEMA_DEPTH):
        node["items"] = {}
        node = node["items"]
    with pytest.raises(ApiError) as err:
        check_depth(deep, "guided_json")
    assert err.value.status == 400 and err.value.param == "guided_json"


@pytest.mark.parametrize("value", [3, 2.5, ["a"]])
def test_other_types_are_refused_by_name(value):
    with pytest.raises(ApiError) as err:
        guided_grammar(fields(guided_json=value))
    assert err.value.status == 400 and err.value.param == "guided_json"
