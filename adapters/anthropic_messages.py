"""POST /v1/messages (Anthropic): a Messages request → the chat request it means → one engine job
through the chat adapter (template, tools and their grammar, limits); and errors in Anthropic's
shape.

The translation is block by block: `system` becomes the leading system message; text blocks become
message text; an assistant's `tool_use` blocks become its `tool_calls`, and its `thinking` and
`redacted_thinking` blocks are left out (chat templates drop earlier turns' thinking); a user's
`tool_result` blocks become `tool` messages, each of which must answer a `tool_use` of the
assistant message just before it. Tools map to function tools, `tool_choice` to chat's (`any` is
`required`) and `thinking` to the template's `enable_thinking`. Anything else is refused with a
400 naming the block, before anything is tokenized.
"""

from __future__ import annotations

import json
from typing import Any

from adapters.anthropic_thinking import template_thinking
from adapters.anthropic_types import CountTokensRequest, ErrorDetail, ErrorResponse, MessagesRequest
from adapters.errors import ApiError, ParamNames
from adapters.limits import MAX_CONTENT_PARTS
from adapters.openai_chat import build_chat_job, chat_prompt
from adapters.openai_params import JobSpec
from adapters.openai_types import ChatCompletionRequest, ChatMessage
from engine.sample.grammar import GrammarCompiler

# The engine's parameter names as Anthropic's API spells them.
MESSAGES_NAMES = ParamNames({"max_new_tokens": "max_tokens", "prompt": "messages",
                             "stop": "stop_sequences"})

_BLOCKS = {"user": ("text", "tool_result"),
           "assistant": ("text", "tool_use", "thinking", "redacted_thinking")}
_CHOICES = {"auto": "auto", "any": "required", "none": "none"}

# Error types by status, as Anthropic names them (529 overloaded is our 503).
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 408: "timeout_error",
                413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def error_body(status: int, message: str, param: str | None = None) -> ErrorResponse:
    """Anthropic's error shape. It has no `param`, so the field leads the message when the
    message does not already name it."""
    if param and param not in message:
        message = f"{param}: {message}"
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return ErrorResponse(ErrorDetail(kind, message))


def anthropic_error(err: ApiError) -> ErrorResponse:
    return error_body(err.status, err.message, err.param)


def _bad(message: str, param: str, code: str = "invalid_value") -> ApiError:
    return ApiError.bad_request(message, param=param, code=code)


# -- content ----------------------------------------------------------------------------------

def _text_of(block: dict[str, Any], where: str) -> str:
    if not isinstance(block.get("text"), str):
        raise _bad(f"{where}.text must be a string", f"{where}.text")
    return block["text"]


def _blocks(content: str | list[Any], allowed: tuple[str, ...], where: str
            ) -> list[tuple[str, dict[str, Any]]]:
    """A content value (at path `where`) as (path, block) pairs, each an object of an allowed
    type."""
    if isinstance(content, str):
        return [(where, {"type": "text", "text": content})]
    if not content:
        raise _bad(f"{where} must not be empty", where)
    if len(content) > MAX_CONTENT_PARTS:
        raise _bad(f"{where} takes at most {MAX_CONTENT_PARTS} blocks, got {len(content)}",
                   where)
    out = []
    for j, block in enumerate(content):
        at = f"{where}[{j}]"
        if not isinstance(block, dict):
            raise _bad(f"{at} must be a content block object", at)
        if block.get("type") not in allowed:
            raise _bad(f"{at}.type must be one of {', '.join(allowed)} here, got "
                       f"{block.get('type')!r}", f"{at}.type")
        out.append((at, block))
    return out


def _result_text(block: dict[str, Any], at: str) -> str:
    """A tool_result's content (a string or text blocks) as text; an error result says so,
    since the chat formats have no flag for it."""
    content = block.get("content", "")
    if isinstance(content, list):
        content = "\n".join(_text_of(b, w) for w, b in _blocks(content, ("text",),
                                                                f"{at}.content"))
    elif not isinstance(content, str):
        raise _bad(f"{at}.content must be a string or a list of text blocks", f"{at}.content")
    if block.get("is_error") is True:
        content = f"Error: {content}"
    return content


