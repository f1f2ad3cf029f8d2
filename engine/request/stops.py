"""Stop-string matching over streamed text."""

from __future__ import annotations

from collections.abc import Sequence


def _failure(s: str) -> list[int]:
    """KMP failure function: f[i] = length of the longest proper border of s[: i + 1]."""
    f = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = f[k - 1]
        if s[i] == s[k]:
            k += 1
        f[i] = k
    return f


class _StopState:
    """One stop string's matcher: how many of its leading characters the text now ends with."""

    __slots__ = ("stop", "fail", "matched")

    def __init__(self, stop: str) -> None:
        self.stop = stop
        self.fail = _failure(stop)
        self.matched = 0

    def advance(self, c: str) -> bool:
        """Take one character; True when the whole stop string has just been seen."""
        s, k = self.stop, self.matched
        while k and s[k] != c:
            k = self.fail[k - 1]
        if s[k] == c:
            k += 1
        if k == len(s):
            self.matched = self.fail[k - 1]
            return True
        self.matched = k
        return False


class StopMatcher:
    """Finds a sequence's stop strings in its streamed text and decides what is safe to emit.

    Owns the text that was fed but not emitted yet: the longest tail that is still a proper
    prefix of some stop string, so it may turn into a stop once more text arrives. That tail
    is at most ``max(len(s) for s in stop) - 1`` characters, so memory stays bounded.

    Each stop string runs its own Knuth-Morris-Pratt automaton, so the matcher's memory is the
    total length of the stop strings and each fed character costs amortised O(1) per stop
    string, however long the strings are (a client controls them).

    When several stop strings occur, the one that *completes* first in the stream wins (ties:
    the one starting first, i.e. the longer). That is what a token-by-token engine observes, and
    the only rule that gives the same result however the text is split into chunks without
    delaying a stop. It differs from "earliest start" only when one stop contains another,
    e.g. stops ``["abcdef", "cd"]`` on ``"abcdef"`` stop at ``"cd"``, emitting ``"ab"``.

    Empty stop strings are ignored (they would stop every sequence before its first token).
    """

    def __init__(self, stop: Sequence[str]) -> None:
        self._states = [_StopState(s) for s in dict.fromkeys(s for s in stop if s)]
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
        if not self._states:
            return text, False
        if not text:
            return "", False
        buf = self._pending + text
        offset = len(self._pending)
        for i, c in enumerate(text):
            end = offset + i + 1
            done = [st.stop for st in self._states if st.advance(c)]
            if done:
                # Completing at the same character: the longest started first.
                self._pending = ""
                self._stopped = True
                return buf[: end - max(len(s) for s in done)], True
        hold = max(st.matched for st in self._states)
        self._pending = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        """Release held-back text when the sequence ends for another reason (EOS, length)."""
        text, self._pending = self._pending, ""
        for st in self._states:
            st.matched = 0
        return text
