"""Which paths .dockerignore keeps out of the build context, by Docker's matching rules."""

from __future__ import annotations

import re

from tests.deploy.conftest import REPO


def _glob(pattern: str) -> re.Pattern:
    """A .dockerignore pattern as a regex: `*` and `?` stay within one path segment, `**` spans."""
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        else:
            out.append({"*": "[^/]*", "?": "[^/]"}.get(pattern[i], re.escape(pattern[i])))
            i += 1
    return re.compile("".join(out))


def dockerignore_excludes(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents decides."""
    parts = path.split("/")
    candidates = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    excluded = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        regex = _glob(pattern.lstrip("!").strip("/"))
        if any(regex.fullmatch(c) for c in candidates):
            excluded = not negate
    return excluded


def dockerignore_patterns() -> list[str]:
    lines = (REPO / ".dockerignore").read_text(encoding="utf-8").splitlines()
    return [s.strip() for s in lines if s.strip() and not s.strip().startswith("#")]
