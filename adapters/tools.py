"""Tool calling for chat: the request's tools checked and normalised, the conversation rendered
with them, the grammar that constrains the answer, and the answer parsed back into `tool_calls`.

One output format serves every model, Hermes's: each call is a block

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Two ways to tell the model about the tools:

- **native** (`hermes`): the chat template renders a `tools` argument and itself speaks this format
  (Qwen2.5, Hermes 2/3 and the templates built on theirs; detected by rendering a probe tool and
  finding `<tool_call>` in the template). Tools, assistant `tool_calls` and `tool` messages are
  passed to the template as it expects them.
- **generic** (every other template, SmolLM2's included): a system message describes the tools and
  the format; assistant calls are rendered as their blocks and tool results as user messages
  wrapped in `<tool_response>`.

Either way a grammar constrains the answer: `auto` to a plain answer (text that does not start
with a call, or the `response_format`'s JSON) or one or more calls; `required` and a named tool
to calls only (of that tool); `none` leaves the answer free and parses nothing. Every call's
arguments satisfy its tool's parameter schema.
"""

from __future__ import annotations

import functools
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from adapters.errors import ApiError
from adapters.limits import MAX_TOOLS
from adapters.structured import check_depth, closed
from engine.sample.grammar import JSON_STYLE

_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
_PROBE = "seqgate_probe_tool"


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]

    def schema(self) -> dict[str, Any]:
        """The OpenAI tool object, as templates and the generic system prompt show it."""
        return {"type": "function", "function": {"name": self.name,
                                                 "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolPlan:
    """What a request asked for: its tools, the choice, and how calls are returned."""

    tools: tuple[Tool, ...]
    choice: str  # none | auto | required | a tool's name
    parallel: bool
    legacy: bool  # `functions` / `function_call`: answers carry message.function_call
    param: str  # the request field that carried the tools, for errors

    @property
    def calls_allowed(self) -> bool:
        return self.choice != "none"

    def forced(self) -> tuple[Tool, ...]:
        """The tools a call may use: all of them, or the named one."""
        if self.choice in ("auto", "required", "none"):
            return self.tools
        return tuple(t for t in self.tools if t.name == self.choice)


# -- the request ------------------------------------------------------------------------------

def _tool(obj: Any, where: str) -> Tool:
    if not isinstance(obj, dict):
        raise ApiError.bad_request(f"{where} must be an object", param=where)
    name = obj.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ApiError.bad_request(f"{where}.name must be 1 to 64 letters, digits, '_' or '-', "
                                   f"got {name!r}", param=f"{where}.name")
    description = obj.get("description") or ""
    if not isinstance(description, str):
        raise ApiError.bad_request(f"{where}.description must be a string",
                                   param=f"{where}.description")
    parameters = obj.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise ApiError.bad_request(f"{where}.parameters must be a JSON schema object",
                                   param=f"{where}.parameters")
    check_depth(parameters, f"{where}.parameters")
    return Tool(name, description, parameters)


def tool_plan(tools: list[Any] | None, tool_choice: Any, parallel: bool | None,
              functions: list[Any] | None, function_call: Any) -> ToolPlan | None:
    """Check and normalise the tool fields; None when the request has no tools."""
    if tools and functions:
        raise ApiError.bad_request("Use tools or the legacy functions, not both.",
                                   param="functions")
    if not tools and not functions:
        # "none" and "auto" mean the same without tools (clients send them with `tools: []`).
        if tool_choice not in (None, "none", "auto"):
            raise ApiError.bad_request("tool_choice is only allowed when tools are specified",
                                       param="tool_choice")
        if function_call not in (None, "none", "auto"):
            raise ApiError.bad_request("function_call is only allowed when functions are "
                                       "specified", param="function_call")
        return None
    legacy = not tools
    items, param = (functions, "functions") if legacy else (tools, "tools")
    if not isinstance(items, list):
        raise ApiError.bad_request(f"{param} must be an array", param=param)
    if len(items) > MAX_TOOLS:
        raise ApiError.bad_request(f"{param} takes at most {MAX_TOOLS} tools, got {len(items)}",
                                   param=param)
    parsed: list[Tool] = []
    for i, item in enumerate(items):
        where = f"{param}[{i}]"
        if legacy:
            parsed.append(_tool(item, where))
            continue
        if not isinstance(item, dict) or item.get("type") != "function":
            got = item.get("type") if isinstance(item, dict) else type(item).__name__
            raise ApiError.bad_request(f"{where}.type must be 'function' (only function tools "
                                       f"are supported), got {got!r}", param=f"{where}.type")
        parsed.append(_tool(item.get("function"), f"{where}.function"))
    names = [t.name for t in parsed]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise ApiError.bad_request(f"{param} names {dup!r} twice", param=param)
    choice = _choice(function_call if legacy else tool_choice, names, legacy)
    return ToolPlan(tuple(parsed), choice, parallel is not False and not legacy, legacy, param)


def _choice(value: Any, names: list[str], legacy: bool) -> str:
    param = "function_call" if legacy else "tool_choice"
    if value is None:
        return "auto"
    if isinstance(value, str):
        allowed = ("none", "auto") if legacy else ("none", "auto", "required")
        if value not in allowed:
            raise ApiError.bad_request(f"{param} must be one of {', '.join(allowed)} or name a "
                                       f"function, got {value!r}", param=param)
        return value
    if isinstance(value, dict):
        fn = value if legacy else value.get("function")
        if not legacy and value.get("type") != "function":
            raise ApiError.bad_request(f"{param}.type must be 'function'", param=param)
        name = fn.get("name") if isinstance(fn, dict) else None
        if name not in names:
            raise ApiError.bad_request(f"{param} names the function {name!r}, which is not "
                                       f"among the tools ({', '.join(names)})", param=param)
        return name
    raise ApiError.bad_request(f"{param} must be a string or an object", param=param)


# -- rendering --------------------------------------------------------------------------------

def _template_source(tokenizer) -> str:
    tpl = getattr(tokenizer, "chat_template", None)
    if isinstance(tpl, dict):
        tpl = tpl.get("tool_use") or tpl.get("default") or ""
    return tpl or ""


@functools.lru_cache(maxsize=8)
def _renders_tools(tokenizer) -> bool:
    probe = Tool(_PROBE, "probe", {"type": "object", "properties": {}})
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                             tools=[probe.schema()], tokenize=False,
                                             add_generation_prompt=True)
    except Exception:
        return False
    return _PROBE in text


def tool_format(tokenizer) -> str:
    """`hermes` when the chat template renders tools and speaks Hermes's call format, else
    `generic` (see the module's docstring)."""
    if CALL_OPEN in _template_source(tokenizer) and _renders_tools(tokenizer):
        return "hermes"
    return "generic"


def generic_system_prompt(plan: ToolPlan) -> str:
    """How the generic format describes the tools to a model whose template does not."""
    lines = ["You can call the following tools. Each is described by a JSON schema:"]
    lines += [json.dumps(t.schema()["function"], separators=(",", ":")) for t in plan.forced()]
    lines.append(f"To call a tool, answer with a block {CALL_OPEN}\n"
                 '{"name": <tool name>, "arguments": <the arguments as a JSON object>}\n'
                 f"{CALL_CLOSE}" + (" (one block per call)." if plan.parallel else "."))
    if plan.choice == "auto":
        lines.append("If no tool is needed, answer the user directly.")
    return "\n".join(lines)


def call_block(name: str, arguments: Any) -> str:
    return f'{CALL_OPEN}\n{json.dumps({"name": name, "arguments": arguments})}\n{CALL_CLOSE}'


def with_tool_prompt(messages: list[dict[str, Any]], plan: ToolPlan) -> list[dict[str, Any]]:
    """The generic format's system message, merged into the conversation's own if it has one."""
    prompt = generic_system_prompt(plan)
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0], content=f"{messages[0]['content']}\n\n{prompt}")
        return [first, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


# -- the grammar ------------------------------------------------------------------------------

def call_schema(tools: tuple[Tool, ...]) -> dict[str, Any]:
    """The JSON of one call: a tool's name and arguments valid for that tool."""
    options = [{"type": "object",
                "properties": {"name": {"const": t.name}, "arguments": closed(t.parameters)},
                "required": ["name", "arguments"], "additionalProperties": False}
               for t in tools]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "x-guidance": JSON_STYLE}


