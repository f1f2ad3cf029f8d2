"""Compare two JSON Schemas the way a client of the other API would: field names and value types.

OpenAI's document describes a value in many shapes ($ref chains, allOf merges, anyOf/oneOf unions,
the OpenAPI 3.0 `nullable: true`); ours is msgspec output. Both are reduced to the same questions:
which JSON types may this value take, which enum values, which properties (required or not), which
array items. Direction matters:

- a request schema must *accept* everything OpenAI's accepts for a field we share (clients send
  OpenAI-shaped values, explicit nulls included), and must not require what OpenAI leaves optional;
- a response schema must *stay inside* OpenAI's (the SDKs parse our bodies with OpenAI's types) and
  must promise every field OpenAI requires.

Fields on our side only are extensions; they are listed, not judged.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

Direction = Literal["request", "response"]
Schema = dict[str, Any]

_MAX_DEPTH = 8


@dataclass(frozen=True)
class Problem:
    """One disagreement: where (a dotted path, `[]` for array items), what kind, and how."""

    path: str
    kind: Literal["type", "enum", "required"]
    message: str

    def __str__(self) -> str:
        return f"{self.path or '(root)'}: {self.message}"


@dataclass
class Comparison:
    """Where our schema and OpenAI's disagree (`problems`) and what only we have (`extensions`)."""

    problems: list[Problem] = field(default_factory=list)
    extensions: list[str] = field(default_factory=list)


class SchemaView:
    """Reads schemas within one root document (for `$ref`), flattening unions and merges."""

    def __init__(self, root: Schema):
        self.root = root

    def deref(self, schema: Schema) -> Schema:
        seen = 0
        while isinstance(schema, dict) and "$ref" in schema:
            ref = schema["$ref"]
            if not ref.startswith("#/") or seen > 50:
                raise ValueError(f"cannot resolve $ref {ref!r}")
            node: Any = self.root
            for part in ref[2:].split("/"):
                node = node[part.replace("~1", "/").replace("~0", "~")]
            extra = {k: v for k, v in schema.items() if k not in ("$ref", "description")}
            schema = {**node, **extra}
            seen += 1
        return schema

    def variants(self, schema: Schema) -> Iterator[Schema]:
        """The alternatives a value may take: anyOf/oneOf flattened, allOf merged, nullable split
        into a separate null alternative."""
        schema = self.deref(schema)
        if schema.get("nullable"):
            yield {"type": "null"}
            schema = {k: v for k, v in schema.items() if k != "nullable"}
        if "allOf" in schema:
            schema = self._merge([schema, *schema["allOf"]])
        union = schema.get("anyOf") or schema.get("oneOf")
        if union:
            rest = {k: v for k, v in schema.items() if k not in ("anyOf", "oneOf", "description")}
            for alt in union:
                yield from self.variants({**rest, **alt} if _shapeful(rest) else alt)
            return
        yield schema

    def _merge(self, parts: list[Schema]) -> Schema:
        merged: Schema = {"properties": {}, "required": []}
        for part in parts:
            part = self.deref(part)
            if "allOf" in part and part is not parts[0]:
                part = self._merge([part, *part["allOf"]])
            for key, value in part.items():
                if key == "properties":
                    merged["properties"].update(value)
                elif key == "required":
                    merged["required"] += list(value)
                elif key not in ("allOf", "$ref"):
                    merged.setdefault(key, value)
        if not merged["properties"]:
            del merged["properties"]
        return merged

    def types(self, schema: Schema) -> frozenset[str] | None:
        """The JSON types the value may take; None when it may be anything."""
        found: set[str] = set()
        for v in self.variants(schema):
            t = _types_of(v)
            if t is None:
                return None
            found |= t
        return frozenset(found)

    def enum(self, schema: Schema) -> frozenset | None:
        """The allowed values when every non-null alternative is an enum; else None."""
        values: set = set()
        for v in self.variants(schema):
            if v.get("type") == "null":
                continue
            if "const" in v:
                values.add(v["const"])
            elif "enum" in v:
                values |= {x for x in v["enum"] if x is not None}
            else:
                return None
        return frozenset(values) if values else None

    def properties(self, schema: Schema) -> tuple[dict[str, list[Schema]], set[str]]:
        """Properties over the object alternatives, and the names every alternative requires."""
        props: dict[str, list[Schema]] = {}
        required: set[str] | None = None
        for v in self.variants(schema):
            if "object" not in (_types_of(v) or {"object"}) or "properties" not in v:
                continue
            for name, sub in v["properties"].items():
                props.setdefault(name, []).append(sub)
            req = set(v.get("required", ()))
            required = req if required is None else required & req
        return props, required or set()

    def items(self, schema: Schema) -> list[Schema]:
        return [v["items"] for v in self.variants(schema) if isinstance(v.get("items"), dict)]


