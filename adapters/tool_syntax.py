"""How a model family writes its tool calls: the grammar of the calls and their parsing back,
whole and streamed. Three syntaxes, chosen from the chat template (adapters/tools.py):

- **hermes** (Qwen2.5, Hermes 2/3; also the generic format every other template gets):
  `<tool_call>\\n{"name": …, "arguments": {…}}\\n</tool_call>`, one block per call.
- **llama3** (Llama 3.1, 3.2, 3.3 with JSON tools): the answer is the call itself,
  `{"name": …, "parameters": {…}}`; one call per answer, as the template can only render one
  back.
- **mistral** (Mistral 7B v0.3, Nemo, Small 2501 and their templates): `[TOOL_CALLS]` and a JSON
  array of `{"name": …, "arguments": {…}}`. Where the tokenizer has `[TOOL_CALLS]` as one special
  token, the grammar writes that token (the one the model was trained on) and the answer is
  detokenized with special tokens kept, so the parser sees it.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from engine.sample.grammar import JSON_STYLE

_DECODER = json.JSONDecoder()


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


def call_of(obj: Any) -> ToolCall | None:
    """A decoded call object as a ToolCall, or None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return ToolCall(new_call_id(), obj["name"], json.dumps(args, ensure_ascii=False))


def parse_call(block: str) -> ToolCall | None:
    """One call's JSON text, or None when it is not a call."""
    try:
        return call_of(json.loads(block))
    except ValueError:
        return None


