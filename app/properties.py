"""Read a DJL `serving.properties` file the way its users write it.

The format is Java-properties-like: `key=value` per line, `#` or `!` comment lines. DJL users also
put a comment after a value (the seed's own `option.decoding_strategy=contrastive  # other options:
greedy, sample`), so a ` #` preceded by whitespace ends the value. A `#` with no space before it
stays part of the value (a revision hash or URL fragment may contain one).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

# Whitespace then '#': the start of a trailing comment.
_TRAILING_COMMENT = re.compile(r"\s+#.*$")


class PropertiesError(ValueError):
    """The properties file cannot be read or a line cannot be parsed; the message says where."""


@dataclass(frozen=True)
class Property:
    """One `key=value` entry and the line it came from (for error messages)."""

    key: str
    value: str
    line: int


def parse_properties(text: str, source: str = "serving.properties") -> dict[str, Property]:
    """Parse properties text into {key: Property}; a later duplicate key wins, as in DJL."""
    entries: dict[str, Property] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line[0] in "#!":
            continue
        match = re.match(r"([^=:\s]+)\s*[=:]\s*(.*)$", line)
        if match is None:
            raise PropertiesError(f"{source}:{number}: expected key=value, got {raw.strip()!r}")
        key, value = match.group(1), _TRAILING_COMMENT.sub("", match.group(2)).strip()
        entries[key] = Property(key, value, number)
    return entries


def read_properties(path: str | Path) -> dict[str, Property]:
    """Read and parse a serving.properties file; a directory means its serving.properties."""
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "serving.properties"
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise PropertiesError(f"cannot read the properties file {str(p)!r}: "
                              f"{exc.strerror}") from exc
    return parse_properties(text, source=str(p))
