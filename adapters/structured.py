"""Structured outputs: `response_format` (OpenAI) and the `guided_*` extras (vLLM's names) →
the engine's `Grammar`, checked and compiled before anything is submitted.

A schema llguidance cannot compile (an unknown type, a `$ref` to nowhere, a bad pattern, an
unsupported keyword) is a 400 naming the field that carried it, with llguidance's reason.
"""

from __future__ import annotations

import re
from typing import Any

from adapters.errors import ApiError
from engine.errors import InvalidGrammar
from engine.sample.grammar import CompiledGrammar, Grammar, GrammarCompiler

MAX_CHOICES = 256  # guided_choice options
MAX_SCHEMA_DEPTH = 64  # nesting of a schema's JSON (a pydantic model nested 10 deep uses ~30)
_SCHEMA_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


def response_schema(response_format: dict[str, Any] | None) -> dict[str, Any] | None:
    """The JSON schema a `response_format` asks for (`{"type": "object"}` for json_object), or
    None for text. Raises ApiError naming `response_format`."""
    if response_format is None:
        return None
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind != "json_schema":
        raise ApiError.bad_request("response_format.type must be one of text, json_object, "
                                   f"json_schema, got {kind!r}", param="response_format.type")
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise ApiError.bad_request("response_format.json_schema is required with type "
                                   "json_schema", param="response_format.json_schema",
                                   code="missing_required_parameter")
    name = spec.get("name")
    if not isinstance(name, str) or not _SCHEMA_NAME.match(name):
        raise ApiError.bad_request("response_format.json_schema.name must be 1 to 64 letters, "
                                   f"digits, '_' or '-', got {name!r}",
                                   param="response_format.json_schema.name")
    if "strict" in spec and not isinstance(spec["strict"], bool | None):
        raise ApiError.bad_request("response_format.json_schema.strict must be a boolean",
                                   param="response_format.json_schema.strict")
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise ApiError.bad_request("response_format.json_schema.schema must be a JSON schema "
                                   "object", param="response_format.json_schema.schema")
    check_depth(schema, "response_format.json_schema.schema")
    return closed(schema) if spec.get("strict") else schema


# The keywords whose values are subschemas: lists of them, and maps of names to them.
SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")


def check_depth(value: Any, param: str) -> None:
    """400 naming `param` when `value` nests deeper than MAX_SCHEMA_DEPTH (what follows walks
    schemas recursively; a deeper one would exhaust the interpreter's stack)."""
    level, depth = [value] if isinstance(value, dict | list) else [], 0  # true, false: leaves
    while level:
        depth += 1
        if depth > MAX_SCHEMA_DEPTH:
            raise ApiError.bad_request(f"{param} nests deeper than {MAX_SCHEMA_DEPTH} levels",
                                       param=param)
        level = [v for x in level for v in (x.values() if isinstance(x, dict) else x)
                 if isinstance(v, dict | list)]


def closed(schema: Any) -> Any:
    """A copy of `schema` whose objects that declare `properties` but say nothing of
    `additionalProperties` admit no others (OpenAI's strict mode requires this of every object;
    tool arguments get it too). A small model shown an open schema writes the schema's own
    keywords as extra arguments; constrained to the declared ones it fills them in."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: closed(v) for k, v in out[key].items()}
    for key in (*SUBSCHEMA_LISTS, "items", "additionalProperties", "not"):
        if key in out:
            out[key] = closed(out[key])
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def guided_grammar(fields: Any) -> tuple[Grammar, str] | None:
    """The grammar of the `guided_*` extras and the field that carried it; at most one."""
    given = [(name, getattr(fields, name)) for name in
             ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
             if getattr(fields, name, None) is not None]
    if not given:
        return None
    if len(given) > 1:
        raise ApiError.bad_request(f"Give at most one of guided_json, guided_regex, "
                                   f"guided_choice, guided_grammar (got "
                                   f"{', '.join(n for n, _ in given)})", param=given[1][0])
    name, value = given[0]
    if name == "guided_json":
        if isinstance(value, str):
            return Grammar("json_schema", value), name
        if not isinstance(value, dict | bool):
            raise ApiError.bad_request("guided_json must be a JSON schema (an object or its "
                                       "JSON text)", param=name)
        check_depth(value, name)
        return Grammar.json_schema(value), name
    if name == "guided_choice":
        if (not isinstance(value, list) or not value or len(value) > MAX_CHOICES
                or not all(isinstance(v, str) and v for v in value)):
            raise ApiError.bad_request(f"guided_choice must be a list of 1 to {MAX_CHOICES} "
                                       "non-empty strings", param=name)
        return Grammar.choice(value), name
    if not isinstance(value, str) or not value:
        raise ApiError.bad_request(f"{name} must be a non-empty string", param=name)
    return (Grammar.regex(value) if name == "guided_regex" else Grammar.lark_or_gbnf(value)), name


def compile_grammar(compiler: GrammarCompiler, grammar: Grammar, param: str) -> CompiledGrammar:
    """Compile, or a 400 naming `param` with the compiler's reason."""
    try:
        return compiler.compile(grammar)
    except InvalidGrammar as exc:
        raise ApiError.bad_request(f"{param} is not a valid grammar: {exc.reason}",
                                   param=param) from None


def compile_requested(compiler: GrammarCompiler | None,
                      grammar: tuple[Grammar, str] | None) -> CompiledGrammar | None:
    """The request's grammar (and the parameter that carried it) compiled; None without one."""
    if grammar is None:
        return None
    if compiler is None:
        raise RuntimeError("a grammar compiler is needed for structured outputs")
    return compile_grammar(compiler, *grammar)
