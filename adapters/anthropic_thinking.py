"""Anthropic's extended thinking over a reasoning model: the request's `thinking` as the chat
template's `enable_thinking` (Qwen3's switch, which other thinking templates share), and the
signature of a thinking block.

The signature is a SHA-256 of the block's text. Thinking blocks sent back are left out of the
prompt (chat templates drop earlier turns' thinking), so it is not checked on the way back.
"""

from __future__ import annotations

import hashlib
from typing import Any

from adapters.errors import ApiError

MIN_BUDGET = 1024  # Anthropic's least budget_tokens


def thinking_enabled(thinking: dict[str, Any] | None) -> bool:
    """Whether the request asked for thinking (and so gets thinking blocks back)."""
    return isinstance(thinking, dict) and thinking.get("type") == "enabled"


def template_thinking(thinking: dict[str, Any] | None, max_tokens: int | None
                      ) -> dict[str, Any]:
    """The chat-template variables `thinking` means: off unless enabled, as Anthropic's default
    is (a template that thinks regardless still does; its thinking is then not shown). The
    budget is checked as Anthropic checks it, and not enforced: the thinking counts against
    max_tokens."""
    kind = "disabled" if thinking is None else thinking.get("type")
    if kind == "disabled":
        return {"enable_thinking": False}
    if kind != "enabled":
        raise ApiError.bad_request(f"thinking.type must be enabled or disabled, got {kind!r}",
                                   param="thinking.type")
    budget = thinking.get("budget_tokens")
    if budget is None:
        raise ApiError.bad_request("thinking.budget_tokens is required with type 'enabled'",
                                   param="thinking.budget_tokens",
                                   code="missing_required_parameter")
    if (not isinstance(budget, int) or isinstance(budget, bool) or budget < MIN_BUDGET
            or max_tokens is not None and budget >= max_tokens):
        limit = "" if max_tokens is None else f" and less than max_tokens ({max_tokens})"
        raise ApiError.bad_request(f"thinking.budget_tokens must be an integer of at least "
                                   f"{MIN_BUDGET}{limit}, got {budget!r}",
                                   param="thinking.budget_tokens")
    return {"enable_thinking": True}


def signature(thinking: str) -> str:
    return hashlib.sha256(thinking.encode()).hexdigest()
