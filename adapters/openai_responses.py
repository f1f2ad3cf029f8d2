"""POST /v1/responses (OpenAI's Responses API) → the chat request that /v1/chat/completions
builds, so tools, tool_choice, structured outputs, limits and the prefix cache work as they do
for chat.

The input items become chat messages: `message` items keep their role (`developer` as chat
renders it), `function_call` items become an assistant message's `tool_calls`, and
`function_call_output` items `tool` messages. `instructions` lead as a system message and are
not carried to the next turn (OpenAI's rule); the conversation a `previous_response_id` names
is the stored history of chat messages, which this input extends. Errors raised by the chat
path are renamed to this API's fields (`response_format` → `text.format`, `messages` →
`input`), so a client reads the field it sent.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from adapters.errors import ApiError, ParamNames
from adapters.limits import MAX_CONTENT_PARTS, MAX_MESSAGES
from adapters.openai_chat import build_chat_job
from adapters.openai_params import JobSpec
from adapters.openai_types import ChatCompletionRequest, ChatMessage, SamplingFields, convert
from adapters.responses_types import ResponsesRequest
from engine.sample.grammar import GrammarCompiler

# How engine refusals (at submission) name the parameters on this route.
RESPONSES_NAMES = ParamNames({"max_new_tokens": "max_output_tokens",
                              "min_new_tokens": "min_tokens", "prompt": "input"})

ITEM_TYPES = ("message", "function_call", "function_call_output")
ROLES = ("system", "developer", "user", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")
MAX_METADATA = 16  # OpenAI's bounds on `metadata`: pairs, key and value lengths
MAX_METADATA_KEY, MAX_METADATA_VALUE = 64, 512

# Chat's parameter names → this API's, most specific first (applied to param and message).
_RENAMES = (
    (re.compile(r"\bresponse_format\.json_schema\."), "text.format."),
    (re.compile(r"\bresponse_format\.json_schema\b"), "text.format"),
    (re.compile(r"\bresponse_format\b"), "text.format"),
    (re.compile(r"\bmax_completion_tokens\b"), "max_output_tokens"),
    (re.compile(r"\b(tools\[\d+\])\.function\b"), r"\1"),
    # Chat's message indices count the instructions and history: the input is named whole.
    (re.compile(r"\bmessages(\[\d+\](\.\w+)*)?"), "input"),
)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def check_supported(req: ResponsesRequest) -> None:
    """Refuse, by name, what this server cannot honour (silence would mislead)."""
    if req.background:
        raise ApiError.unsupported("background", " (responses run in the foreground; stream "
                                   "and cancel with POST /v1/responses/{id}/cancel)")
    for name in ("conversation", "prompt"):
        if getattr(req, name) is not None:
            raise ApiError.unsupported(name)
    if req.truncation not in (None, "disabled"):
        raise ApiError.unsupported("truncation", " (only 'disabled': an input over the "
                                   "context is refused)")
    if req.top_logprobs:
        raise ApiError.unsupported("top_logprobs")
    if req.n not in (None, 1):
        raise ApiError.unsupported("n", " (a response has one output)")
    _check_metadata(req.metadata)


def _check_metadata(metadata: dict[str, str] | None) -> None:
    if not metadata:
        return
    if len(metadata) > MAX_METADATA:
        raise ApiError.bad_request(f"metadata takes at most {MAX_METADATA} pairs, got "
                                   f"{len(metadata)}", param="metadata")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
            raise ApiError.bad_request(f"metadata keys take at most {MAX_METADATA_KEY} "
                                       f"characters and values {MAX_METADATA_VALUE} (key "
                                       f"{key[:80]!r})", param=f"metadata.{key[:80]}")


# -- input items → chat messages --------------------------------------------------------------

def _obj(value: Any, where: str) -> dict[str, Any]:
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
        kind = _obj(part, at).get("type")
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
            item = _obj(item, where)
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


# -- tools and formats → chat's fields --------------------------------------------------------

def chat_tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    """Function tools in chat's shape; other (built-in) tools refused by name."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ApiError.bad_request("tools must be an array", param="tools")
    out = []
    for i, tool in enumerate(tools):
        kind = _obj(tool, f"tools[{i}]").get("type")
        if kind != "function":
            raise ApiError.unsupported(f"tools[{i}].type", f" (the built-in tool {kind!r}: "
                                       "only function tools are supported)")
        fn = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: Any) -> Any:
    """`{"type": "function", "name": ...}` in chat's shape; other objects refused by name."""
    if not isinstance(choice, dict):
        return choice  # none | auto | required, or a bad value chat names
    if choice.get("type") != "function":
        raise ApiError.unsupported("tool_choice", f" (tool choice {choice.get('type')!r}: "
                                   "none, auto, required or a function)")
    return {"type": "function", "function": {"name": choice.get("name")}}


def chat_response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` in chat's `response_format` shape (json_schema's fields nested)."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    fmt = _obj(fmt, "text.format")
    if fmt.get("type") != "json_schema":
        return fmt
    spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": spec}


def renamed(err: ApiError) -> ApiError:
    """A chat-path error with its parameter names as this API spells them."""
    param, message = err.param, err.message
    for pattern, name in _RENAMES:
        message = pattern.sub(name, message)
        param = pattern.sub(name, param) if param else param
    return ApiError(err.status, message, err.code, param, err.type, dict(err.headers))


@contextmanager
def responses_names() -> Iterator[None]:
    try:
        yield
    except ApiError as err:
        raise renamed(err) from None


# -- the job ----------------------------------------------------------------------------------

@dataclass
class ResponsesJob:
    """What a Responses request becomes: the engine job, and what the store keeps."""

    spec: JobSpec
    history: list[dict[str, Any]]  # the conversation so far, this input included
    input_items: list[dict[str, Any]]  # this request's input, as items with ids


def chat_request(req: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request this Responses request means (sampling fields and extras carried)."""
    shared = {name: getattr(req, name) for name in SamplingFields.__struct_fields__}
    if req.stream_options is not None:  # Responses' options (include_obfuscation) mean nothing
        shared["stream_options"] = None  # to chat's stream, which is ours to shape
    return ChatCompletionRequest(
        **shared,
        messages=[convert(m, ChatMessage) for m in messages],
        max_completion_tokens=req.max_output_tokens,
        tools=chat_tools(req.tools),
        tool_choice=chat_tool_choice(req.tool_choice),
        parallel_tool_calls=req.parallel_tool_calls,
        response_format=chat_response_format(req.text),
    )


def build_responses_job(req: ResponsesRequest, previous: list[dict[str, Any]] | None,
                        tokenizer, max_model_len: int, max_tokens_limit: int = 0,
                        grammars: GrammarCompiler | None = None,
                        schema_prompt: bool = True) -> ResponsesJob:
    """Translate a Responses request (continuing `previous`, the stored conversation of its
    previous_response_id) into one engine job; raises ApiError before any submission."""
    check_supported(req)
    history = list(previous or [])
    reader = InputReader(history)
    reader.read(req.input)
    instructions = [{"role": "system", "content": req.instructions}] if req.instructions else []
    with responses_names():
        chat = chat_request(req, [*instructions, *history, *reader.messages])
        spec = build_chat_job(chat, tokenizer, max_model_len, max_tokens_limit, grammars,
                              RESPONSES_NAMES, schema_prompt)
    return ResponsesJob(spec, history + reader.messages, reader.items)