def _shapeful(schema: Schema) -> bool:
    return any(k in schema for k in ("type", "properties", "items", "enum"))


def _types_of(v: Schema) -> frozenset[str] | None:
    t = v.get("type")
    if isinstance(t, str):
        return frozenset({t})
    if isinstance(t, list):
        return frozenset(t)
    if "const" in v:
        return frozenset({_json_type(v["const"])})
    if "enum" in v:
        return frozenset(_json_type(x) for x in v["enum"])
    if "properties" in v:
        return frozenset({"object"})
    if "items" in v:
        return frozenset({"array"})
    return None


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    return {float: "number", str: "string", list: "array", dict: "object"}[type(value)]


def _accepts(outer: frozenset[str] | None, inner: frozenset[str] | None) -> bool:
    """Does a value of any type in `inner` also fit `outer`? (integer fits number.)"""
    if outer is None:
        return True
    if inner is None:
        return False
    return all(t in outer or (t == "integer" and "number" in outer) for t in inner)


class _Comparer:
    def __init__(self, ours: SchemaView, theirs: SchemaView, direction: Direction):
        self.ours, self.theirs, self.direction = ours, theirs, direction
        self.result = Comparison()

    def compare(self, ours: list[Schema], theirs: list[Schema], path: str, depth: int) -> None:
        o_types = _union(self.ours.types(s) for s in ours)
        t_types = _union(self.theirs.types(s) for s in theirs)
        if self.direction == "request":
            ok, what = _accepts(o_types, t_types), "does not accept"
        else:
            ok, what = _accepts(t_types, o_types), "may send"
        if not ok:
            self._problem(path, "type", f"types differ: ours {_fmt(o_types)}, OpenAI's "
                                        f"{_fmt(t_types)} (ours {what} what OpenAI's clients "
                                        "expect)")
            return
        self._compare_enums(ours, theirs, path)
        if depth >= _MAX_DEPTH:
            return
        o_props, o_req = _props(self.ours, ours)
        t_props, t_req = _props(self.theirs, theirs)
        if o_props and t_props:
            self._compare_required(o_req, t_req, set(o_props), path)
            for name in sorted(o_props):
                sub = f"{path}.{name}" if path else name
                if name not in t_props:
                    self.result.extensions.append(sub)
                else:
                    self.compare(o_props[name], t_props[name], sub, depth + 1)
        o_items = [i for s in ours for i in self.ours.items(s)]
        t_items = [i for s in theirs for i in self.theirs.items(s)]
        if o_items and t_items:
            self.compare(o_items, t_items, f"{path}[]", depth + 1)

    def _compare_enums(self, ours: list[Schema], theirs: list[Schema], path: str) -> None:
        o_enum = _union(self.ours.enum(s) for s in ours)
        t_enum = _union(self.theirs.enum(s) for s in theirs)
        if o_enum is None or t_enum is None:
            return
        if self.direction == "request" and not t_enum <= o_enum:
            missing = sorted(map(str, t_enum - o_enum))
            self._problem(path, "enum", f"refuses OpenAI values {missing}")
        if self.direction == "response" and not o_enum <= t_enum:
            self._problem(path, "enum", f"may send values OpenAI does not define "
                                        f"{sorted(map(str, o_enum - t_enum))}")

    def _compare_required(self, o_req: set[str], t_req: set[str], o_names: set[str],
                          path: str) -> None:
        where = f"{path}." if path else ""
        if self.direction == "request":
            for name in sorted(o_req - t_req):
                self._problem(where + name, "required", "required by us, optional in OpenAI's API")
        else:
            for name in sorted(t_req - o_req):
                missing = "not sent" if name not in o_names else "not promised (not required)"
                self._problem(where + name, "required", f"required by OpenAI, {missing} by us")

    def _problem(self, path: str, kind: str, text: str) -> None:
        self.result.problems.append(Problem(path, kind, text))


def _props(view: SchemaView, schemas: list[Schema]) -> tuple[dict[str, list[Schema]], set[str]]:
    props: dict[str, list[Schema]] = {}
    required: set[str] = set()
    for s in schemas:
        p, r = view.properties(s)
        for name, subs in p.items():
            props.setdefault(name, []).extend(subs)
        required |= r
    return props, required


def _union(sets: Iterator[frozenset | None]) -> frozenset | None:
    out: set = set()
    for s in sets:
        if s is None:
            return None
        out |= s
    return frozenset(out)


def _fmt(types: frozenset[str] | None) -> str:
    return "any" if types is None else "|".join(sorted(types))


def compare(ours: Schema, our_root: Schema, theirs: Schema, their_root: Schema,
            direction: Direction) -> Comparison:
    """Compare our schema (inside document `our_root`) with OpenAI's (inside `their_root`)."""
    comparer = _Comparer(SchemaView(our_root), SchemaView(their_root), direction)
    comparer.compare([ours], [theirs], "", 0)
    return comparer.result