def _user(content: str | list[Any], where: str, calls: set[str]) -> list[ChatMessage]:
    """A user turn: its tool results as `tool` messages (each answering one of `calls`, the
    previous assistant turn's tool_use ids), then its text."""
    out, texts = [], []
    for at, block in _blocks(content, _BLOCKS["user"], f"{where}.content"):
        if block["type"] == "text":
            texts.append(_text_of(block, at))
            continue
        ref = block.get("tool_use_id")
        if not isinstance(ref, str) or ref not in calls:
            raise _bad(f"{at}.tool_use_id {ref!r} matches no tool_use block in the previous "
                       "assistant message", f"{at}.tool_use_id")
        out.append(ChatMessage(role="tool", content=_result_text(block, at), tool_call_id=ref))
    if texts:
        out.append(ChatMessage(role="user", content="\n".join(texts)))
    return out


def _assistant(content: str | list[Any], where: str) -> tuple[ChatMessage, set[str]]:
    """An assistant turn as a chat message with `tool_calls`, and its tool_use ids."""
    texts, calls = [], []
    for at, block in _blocks(content, _BLOCKS["assistant"], f"{where}.content"):
        if block["type"] in ("thinking", "redacted_thinking"):
            continue
        if block["type"] == "text":
            texts.append(_text_of(block, at))
            continue
        ident, name, args = block.get("id"), block.get("name"), block.get("input")
        if not isinstance(ident, str) or not ident:
            raise _bad(f"{at}.id must be a non-empty string", f"{at}.id")
        if not isinstance(name, str):
            raise _bad(f"{at}.name must be a string", f"{at}.name")
        if not isinstance(args, dict):
            raise _bad(f"{at}.input must be an object", f"{at}.input")
        calls.append({"id": ident, "type": "function",
                      "function": {"name": name, "arguments": json.dumps(args)}})
    text = "\n".join(texts)
    message = ChatMessage(role="assistant", content=text if text or not calls else None,
                          tool_calls=calls or None)
    return message, {c["id"] for c in calls}


def _system(system: str | list[Any] | None) -> list[ChatMessage]:
    if system is None:
        return []
    if isinstance(system, list) and system:
        system = "\n".join(_text_of(b, at) for at, b in _blocks(system, ("text",), "system"))
    return [ChatMessage(role="system", content=system)] if system else []


def chat_messages(req: CountTokensRequest) -> list[ChatMessage]:
    """The conversation as chat messages (see the module's docstring)."""
    out = _system(req.system)
    calls: set[str] = set()
    for i, m in enumerate(req.messages):
        where = f"messages[{i}]"
        if m.role == "user":
            out += _user(m.content, where, calls)
            calls = set()
        elif m.role == "assistant":
            message, calls = _assistant(m.content, where)
            out.append(message)
        else:
            raise _bad(f"{where}.role must be user or assistant, got {m.role!r}",
                       f"{where}.role")
    if req.messages and req.messages[-1].role == "assistant":
        # Anthropic continues a final assistant message; chat templates close it as a turn.
        raise _bad("the last message must be the user's: continuing a final assistant message "
                   "(prefill) is not supported", f"messages[{len(req.messages) - 1}].role")
    return out


# -- tools ------------------------------------------------------------------------------------

