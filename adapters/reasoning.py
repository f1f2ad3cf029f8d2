"""Reasoning output: models that think before they answer (Qwen3, SmolLM3, DeepSeek-R1 and its
distillations) write `<think>...</think>` before the answer. The answer's `content` excludes the
thinking, which goes to `reasoning_content` and `reasoning` (vLLM's names; clients read either),
in streams as deltas before the content's.

A parser is chosen per model from its chat template (one that writes `<think>` thinks), or by
`--reasoning-parser NAME`. Where the rendered prompt already opens the think block (DeepSeek-R1's
template ends the generation prompt with `<think>`), the output starts inside it; where it
already closed it (Qwen3's with `enable_thinking: false`), the output is all answer.
"""

from __future__ import annotations

from dataclasses import dataclass

PARSERS = ("none", "think")
# The names other servers give the same `<think>` format, accepted as aliases.
ALIASES = {"qwen3": "think", "deepseek_r1": "think", "smollm3": "think", "granite": "think"}
OPEN, CLOSE = "<think>", "</think>"


def parser_name(configured: str | None, chat_template: str | None) -> str:
    """The parser a server uses: the configured one ("auto" or None: from the template)."""
    name = ALIASES.get(configured or "auto", configured or "auto")
    if name == "auto":
        return "think" if chat_template and OPEN in chat_template else "none"
    if name not in PARSERS:
        raise ValueError(f"unknown reasoning parser {configured!r}: one of auto, "
                         f"{', '.join(PARSERS)}, {', '.join(ALIASES)}")
    return name


def starts_inside(prompt_text: str) -> bool:
    """Whether the rendered prompt leaves a think block open (the output starts thinking)."""
    return prompt_text.rfind(OPEN) > prompt_text.rfind(CLOSE)


@dataclass
class ReasoningSplitter:
    """Splits a stream of text into reasoning and content, at any chunk boundary: text that may
    be the start of a marker is held back until the next chunk says whether it is one."""

    thinking: bool = False  # inside the think block
    opened: bool = False  # a think block was seen (or the prompt opened one)
    held: str = ""
    # Tokens of the thinking: those that arrived inside the block, up to the one closing it.
    reasoning_tokens: int = 0
    undecided_tokens: int = 0  # arrived before it was known whether the output thinks
    closing: bool = False  # the block just closed: the newlines after it are not content

    @classmethod
    def starting(cls, inside: bool) -> ReasoningSplitter:
        return cls(thinking=inside, opened=inside)

    def feed(self, text: str, tokens: int = 0, last: bool = False) -> tuple[str, str]:
        """(reasoning, content) of `text` added to what was held back; its `tokens` count as
        reasoning where the block was open when they arrived, or they opened it. The `last`
        text of the output also releases what is still held back."""
        reasoning, content = self._split(text)
        if last:
            held, self.held = self.held, ""
            reasoning, content = (reasoning + held, content) if self.thinking else \
                (reasoning, content + held)
        if not self.opened:
            self.undecided_tokens += tokens
        elif self.thinking or reasoning or self.closing and not content:
            self.reasoning_tokens += tokens + self.undecided_tokens
            self.undecided_tokens = 0
        else:
            self.undecided_tokens = 0  # the answer began without thinking
        return reasoning, content

    def _split(self, text: str) -> tuple[str, str]:
        text, self.held = self.held + text, ""
        reasoning, content = [], []
        while text:
            if self.thinking:
                at = text.find(CLOSE)
                if at < 0:
                    keep = _partial_suffix(text, CLOSE)
                    reasoning.append(text[: len(text) - keep])
                    self.held = text[len(text) - keep:]
                    break
                reasoning.append(text[:at])
                text, self.thinking, self.closing = text[at + len(CLOSE):], False, True
                continue
            if self.closing:
                text = text.lstrip("\n")
                if not text:
                    break
                self.closing = False
            if not self.opened:
                stripped = text.lstrip()
                if not stripped:
                    self.held = text
                    break
                if stripped.startswith(OPEN):
                    text, self.thinking, self.opened = stripped[len(OPEN):], True, True
                    continue
                if OPEN.startswith(stripped):  # maybe the marker, not all arrived yet
                    self.held = text
                    break
                self.opened = True  # the answer starts without thinking
            content.append(text)
            break
        return "".join(reasoning), "".join(content)


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
