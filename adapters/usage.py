"""Token accounting for one request that may span several engine jobs and sequences."""

from __future__ import annotations

from adapters.openai_types import CompletionTokensDetails, PromptTokensDetails, Usage
from engine import JobDelta


class UsageCounter:
    """Counts prompt tokens once per job and completion tokens per sequence, from deltas.

    Deltas carry running totals (`completion_tokens` so far for the sequence), so the last one
    seen per sequence is the count; a job's `n` sequences share one prompt.
    """

    def __init__(self) -> None:
        self._prompt: dict[str, tuple[int, int]] = {}  # job_id -> (prompt, cached)
        self._completion: dict[tuple[str, int], int] = {}

    def add(self, delta: JobDelta) -> None:
        self._prompt[delta.job_id] = (delta.prompt_tokens, delta.cached_tokens)
        self._completion[(delta.job_id, delta.index)] = delta.completion_tokens

    @property
    def completion_tokens(self) -> int:
        return sum(self._completion.values())

    def total(self, reasoning_tokens: int | None = None) -> Usage:
        """The usage; with `reasoning_tokens` (a reasoning parser counted them), its details."""
        prompt = sum(p for p, _ in self._prompt.values())
        cached = sum(c for _, c in self._prompt.values())
        completion = self.completion_tokens
        usage = Usage(prompt_tokens=prompt, completion_tokens=completion,
                      total_tokens=prompt + completion,
                      prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))
        if reasoning_tokens is not None:
            usage.completion_tokens_details = CompletionTokensDetails(reasoning_tokens)
        return usage
