"""How a model family writes its tool calls: the grammar of the calls and their parsing back,
whole and streamed. Three syntaxes, chosen from the chat template (adapters/tools.py):

- **hermes** (Qwen2.5, Hermes 2/3; also the generic format every other template gets):
  `<tool_call>\\n{"name": …, "arguments": {…}}\\n</tool_call>`, one block per call.
- **llama3** (Llama 3.1, 3.2, 3.3 with JSON tools): the answer is the call itself,
  `{"name": …, "parameters": {…}}`; one call per answer, as the template can only render one
  back. (Llama's `<|python_tag|>` is for its built-in tools, which are not served.)
- **mistral** (Mistral 7B v0.3, Nemo, Small 2501 and their templates): `[TOOL_CALLS]` and a JSON
  array of `{"name": …, "arguments": {…}}`. Where the tokenizer has `[TOOL_CALLS]` as one special
  token, the grammar writes that token (the one the model was trained on) and the answer is
  detokenized with special tokens kept, so the parser sees it.
"""

from __future__ import annotations

import functools
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


@dataclass(frozen=True)
class CallSyntax:
    """One family's call syntax, which opens the answer: an optional `marker` (Mistral's
    `[TOOL_CALLS]` and a JSON array), then calls, each a JSON object between `call_open` and
    `call_close`, parted by `separator`."""

    name: str
    key: str  # the call object's arguments key
    multiple: bool  # whether one answer may hold several calls
    separator: str
    call_open: str = ""
    call_close: str = ""
    marker: str = ""  # detokenized text before the calls (then an array holds them)
    marker_lark: str = ""  # how the grammar writes the marker: a special token by id, or text

    @property
    def opener(self) -> str:
        """What an answer that calls opens with."""
        return self.marker or self.call_open.strip() or "{"

    @property
    def special(self) -> bool:
        """Whether the marker is a special token (detokenize keeping special tokens)."""
        return self.marker_lark.startswith("<[")

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
        more = f" ({json.dumps(self.separator)} call)*" if parallel and self.multiple else ""
        calls = f'{self.marker_lark} " [" call{more} "]"' if self.marker else f"call{more}"
        call = " ".join(p for p in (self.call_open and json.dumps(self.call_open),
                                    f"%json {call_json}",
                                    self.call_close and json.dumps(self.call_close)) if p)
        return [f"calls: {calls}", f"call: {call}"]

    def text_rule(self) -> str:
        """A plain answer under `auto`: any text that does not open with a call."""
        if self.special:  # a lexeme cannot produce a special token
            return r"TEXT: /(?s:.+)/"
        return rf"TEXT: /(?s:.+)/ & ~/(?s:\s*{re.escape(self.opener)}.*)/"

    # -- parsing ------------------------------------------------------------------------------

    def take(self, buffer: str, first: bool = True) -> tuple[list[ToolCall], str, bool]:
        """The complete calls at the head of `buffer` (an answer that opens with calls, or
        with `first` false what follows calls already taken), what is left of it, and whether
        it turned out not to be calls at all (JSON that is no call, where the calls have no
        marker of their own)."""
        pos = _skip(buffer, 0)
        if self.marker and first:
            if not buffer.startswith(self.marker, pos):
                return [], buffer, False
            pos = _skip(buffer, pos + len(self.marker), "[")
        calls: list[ToolCall] = []
        while True:
            rest = buffer[pos:] if calls else buffer
            start = _skip(buffer, pos, self.separator.strip() or "\n")
            opening = self.call_open.strip()
            if opening:
                if not buffer.startswith(opening, start):
                    return calls, rest, False  # not there yet (a grammar writes nothing else)
                start = _skip(buffer, start + len(opening))
            if start >= len(buffer):
                return calls, rest, False
            if buffer[start] != "{":
                return calls, rest, first and not calls
            try:
                obj, end = _DECODER.raw_decode(buffer, start)
            except ValueError:
                return calls, rest, False  # not complete yet
            if self.call_close:
                end = _skip(buffer, end)
                if not buffer.startswith(self.call_close.strip(), end):
                    return calls, rest, False
                end += len(self.call_close.strip())
            call = call_of(obj) if isinstance(obj, dict) and _ARGUMENT_KEYS & obj.keys() \
                else None
            if call is None:
                return calls, rest, first and not calls
            calls.append(call)
            pos = end

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A whole answer → (content, calls): the calls that open it, as a stream parses them
        (text before a call is an answer the grammar allowed as text, not a call); an answer
        with no parsable call is all content."""
        calls = self.take(text)[0] if text.lstrip().startswith(self.opener) else []
        return (None, calls) if calls else (text, [])


def _skip(text: str, pos: int, also: str = "") -> int:
    """The first position from `pos` that is neither whitespace nor one of `also`."""
    while pos < len(text) and (text[pos].isspace() or text[pos] in also):
        pos += 1
    return pos


_ARGUMENT_KEYS = {"arguments", "parameters"}

HERMES = CallSyntax("hermes", "arguments", True, "\n", "<tool_call>\n", "\n</tool_call>")
LLAMA3 = CallSyntax("llama3", "parameters", False, "; ")
_MISTRAL_MARKER = "[TOOL_CALLS]"


@functools.lru_cache(maxsize=8)
def mistral(tokenizer=None) -> CallSyntax:
    """Mistral's syntax for this tokenizer: `[TOOL_CALLS]` by its special token where it is one
    (without a tokenizer, as text)."""
    if tokenizer is None:
        return CallSyntax("mistral", "arguments", True, ", ", marker=_MISTRAL_MARKER,
                          marker_lark=json.dumps(_MISTRAL_MARKER))
    ids = tokenizer.encode(_MISTRAL_MARKER, add_special_tokens=False)
    added = getattr(tokenizer, "added_tokens_decoder", {})
    # The flag decoding itself reads to skip a token, so the answer keeps what the grammar wrote.
    special = len(ids) == 1 and ids[0] in added and added[ids[0]].special
    lark = f"<[{ids[0]}]>" if special else json.dumps(_MISTRAL_MARKER)
    return CallSyntax("mistral", "arguments", True, ", ", marker=_MISTRAL_MARKER,
                      marker_lark=lark)


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
            head, opener = self._buffer.lstrip(), self.syntax.opener
            if head.startswith(opener):
                self._mode = "calls"
            elif not head or opener.startswith(head):
                return "", []
            else:
                self._mode = "text"
        if self._mode == "calls":
            calls, self._buffer, wrong = self.syntax.take(self._buffer, first=not self.calls)
            self.calls += len(calls)
            if not wrong:
                return "", calls
            self._mode = "text"  # an answer that opens like a call but is not one (JSON)
        out, self._buffer = self._buffer, ""
        return out, []

    def finish(self) -> str:
        """What is left when the answer ends: text that never became a call."""
        out, self._buffer = self._buffer, ""
        if self._mode == "calls" and not out.replace("]", "").strip():  # what closed the calls
            return ""
        return out