@dataclass(frozen=True)
class CallSyntax:
    """One family's call syntax. `opener` is the text calls start with, as detokenized;
    `opener_lark` how the grammar writes it (a special token by id, or the text)."""

    name: str
    opener: str
    opener_lark: str
    key: str  # the call object's arguments key
    multiple: bool  # whether one answer may hold several calls
    anywhere: bool  # whether calls may follow text (else the answer opens with them)

    @property
    def special(self) -> bool:
        """Whether the opener is a special token (detokenize keeping special tokens)."""
        return self.opener_lark.startswith("<[")

    def call_schema(self, options: list[dict[str, Any]]) -> dict[str, Any]:
        """The JSON of one call, given each tool's `(name, closed parameters)` as options."""
        objs = [{"type": "object",
                 "properties": {"name": {"const": o["name"]}, self.key: o["parameters"]},
                 "required": ["name", self.key], "additionalProperties": False}
                for o in options]
        schema = objs[0] if len(objs) == 1 else {"anyOf": objs}
        return {**schema, "x-guidance": JSON_STYLE}

    def call_rules(self, call_json: str, parallel: bool) -> list[str]:
        """Lark rules defining `calls` (one or, with `parallel`, several calls)."""
        separator = _CALL_SEPARATORS[self.name]
        more = f" ({json.dumps(separator)} call)*" if parallel and self.multiple else ""
        if self.name == "hermes":
            return [f"calls: call{more}",
                    f'call: "<tool_call>\\n" %json {call_json} "\\n</tool_call>"']
        if self.name == "mistral":
            return [f'calls: {self.opener_lark} " [" call{more} "]"', f"call: %json {call_json}"]
        return [f"calls: call{more}", f"call: %json {call_json}"]

    def text_rule(self) -> str:
        """A plain answer under `auto`: any text that does not open with a call."""
        if self.special:  # a lexeme cannot produce a special token
            return r"TEXT: /(?s:.+)/"
        return rf"TEXT: /(?s:.+)/ & ~/(?s:\s*{re.escape(self.opener)}.*)/"

    def block(self, name: str, arguments: Any) -> str:
        """One call as this syntax writes it (for the generic format's history)."""
        call = json.dumps({"name": name, self.key: arguments})
        return f"<tool_call>\n{call}\n</tool_call>" if self.name == "hermes" else call

    # -- parsing ------------------------------------------------------------------------------

    def take(self, buffer: str) -> tuple[list[ToolCall], str, bool]:
        """The complete calls at the head of `buffer` (which starts at the opener), what is
        left of it, and whether the buffer turned out not to be calls at all."""
        if self.name == "hermes":
            calls = []
            while (m := _HERMES_BLOCK.search(buffer)) is not None:
                if (call := parse_call(m.group(1))) is not None:
                    calls.append(call)
                buffer = buffer[m.end():]
            return calls, buffer, False
        pos = len(buffer) - len(buffer.lstrip())
        marker = self.opener if self.name == "mistral" else _PYTHON_TAG  # Llama's built-in tag
        if buffer.startswith(marker, pos):
            pos += len(marker)
        calls: list[ToolCall] = []
        while True:
            start = _SEPARATORS[self.name].match(buffer, pos).end()
            rest = buffer[pos:] if calls else buffer
            if start >= len(buffer) or buffer[start] != "{":
                # After Llama's tag only a call may follow; Mistral's array may still open.
                return calls, rest, start < len(buffer) and not calls and self.name == "llama3"
            try:
                obj, end = _DECODER.raw_decode(buffer, start)
            except ValueError:
                return calls, rest, False  # not complete yet
            call = call_of(obj) if isinstance(obj, dict) and _ARGUMENT_KEYS & obj.keys() \
                else None
            if call is None:
                return calls, rest, not calls
            calls.append(call)
            pos = end

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A whole answer → (content, calls). Text before the first call is the content; an
        answer with no parsable call is all content."""
        start = text.find(self.opener) if self.anywhere else len(text) - len(text.lstrip())
        if start < 0 or (not self.anywhere and not text[start:].startswith(self.openers())):
            return text, []
        calls, _, _ = self.take(text[start:])
        if not calls:
            return text, []
        return text[:start].strip() or None, calls

    def openers(self) -> tuple[str, ...]:
        return (self.opener, _PYTHON_TAG) if self.name == "llama3" else (self.opener,)


_HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
_PYTHON_TAG = "<|python_tag|>"
# What stands between two calls of one answer, as each family writes it.
_CALL_SEPARATORS = {"hermes": "\n", "llama3": "; ", "mistral": ", "}
_ARGUMENT_KEYS = {"arguments", "parameters"}
_SEPARATORS = {"llama3": re.compile(r"\s*;?\s*"), "mistral": re.compile(r"\s*[\[,]?\s*")}

HERMES = CallSyntax("hermes", "<tool_call>", '"<tool_call>"', "arguments", True, True)
LLAMA3 = CallSyntax("llama3", "{", '"{"', "parameters", False, False)


def mistral(tokenizer=None) -> CallSyntax:
    """Mistral's syntax for this tokenizer: `[TOOL_CALLS]` by its special token where it is one
    (without a tokenizer, as text)."""
    marker = "[TOOL_CALLS]"
    ids = tokenizer.encode(marker, add_special_tokens=False) if tokenizer is not None else []
    special = len(ids) == 1 and ids[0] in set(getattr(tokenizer, "all_special_ids", []) or [])
    lark = f"<[{ids[0]}]>" if special else json.dumps(marker)
    return CallSyntax("mistral", marker, lark, "arguments", True, True)


class ToolStreamParser:
    """Splits a streamed answer into content deltas and whole calls, as they complete.

    Text that may still become a call opener is held back; once the answer is known to be text
    it passes through unchanged.
    """

    def __init__(self, syntax: CallSyntax = HERMES) -> None:
        self.syntax = syntax
        self._buffer = ""
        self._mode = "undecided"  # undecided | text | calls
        self.calls = 0

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._buffer += text
        if self._mode == "undecided":
            head = self._buffer.lstrip()
            openers = self.syntax.openers()
            if head.startswith(openers):
                self._mode = "calls"
            elif not head or any(o.startswith(head) for o in openers):
                return "", []
            else:
                self._mode = "text"
        if self._mode == "calls":
            calls, self._buffer, wrong = self.syntax.take(self._buffer)
            self.calls += len(calls)
            if not wrong:
                return "", calls
            self._mode = "text"  # an answer that opens like a call but is not one (JSON)
        out, self._buffer = self._buffer, ""
        return out, []

    def finish(self) -> str:
        """What is left when the answer ends: text that never became a call."""
        out, self._buffer = self._buffer, ""
        if self._mode == "calls" and not out.strip(" ]\n"):  # what closed the calls
            return ""
        return out
