"""A JSON schema bounded to fit a token budget, so that a constrained answer completes within
`max_tokens` instead of being cut inside its first long string.

A small model held to a schema can write one string (or one array) until the budget runs out: a
degenerate repetition, a summary that never ends. Every string without a `maxLength` and every
array without a `maxItems` gets one, and an integer without bounds gets +-INTEGER_BOUND. They are
chosen so that the whole object, written as the grammar writes it, takes at most the budget: the
object's fixed part (keys, punctuation, enum values, numbers at `NUMBER_TOKENS` each) is counted
with the model's tokenizer, each array holds at most `ARRAY_ITEMS` items (`NESTED_ITEMS` for
arrays of objects or arrays), and what is left is shared equally among the strings, one
character each per token (a token is at least one character of ASCII text; text in other
scripts can take more). A number's decimals cannot be bounded in a JSON schema and stay open.
An answer that still runs out ends with finish_reason "length", as before.

A schema this cannot bound (recursive references, open-ended `additionalProperties` or
`patternProperties`, `allOf`, `not`, string patterns and formats) is left as it is.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any

from adapters.structured import SUBSCHEMA_LISTS, SUBSCHEMA_MAPS

NUMBER_TOKENS = 12  # a number's digits: SmolLM2-like tokenizers write one token per digit
# An integer without bounds gets these, so that its digits fit NUMBER_TOKENS (a number's decimals
# cannot be bounded in a JSON schema: those stay open).
INTEGER_BOUND = 10**11 - 1
ARRAY_ITEMS = 8  # items of an unbounded array of scalars
NESTED_ITEMS = 4  # items of an unbounded array of objects or arrays
RESERVE_TOKENS = 4  # the end of the answer, and what a merge at a string's end may take
UNBOUNDED = 2048  # a string bound this long or longer is not added: nothing to gain
_MAX_DEPTH = 16
_SEPARATORS = (", ", ": ")  # how the grammar writes JSON


class _Unbounded(Exception):
    """The schema has a part whose size the schema does not bound."""


@dataclass
class _Cost:
    """What an instance of a (sub)schema takes: a skeleton (its fixed text), the numbers in it,
    and the strings whose length the bound sets (counted with their multiplicity)."""

    skeleton: Any
    numbers: int = 0
    strings: int = 0


def within_budget(schema: Any, budget: int, count_tokens) -> Any:
    """`schema` with its unbounded strings and arrays bounded so that an answer takes at most
    `budget` tokens (`count_tokens(text)` counts them), or `schema` itself where it cannot be
    bounded or needs no bound."""
    if not isinstance(schema, dict):
        return schema
    defs = {**(schema.get("definitions") or {}), **(schema.get("$defs") or {})}
    try:
        cost = _cost(schema, defs, 0)
    except _Unbounded:
        return schema
    fixed = count_tokens(json.dumps(cost.skeleton, separators=_SEPARATORS, ensure_ascii=False))
    left = budget - fixed - cost.numbers * NUMBER_TOKENS - RESERVE_TOKENS
    if left < cost.strings:  # not even a character each: the bound would not save it
        return schema
    length = min(left // cost.strings, UNBOUNDED) if cost.strings else UNBOUNDED
    return _bounded(copy.deepcopy(schema), length, defs)


def _resolve(schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    ref = schema.get("$ref")
    if ref is None:
        return schema
    target = defs.get(ref.rsplit("/", 1)[-1]) if isinstance(ref, str) else None
    if not isinstance(target, dict) or not ref.startswith("#/"):
        raise _Unbounded
    return target


def _items(schema: dict[str, Any], defs: dict[str, Any]) -> int:
    """How many items an array of `schema` may hold once bounded."""
    if "maxItems" in schema:
        return int(schema["maxItems"])
    item = schema.get("items")
    nested = isinstance(item, dict) and _resolve(item, defs).get("type") in ("object", "array")
    return max(int(schema.get("minItems", 0)), NESTED_ITEMS if nested else ARRAY_ITEMS)


def _cost(schema: Any, defs: dict[str, Any], depth: int) -> _Cost:
    if depth > _MAX_DEPTH:
        raise _Unbounded  # a recursive schema
    if schema is True or schema == {}:
        raise _Unbounded
    if not isinstance(schema, dict) or any(k in schema for k in ("allOf", "not", "if")):
        raise _Unbounded
    schema = _resolve(schema, defs)
    if "$ref" in schema:
        return _cost(schema, defs, depth + 1)
    if "const" in schema:
        return _Cost(schema["const"])
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return _Cost(max(schema["enum"], key=lambda v: len(json.dumps(v))))
    options = schema.get("anyOf") or schema.get("oneOf")
    if isinstance(options, list) and options:
        costs = [_cost(o, defs, depth + 1) for o in options]
        widest = max(costs, key=lambda c: len(json.dumps(c.skeleton)))
        return _Cost(widest.skeleton, max(c.numbers for c in costs),
                     max(c.strings for c in costs))
    kind = schema.get("type")
    if isinstance(kind, list):
        return _cost({"anyOf": [{**schema, "type": k} for k in kind]}, defs, depth + 1)
    if kind == "object" or "properties" in schema:
        if schema.get("patternProperties") or schema.get("additionalProperties") not in (
                None, False):
            raise _Unbounded
        out = _Cost({})
        for key, sub in (schema.get("properties") or {}).items():
            c = _cost(sub, defs, depth + 1)
            out.skeleton[key] = c.skeleton
            out.numbers += c.numbers
            out.strings += c.strings
        return out
    if kind == "array":
        n = _items(schema, defs)
        item = _cost(schema.get("items", {"type": "string"}), defs, depth + 1)
        return _Cost([item.skeleton] * n, item.numbers * n, item.strings * n)
    if kind == "string":
        if "maxLength" in schema:
            return _Cost("x" * int(schema["maxLength"]))
        if "pattern" in schema or "format" in schema:
            raise _Unbounded  # no length bound combines with them here
        return _Cost("", strings=1)
    if kind in ("integer", "number"):
        return _Cost(0, numbers=1)
    if kind == "boolean":
        return _Cost(False)
    if kind == "null":
        return _Cost(None)
    raise _Unbounded


def _bounded(schema: Any, length: int, defs: dict[str, Any]) -> Any:
    """Add the bounds in place, walking the schema's subschemas: `maxLength` to strings,
    `maxItems` to arrays, where missing."""
    if not isinstance(schema, dict):
        return schema
    for key in SUBSCHEMA_MAPS:
        for sub in (schema.get(key) or {}).values():
            _bounded(sub, length, defs)
    for key in SUBSCHEMA_LISTS:
        for sub in schema.get(key) or []:
            _bounded(sub, length, defs)
    _bounded(schema.get("items"), length, defs)
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    if "string" in kinds and not {"maxLength", "enum", "const"} & schema.keys() \
            and length < UNBOUNDED:
        schema["maxLength"] = max(length, int(schema.get("minLength", 0)))
    if "array" in kinds and "maxItems" not in schema:
        schema["maxItems"] = _items(schema, defs)
    if "integer" in kinds:
        if "minimum" not in schema and "exclusiveMinimum" not in schema:
            schema["minimum"] = -INTEGER_BOUND
        if "maximum" not in schema and "exclusiveMaximum" not in schema:
            schema["maximum"] = INTEGER_BOUND
    return schema