def tool_grammar(plan: ToolPlan, answer_schema: dict[str, Any] | None) -> str | None:
    """A Lark grammar (llguidance's dialect) for the answer, or None when it is free.

    `answer_schema` is the response_format's JSON schema, which a plain answer must then match.
    """
    if not plan.calls_allowed:
        return None
    call = json.dumps(call_schema(plan.forced()))
    calls = "call (\"\\n\" call)*" if plan.parallel else "call"
    rules = [f"calls: {calls}",
             f'call: "{CALL_OPEN}\\n" %json {call} "\\n{CALL_CLOSE}"']
    if plan.choice == "auto":
        if answer_schema is not None:
            rules.insert(0, "start: calls | answer")
            rules.append(f"answer: %json {json.dumps({'x-guidance': JSON_STYLE, **answer_schema})}")
        else:
            rules.insert(0, "start: calls | TEXT")
            # Any text that does not open with a call (leading blanks included).
            rules.append(r"TEXT: /(?s:.+)/ & ~/(?s:\s*<tool_call>.*)/")
    else:
        rules.insert(0, "start: calls")
    return "\n".join(rules)


# -- the answer -------------------------------------------------------------------------------

@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text

    def openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_call(block: str) -> ToolCall | None:
    """One call block's JSON, or None when it is not a call."""
    try:
        obj = json.loads(block)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return ToolCall(new_call_id(), obj["name"], json.dumps(args, ensure_ascii=False))


def parse_answer(text: str) -> tuple[str | None, list[ToolCall]]:
    """A whole answer → (content, calls). Text before the first call is the content; an answer
    with no parsable call is all content."""
    start = text.find(CALL_OPEN)
    if start < 0:
        return text, []
    calls = [c for m in _CALL_BLOCK.finditer(text, start) if (c := parse_call(m.group(1)))]
    if not calls:
        return text, []
    content = text[:start].strip()
    return content or None, calls


class ToolStreamParser:
    """Splits a streamed answer into content deltas and whole calls, as they complete.

    Text that may still become a call opener is held back; once the answer is known to be text
    it passes through unchanged.
    """

    def __init__(self) -> None:
        self._buffer = ""
        self._mode = "undecided"  # undecided | text | calls
        self.calls = 0

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._buffer += text
        if self._mode == "undecided":
            head = self._buffer.lstrip()
            if head.startswith(CALL_OPEN):
                self._mode = "calls"
            elif not head or CALL_OPEN.startswith(head):
                return "", []
            else:
                self._mode = "text"
        if self._mode == "text":
            out, self._buffer = self._buffer, ""
            return out, []
        calls = []
        while (m := _CALL_BLOCK.search(self._buffer)) is not None:
            call = parse_call(m.group(1))
            self._buffer = self._buffer[m.end():]
            if call is not None:
                calls.append(call)
        self.calls += len(calls)
        return "", calls

    def finish(self) -> str:
        """What is left when the answer ends: text that never became a call."""
        out, self._buffer = self._buffer, ""
        if self._mode == "calls" and not out.strip():
            return ""
        return out