def chat_tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    """Client tools (name, description, input_schema) as function tools; server tools (a
    `type` such as web_search_20250305) are refused by name."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise _bad(f"{where} must be an object", where)
        if tool.get("type") not in (None, "custom"):
            raise ApiError.unsupported(f"{where}.type", f" (tool type {tool['type']!r}: only "
                                       "client tools with name and input_schema)")
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise _bad(f"{where}.input_schema is required: a JSON schema object",
                       f"{where}.input_schema",
                       "missing_required_parameter" if schema is None else "invalid_value")
        out.append({"type": "function", "function": {
            "name": tool.get("name"), "description": tool.get("description"),
            "parameters": schema}})
    return out


def chat_tool_choice(choice: dict[str, Any] | None) -> tuple[Any, bool | None]:
    """`tool_choice` as chat's, and parallel_tool_calls (from disable_parallel_tool_use)."""
    if choice is None:
        return None, None
    serial = choice.get("disable_parallel_tool_use")
    if serial is not None and not isinstance(serial, bool):
        raise _bad("tool_choice.disable_parallel_tool_use must be a boolean",
                   "tool_choice.disable_parallel_tool_use")
    parallel = None if serial is None else not serial
    kind = choice.get("type")
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise _bad("tool_choice.name is required with type 'tool'", "tool_choice.name",
                       "missing_required_parameter")
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    if not isinstance(kind, str) or kind not in _CHOICES:
        raise _bad(f"tool_choice.type must be one of auto, any, tool, none, got {kind!r}",
                   "tool_choice.type")
    return _CHOICES[kind], parallel


# -- the job ----------------------------------------------------------------------------------

def response_format(output_config: dict[str, Any] | None) -> dict[str, Any] | None:
    """`output_config.format` (a JSON schema the answer follows) as chat's strict
    response_format, so it takes the same grammar path."""
    fmt = (output_config or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise _bad("output_config.format.type must be 'json_schema'", "output_config.format.type")
    return {"type": "json_schema", "json_schema": {"name": "output", "strict": True,
                                                   "schema": fmt.get("schema")}}


def chat_request(req: CountTokensRequest) -> ChatCompletionRequest:
    """The chat request a Messages (or count_tokens) request means."""
    choice, parallel = chat_tool_choice(req.tool_choice)
    max_tokens = req.max_tokens if isinstance(req, MessagesRequest) else None
    chat = ChatCompletionRequest(messages=chat_messages(req), tools=chat_tools(req.tools),
                                 tool_choice=choice, parallel_tool_calls=parallel,
                                 chat_template_kwargs=template_thinking(req.thinking, max_tokens))
    if isinstance(req, MessagesRequest):
        chat.max_tokens, chat.stop = req.max_tokens, req.stop_sequences
        chat.temperature, chat.top_p, chat.top_k = req.temperature, req.top_p, req.top_k
        chat.response_format = response_format(req.output_config)
    return chat


def _anthropic_paths(err: ApiError) -> ApiError:
    """An error from the chat adapter, its tool paths as Anthropic's tools spell them."""
    def fix(text: str) -> str:
        return (text.replace(".function.parameters", ".input_schema")
                .replace(".function.", ".").replace("].function", "]")
                .replace("response_format.json_schema.schema", "output_config.format.schema")
                .replace("response_format", "output_config.format"))

    err.message = fix(err.message)
    err.param = fix(err.param) if err.param else err.param
    return err


def build_messages_job(req: MessagesRequest, tokenizer, max_model_len: int,
                       max_tokens_limit: int = 0, grammars: GrammarCompiler | None = None,
                       schema_prompt: bool = True, reasoning_parser: str = "none") -> JobSpec:
    """One engine job for a Messages request; raises ApiError before any submission."""
    if req.max_tokens >= max_model_len:
        # The engine's check would blame the prompt (chat's max_tokens is optional; this one
        # is required, and no prompt can fit beside it).
        raise ApiError.bad_request(
            f"max_tokens is {req.max_tokens}, but this model's maximum context length is "
            f"{max_model_len} tokens, prompt included (context_length_exceeded)",
            param="max_tokens", code="context_length_exceeded")
    try:
        return build_chat_job(chat_request(req), tokenizer, max_model_len, max_tokens_limit,
                              grammars, MESSAGES_NAMES, schema_prompt, reasoning_parser)
    except ApiError as err:
        raise _anthropic_paths(err) from None


def count_tokens(req: CountTokensRequest, tokenizer, max_model_len: int,
                 schema_prompt: bool = True) -> int:
    """The prompt tokens a Messages request with this conversation and these tools runs."""
    try:
        return len(chat_prompt(chat_request(req), tokenizer, max_model_len, schema_prompt)[0])
    except ApiError as err:
        raise _anthropic_paths(err) from None
