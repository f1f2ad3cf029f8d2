"""POST /v1/responses (OpenAI's Responses API) → the chat request that /v1/chat/completions
builds, so tools, tool_choice, structured outputs, reasoning, limits and the prefix cache work
as they do for chat.

The input items become chat messages (adapters/responses_input.py). `instructions` lead as a
system message and are not carried to the next turn (OpenAI's rule); the conversation a
`previous_response_id` names is the stored history of chat messages, which this input extends.
`reasoning.effort` reaches the chat template as chat's `reasoning_effort`. Errors raised by the
chat path are renamed to this API's fields (`response_format` → `text.format`, `messages` →
`input`), so a client reads the field it sent.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from adapters.errors import ApiError, ParamNames
from adapters.openai_chat import build_chat_job
from adapters.openai_params import JobSpec
from adapters.openai_types import ChatCompletionRequest, ChatMessage, SamplingFields, convert
from adapters.responses_input import InputReader, as_object
from adapters.responses_types import ResponsesRequest
from engine.sample.grammar import GrammarCompiler

# How engine refusals (at submission) name the parameters on this route.
RESPONSES_NAMES = ParamNames({"max_new_tokens": "max_output_tokens",
                              "min_new_tokens": "min_tokens", "prompt": "input"})

EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")  # OpenAI's
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
    reasoning_effort(req.reasoning)


def reasoning_effort(reasoning: Any) -> str | None:
    """`reasoning.effort`, None where not sent; `reasoning.summary` is accepted, and no summary
    is written (the thinking itself is the reasoning item's content)."""
    if reasoning is None:
        return None
    effort = as_object(reasoning, "reasoning").get("effort")
    if effort is not None and effort not in EFFORTS:
        raise ApiError.bad_request(f"reasoning.effort must be one of {', '.join(EFFORTS)}, "
                                   f"got {effort!r}", param="reasoning.effort")
    return effort


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


# -- tools and formats → chat's fields --------------------------------------------------------

def chat_tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    """Function tools in chat's shape; other (built-in) tools refused by name."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ApiError.bad_request("tools must be an array", param="tools")
    out = []
    for i, tool in enumerate(tools):
        kind = as_object(tool, f"tools[{i}]").get("type")
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
    fmt = as_object(fmt, "text.format")
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
        reasoning_effort=reasoning_effort(req.reasoning),
    )


def build_responses_job(req: ResponsesRequest, previous: list[dict[str, Any]] | None,
                        tokenizer, max_model_len: int, max_tokens_limit: int = 0,
                        grammars: GrammarCompiler | None = None, schema_prompt: bool = True,
                        reasoning_parser: str = "none") -> ResponsesJob:
    """Translate a Responses request (continuing `previous`, the stored conversation of its
    previous_response_id) into one engine job; raises ApiError before any submission. The
    stored conversation holds answers without their thinking, as chat templates render them."""
    check_supported(req)
    history = list(previous or [])
    reader = InputReader(history)
    reader.read(req.input)
    instructions = [{"role": "system", "content": req.instructions}] if req.instructions else []
    with responses_names():
        chat = chat_request(req, [*instructions, *history, *reader.messages])
        spec = build_chat_job(chat, tokenizer, max_model_len, max_tokens_limit, grammars,
                              RESPONSES_NAMES, schema_prompt, reasoning_parser)
    return ResponsesJob(spec, history + reader.messages, reader.items)
