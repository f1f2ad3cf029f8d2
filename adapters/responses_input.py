"""The Responses API's `input` → chat messages, and the input items the store keeps (with ids, as
GET /v1/responses/{id}/input_items lists them).

`message` items keep their role (`developer` as chat renders it), `function_call` items become an
assistant message's `tool_calls`, and `function_call_output` items `tool` messages. `reasoning`
items (a client sending back an earlier answer's thinking) are kept as items but not rendered:
chat templates drop the thinking of earlier turns, so the prompt is the one chat would run.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from adapters.errors import ApiError
from adapters.limits import MAX_CONTENT_PARTS, MAX_MESSAGES

ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
ROLES = ("system", "developer", "user", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def as_object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ApiError.bad_request(f"{where} must be an object", param=where)
    return value


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise ApiError.bad_request(f"{where}.{key} must be a non-empty string",
                                   param=f"{where}.{key}", code="missing_required_parameter"
                                   if value is None else "invalid_value")
    return value


def _texts(content: Any, where: str) -> list[str]:
    """A message's (or a tool output's) content as its texts; non-text parts are refused."""
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise ApiError.bad_request(f"{where} must be a string or a list of content parts",
                                   param=where)
    if len(content) > MAX_CONTENT_PARTS:
        raise ApiError.bad_request(f"{where} takes at most {MAX_CONTENT_PARTS} parts, got "
                                   f"{len(content)}", param=where)
    texts = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        kind = as_object(part, at).get("type")
        if kind not in TEXT_PARTS:
            raise ApiError.unsupported(f"{at}.type", f" (content part {kind!r}: text only)")
        if not isinstance(part.get("text"), str):
            raise ApiError.bad_request(f"{at}.text must be a string", param=f"{at}.text")
        texts.append(part["text"])
    return texts


def _arguments(item: dict[str, Any], where: str) -> str:
    args = item.get("arguments")
    try:
        parsed = json.loads(args) if isinstance(args, str) else None
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        raise ApiError.bad_request(f"{where}.arguments must be a JSON object in a string, got "
                                   f"{str(args)[:80]!r}", param=f"{where}.arguments")
    return args


def _call_ids(messages: list[dict[str, Any]]) -> set[str]:
    return {c["id"] for m in messages for c in m.get("tool_calls") or ()}


class InputReader:
    """Reads `input` into chat messages and the stored input items (with ids, as
    GET /v1/responses/{id}/input_items lists them). `history` is the conversation this input
    continues: a `function_call_output` must answer a call made there or earlier in the input."""

    def __init__(self, history: list[dict[str, Any]]):
        self.calls = _call_ids(history)
        self.messages: list[dict[str, Any]] = []
        self.items: list[dict[str, Any]] = []

    def read(self, value: Any) -> None:
        if value is None:
            raise ApiError.bad_request("input is required", param="input",
                                       code="missing_required_parameter")
        if isinstance(value, str):
            value = [{"type": "message", "role": "user", "content": value}]
        if not value:
            raise ApiError.bad_request("input must not be empty", param="input")
        if len(value) > MAX_MESSAGES:
            raise ApiError.bad_request(f"input takes at most {MAX_MESSAGES} items, got "
                                       f"{len(value)}", param="input")
        for i, item in enumerate(value):
            where = f"input[{i}]"
            item = as_object(item, where)
            kind = item.get("type", "message" if "role" in item else None)
            if kind not in ITEM_TYPES:
                raise ApiError.bad_request(f"{where}.type must be one of "
                                           f"{', '.join(ITEM_TYPES)}, got {kind!r}",
                                           param=f"{where}.type")
            getattr(self, f"_{kind}")(item, where)

    def _message(self, item: dict[str, Any], where: str) -> None:
        role = item.get("role")
        if role not in ROLES:
            raise ApiError.bad_request(f"{where}.role must be one of {', '.join(ROLES)}, got "
                                       f"{role!r}", param=f"{where}.role")
        if "content" not in item:
            raise ApiError.bad_request(f"{where}.content is required", param=f"{where}.content",
                                       code="missing_required_parameter")
        texts = _texts(item["content"], f"{where}.content")
        self.messages.append({"role": role, "content": "\n".join(texts)})
        kind = "output_text" if role == "assistant" else "input_text"
        parts = [{"type": kind, "text": t} | ({"annotations": [], "logprobs": []}
                                              if role == "assistant" else {}) for t in texts]
        self.items.append({"id": item.get("id") or new_id("msg"), "type": "message",
                           "role": role, "status": "completed", "content": parts})

    def _function_call(self, item: dict[str, Any], where: str) -> None:
        call_id, name = _string(item, "call_id", where), _string(item, "name", where)
        args = _arguments(item, where)
        call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
        last = self.messages[-1] if self.messages else None
        if last is not None and last["role"] == "assistant":  # one turn's text and calls
            last.setdefault("tool_calls", []).append(call)
        else:
            self.messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        self.calls.add(call_id)
        self.items.append({"id": item.get("id") or new_id("fc"), "type": "function_call",
                           "call_id": call_id, "name": name, "arguments": args,
                           "status": "completed"})

    def _function_call_output(self, item: dict[str, Any], where: str) -> None:
        call_id = _string(item, "call_id", where)
        if call_id not in self.calls:
            raise ApiError.bad_request(f"{where}.call_id {call_id!r} matches no function_call "
                                       "in the input or the previous response",
                                       param=f"{where}.call_id")
        if "output" not in item:
            raise ApiError.bad_request(f"{where}.output is required", param=f"{where}.output",
                                       code="missing_required_parameter")
        output = "\n".join(_texts(item["output"], f"{where}.output"))
        self.messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        self.items.append({"id": item.get("id") or new_id("fco"),
                           "type": "function_call_output", "call_id": call_id,
                           "output": output, "status": "completed"})

    def _reasoning(self, item: dict[str, Any], where: str) -> None:
        """An earlier answer's thinking, kept as an item and not rendered: chat templates drop
        the thinking of earlier turns."""
        kept: dict[str, Any] = {"id": item.get("id") or new_id("rs"), "type": "reasoning"}
        for key in ("summary", "content"):
            parts = item.get(key, [] if key == "summary" else None)
            if parts is None:
                continue
            if not isinstance(parts, list):
                raise ApiError.bad_request(f"{where}.{key} must be a list of parts",
                                           param=f"{where}.{key}")
            kept[key] = [as_object(part, f"{where}.{key}[{j}]") for j, part in enumerate(parts)]
        if isinstance(item.get("encrypted_content"), str):
            kept["encrypted_content"] = item["encrypted_content"]
        self.items.append({**kept, "status": "completed"})
