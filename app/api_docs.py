"""OpenAPI documentation for routes that parse their own bodies.

Our handlers read raw bytes and decode them in the adapters (so that nulls, unknown fields and
errors follow OpenAI's rules rather than Litestar's), which leaves Litestar nothing to document.
The schemas therefore come from the same msgspec structs, via `msgspec.json.schema`, and each
route's Operation is filled in by a small `operation_class`. They are inlined rather than put in
`components`, because Litestar replaces `components.schemas` with the ones it generated itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any

import msgspec
import msgspec.inspect as mi
from litestar.openapi.spec import OpenAPIMediaType, OpenAPIResponse, Operation, RequestBody, Schema


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str


class ErrorResponse(msgspec.Struct):
    """OpenAI's error envelope."""

    error: ErrorDetail


def _inline(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            return _inline(defs[ref.removeprefix("#/$defs/")], defs)
        return {k: _inline(v, defs) for k, v in node.items()}
    if isinstance(node, list):
        return [_inline(v, defs) for v in node]
    return node


def _always_sent(t: Any) -> dict[str, list[str]]:
    """Per struct name, the fields every encoded value carries: required ones, and those with a
    default unless the struct omits defaults (UNSET fields are never counted: they may be absent).
    """
    out: dict[str, list[str]] = {}

    def walk(info: Any) -> None:
        if isinstance(info, mi.StructType):
            name = info.cls.__name__
            if name in out:
                return
            omit = info.cls.__struct_config__.omit_defaults
            out[name] = [f.encode_name for f in info.fields if f.required or (
                not omit and f.default is not msgspec.UNSET
                and (f.default is not mi.NODEFAULT or f.default_factory is not mi.NODEFAULT))]
            if info.tag_field is not None:  # a tagged union's member always names its tag
                out[name].append(info.tag_field)
            for f in info.fields:
                walk(f.type)
            return
        for attr in ("types", "item_types"):
            for sub in getattr(info, attr, ()) or ():
                walk(sub)
        for attr in ("item_type", "key_type", "value_type"):
            if (sub := getattr(info, attr, None)) is not None:
                walk(sub)

    walk(mi.type_info(t))
    return out


@cache
def json_schema(t: Any, response: bool = False) -> dict[str, Any]:
    """The type's JSON Schema with every `$defs` reference inlined (our types do not recurse),
    so it stands alone inside an OpenAPI operation. For a response, every field we always send
    is marked required, as clients may rely on it (msgspec marks only fields without defaults).
    """
    schema = msgspec.json.schema(t)
    defs = schema.get("$defs", {})
    if response:
        for name, fields in _always_sent(t).items():
            if name in defs:
                defs[name]["required"] = fields
    return _inline({k: v for k, v in schema.items() if k != "$defs"}, defs)


def _media(t: Any, response: bool = False) -> OpenAPIMediaType:
    return OpenAPIMediaType(schema=json_schema(t, response))  # plain dicts serialise as they are


_ERRORS = {
    "400": "Malformed JSON, a schema violation, an unsupported parameter, or a prompt over the "
           "context length (code context_length_exceeded)",
    "401": "Missing or wrong API key",
    "404": "Unknown model (code model_not_found)",
    "413": "Request body over the limit",
    "429": "Job queue full; retry after Retry-After seconds",
    "503": "Draining for shutdown, or not ready",
}


def documented(request: type | None, response: Any, *,
               stream: type | None = None, stream_media: str = "text/event-stream",
               stream_note: str | None = None,
               errors: tuple[str, ...] = ("400", "401", "404", "413", "429", "503"),
               error: type = ErrorResponse) -> type[Operation]:
    """An Operation class describing a route's JSON body, its responses and its errors (in
    `error`'s shape: OpenAI's envelope unless the route speaks another protocol)."""

    @dataclass
    class DocumentedOperation(Operation):
        def __post_init__(self) -> None:
            if request is not None:
                self.request_body = RequestBody(
                    content={"application/json": _media(request)},
                    required=True)
            content = {}
            if response is not None:
                content["application/json"] = _media(response, response=True)
            if stream is not None:
                desc = stream_note or (
                    f"{stream.__name__} lines" if stream_media != "text/event-stream" else
                    f"with stream=true: {stream.__name__} events, then [DONE]")
                content[stream_media] = OpenAPIMediaType(schema=Schema(description=desc))
            responses: dict = {"200": OpenAPIResponse(description="Success", content=content)}
            for status in errors:
                responses[status] = OpenAPIResponse(
                    description=_ERRORS[status],
                    content={"application/json": _media(error, response=True)})
            self.responses = responses

    return DocumentedOperation
