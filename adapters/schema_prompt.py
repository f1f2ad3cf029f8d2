"""The schema a constrained answer must follow, shown to the model (as OpenAI's structured outputs
do): a grammar holds the output to the schema, but a model that has not seen it writes whatever
it would have written, inside the first string, until `max_tokens` cuts it off.

The schema is drawn as the answer's shape, with the values to fill in between angle brackets
(`{"name": <string: the city's name>, "tags": [<string>, ...]}`): small models copy an example's
form more readily than they read a JSON schema, and the shape takes fewer tokens. What has no
short shape (`allOf`, `not`, pattern properties, deep nesting) is shown as the JSON schema itself.
"""

from __future__ import annotations

import json
from typing import Any

_MAX_SHAPE_DEPTH = 8  # deeper schemas are shown as themselves
_SCALARS = {"string": "string", "integer": "integer", "number": "number"}


class _NoShape(Exception):
    """The schema has a part that has no short shape."""


def instruction(schema: dict[str, Any] | bool) -> str:
    """The instruction that shows a model the answer's schema."""
    if schema in ({"type": "object"}, {}, True):  # json_object: any object
        return "Answer with a JSON object only."
    try:
        shape = _shape(schema, schema.get("$defs") or schema.get("definitions") or {}, 0)
    except _NoShape:
        return ("Answer with a JSON object only, valid against this JSON schema:\n"
                + json.dumps(schema, ensure_ascii=False))
    return ("Answer with a JSON object only, of this form (fill in each <...> with a short value "
            "of that kind):\n" + shape)


def carried(schema: dict[str, Any] | bool, texts: list[str]) -> bool:
    """Whether the conversation already shows the schema (as JSON text, compact or indented), or,
    for a bare JSON object, already asks for JSON."""
    if schema in ({"type": "object"}, {}, True):
        return any("json" in t.lower() for t in texts)
    dumps = {json.dumps(schema, **kw) for kw in (
        {}, {"separators": (",", ":")}, {"indent": 2}, {"indent": 4}, {"ensure_ascii": False})}
    return any(d in t for t in texts for d in dumps)


def _shape(schema: Any, defs: dict[str, Any], depth: int) -> str:
    if depth > _MAX_SHAPE_DEPTH or not isinstance(schema, dict):
        raise _NoShape
    if any(k in schema for k in ("allOf", "not", "patternProperties", "if")):
        raise _NoShape
    ref = schema.get("$ref")
    if isinstance(ref, str):
        target = defs.get(ref.rsplit("/", 1)[-1]) if ref.startswith("#/") else None
        if target is None:
            raise _NoShape
        return _shape(target, defs, depth + 1)
    if "const" in schema:
        return json.dumps(schema["const"], ensure_ascii=False)
    if isinstance(schema.get("enum"), list):
        return " or ".join(json.dumps(v, ensure_ascii=False) for v in schema["enum"])
    options = schema.get("anyOf") or schema.get("oneOf")
    if isinstance(options, list) and options:
        return " or ".join(_shape(o, defs, depth + 1) for o in options)
    kind = schema.get("type")
    if isinstance(kind, list):
        return " or ".join(_shape({**schema, "type": k}, defs, depth + 1) for k in kind)
    if kind == "object" or "properties" in schema:
        props = schema.get("properties") or {}
        if not props:
            return "{...}"
        return "{" + ", ".join(f"{json.dumps(k, ensure_ascii=False)}: "
                               f"{_shape(v, defs, depth + 1)}" for k, v in props.items()) + "}"
    if kind == "array":
        items = schema.get("items")
        return "[" + (_shape(items, defs, depth + 1) + ", ..." if items else "...") + "]"
    if kind == "boolean":
        return "true or false"
    if kind == "null":
        return "null"
    if kind in _SCALARS:
        return _placeholder(schema, _SCALARS[kind])
    raise _NoShape


def _placeholder(schema: dict[str, Any], kind: str) -> str:
    """`<kind: what it is, its bounds>`, from the schema's description or title and limits."""
    notes = []
    about = schema.get("description")  # not the title: pydantic makes one of every field name
    if isinstance(about, str) and about:
        notes.append(" ".join(about.split())[:120])
    low = schema.get("minimum", schema.get("exclusiveMinimum"))
    high = schema.get("maximum", schema.get("exclusiveMaximum"))
    if low is not None and high is not None:
        notes.append(f"from {low} to {high}")
    elif low is not None:
        notes.append(f"at least {low}")
    elif high is not None:
        notes.append(f"at most {high}")
    if schema.get("format") in ("date", "date-time", "time", "email", "uri"):
        notes.append(schema["format"])
    return f"<{kind}: {', '.join(notes)}>" if notes else f"<{kind}>"
