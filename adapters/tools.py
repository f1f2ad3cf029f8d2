"""Tool calling for chat: the request's tools checked and normalised, the conversation rendered
with them, the grammar that constrains the answer, and the answer parsed back into `tool_calls`.

Two ways to tell the model about the tools:

- **native**: the chat template renders a `tools` argument and speaks one of the call syntaxes of
  adapters/tool_syntax.py: `hermes` (Qwen2.5, Hermes 2/3), `llama3` (Llama 3.1 to 3.3) or
  `mistral` (`[TOOL_CALLS]`, Mistral 7B v0.3 to Small 2501), detected by rendering a probe tool
  and reading the template. Tools, assistant `tool_calls` and `tool` messages are passed to the
  template as it expects them, and the model answers in its family's syntax.
- **generic** (every other template, SmolLM2's included): a system message describes the tools and
  Hermes's block format; assistant calls are rendered as their blocks and tool results as user
  messages wrapped in `<tool_response>`.

Either way a grammar constrains the answer: `auto` to a plain answer (text that does not start
with a call, or the `response_format`'s JSON) or one or more calls; `required` and a named tool
to calls only (of that tool); `none` leaves the answer free and parses nothing. Every call's
arguments satisfy its tool's parameter schema.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from adapters.errors import ApiError
from adapters.limits import MAX_TOOLS
from adapters.structured import check_depth, closed
from adapters.tool_syntax import HERMES, LLAMA3, CallSyntax, mistral
from engine.sample.grammar import JSON_STYLE

_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
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
    syntax: CallSyntax = HERMES  # how the model writes calls (the template's family)

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
    """The native call syntax the chat template renders tools for (`hermes`, `llama3`,
    `mistral`), else `generic` (see the module's docstring)."""
    source = _template_source(tokenizer)
    if not _renders_tools(tokenizer):
        return "generic"
    if CALL_OPEN in source:
        return "hermes"
    # Mistral's later templates write `[TOOL_CALLS]name[ARGS]{…}`, which is not built.
    if "[TOOL_CALLS]" in source and "[ARGS]" not in source:
        return "mistral"
    if '"parameters": ' in source and '{"name": "' in source:
        return "llama3"
    return "generic"


def tool_syntax(tokenizer, fmt: str) -> CallSyntax:
    """How a model with this tool format writes its calls (the generic format: Hermes's)."""
    if fmt == "mistral":
        return mistral(tokenizer)
    return LLAMA3 if fmt == "llama3" else HERMES


def native_call_id(call_id: str, fmt: str) -> str:
    """A call id as the format's template takes it: Mistral's require 9 letters or digits, so
    other ids are mapped to 9 hex digits of their hash (the same id maps the same way in the
    call and in its result)."""
    if fmt != "mistral" or re.fullmatch(r"[a-zA-Z0-9]{9}", call_id):
        return call_id
    return hashlib.sha256(call_id.encode()).hexdigest()[:9]


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
    """One call as Hermes's block (the generic format's history)."""
    return f'{CALL_OPEN}\n{json.dumps({"name": name, "arguments": arguments})}\n{CALL_CLOSE}'


def with_tool_prompt(messages: list[dict[str, Any]], plan: ToolPlan) -> list[dict[str, Any]]:
    """The generic format's system message, merged into the conversation's own if it has one."""
    prompt = generic_system_prompt(plan)
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0], content=f"{messages[0]['content']}\n\n{prompt}")
        return [first, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


# -- the grammar ------------------------------------------------------------------------------

def tool_grammar(plan: ToolPlan, answer_schema: dict[str, Any] | None) -> str | None:
    """A Lark grammar (llguidance's dialect) for the answer in the plan's call syntax, or None
    when it is free. `answer_schema` is the response_format's JSON schema, which a plain answer
    must then match."""
    if not plan.calls_allowed:
        return None
    syntax = plan.syntax
    call = json.dumps(syntax.call_schema([{"name": t.name, "parameters": closed(t.parameters)}
                                          for t in plan.forced()]))
    rules = syntax.call_rules(call, plan.parallel)
    if plan.choice == "auto":
        if answer_schema is not None:
            rules.insert(0, "start: calls | answer")
            rules.append(f"answer: %json {json.dumps({'x-guidance': JSON_STYLE, **answer_schema})}")
        else:
            rules.insert(0, "start: calls | TEXT")
            rules.append(syntax.text_rule())
    else:
        rules.insert(0, "start: calls")
    return "\n".join(rules)

