"""Stop-string matching over streamed text."""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Finds a sequence's stop strings in its streamed text and decides what is safe to emit.

    Owns the text that was fed but not emitted yet: the longest tail that is still a proper
    prefix of some stop string, so it may turn into a stop once more text arrives. That tail
    is at most ``max(len(s) for s in stop) - 1`` characters, so memory stays bounded.

    When several stop strings occur, the one that *completes* first in the stream wins (ties:
    the one starting first, i.e. the longer). That is what a token-by-token engine observes, and
    the only rule that gives the same result however the text is split into chunks without
    delaying a stop. It differs from "earliest start" only when one stop contains another,
    e.g. stops ``["abcdef", "cd"]`` on ``"abcdef"`` stop at ``"cd"``, emitting ``"ab"``.

    Empty stop strings are ignored (they would stop every sequence before its first token).
    """

    def __init__(self, stop: Sequence[str]) -> None:
        self._stops: tuple[str, ...] = tuple(dict.fromkeys(s for s in stop if s))
        self._hold_max = max((len(s) for s in self._stops), default=1) - 1
        # Every proper prefix of every stop, to test a candidate tail in O(its length); the
        # first characters let most tails be rejected without slicing.
        self._prefixes = frozenset(s[:k] for s in self._stops for k in range(1, len(s)))
        self._firsts = frozenset(p[0] for p in self._prefixes)
        self._pending = ""
        self._stopped = False

    @property
    def stopped(self) -> bool:
        """Whether a stop string has matched; later feeds emit nothing."""
        return self._stopped

    def feed(self, text: str) -> tuple[str, bool]:
        """Add newly decoded text; return (text safe to emit now, whether a stop matched).

        On a match the returned text ends right before the stop string; the stop string and
        anything after it are dropped.
        """
        if self._stopped:
            return "", True
        if not self._stops:
            return text, False
        if not text:
            return "", False
        buf = self._pending + text
        # Nothing before _pending can start a match (it was released because no stop could
        # begin there), so every occurrence completing in this feed lies wholly inside buf.
        best: tuple[int, int] | None = None  # (end, start) of the first-completing occurrence
        for s in self._stops:
            start = buf.find(s)
            if start >= 0:
                key = (start + len(s), start)
                if best is None or key < best:
                    best = key
        if best is not None:
            self._pending = ""
            self._stopped = True
            return buf[: best[1]], True
        hold = self._held_tail(buf)
        self._pending = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold], False

    def _held_tail(self, buf: str) -> int:
        # Longest suffix of buf that is a proper prefix of some stop: scan candidate starts from
        # the left so the first hit is the longest.
        n = len(buf)
        for i in range(max(0, n - self._hold_max), n):
            if buf[i] in self._firsts and buf[i:] in self._prefixes:
                return n - i
        return 0

    def flush(self) -> str:
        """Release held-back text when the sequence ends for another reason (EOS, length)."""
        text, self._pending = self._pending, ""
        return text
