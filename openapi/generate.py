"""Write seqgate's OpenAPI document, generated from the app itself.

`python -m openapi.generate [PATH]` writes it (default: openapi/openapi.json beside this file);
`--check` exits 1 when the file differs from what the app generates now, so CI can catch a stale
copy. Building the app loads no model: the lifespan, which would, never runs.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from pathlib import Path
from typing import Any

DOCUMENT = Path(__file__).resolve().parent / "openapi.json"


def build_document() -> dict[str, Any]:
    """The OpenAPI document of an app built with default settings."""
    from app.factory import create_app
    from app.settings import Settings

    return create_app(Settings()).openapi_schema.to_schema()


def render(document: dict[str, Any]) -> str:
    """Stable text: sorted keys and a trailing newline, so regenerating gives a clean diff."""
    return json.dumps(document, indent=2, sort_keys=True) + "\n"


def write(path: Path = DOCUMENT) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(build_document()), encoding="utf-8")
    return path


def stale_diff(path: Path = DOCUMENT, context: int = 2) -> str:
    """A unified diff from the file at `path` to the live document; empty when they agree."""
    committed = path.read_text(encoding="utf-8") if path.is_file() else ""
    live = render(build_document())
    return "".join(difflib.unified_diff(committed.splitlines(keepends=True),
                                        live.splitlines(keepends=True),
                                        str(path), "generated from the app", n=context))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m openapi.generate", description=__doc__)
    parser.add_argument("path", nargs="?", type=Path, default=DOCUMENT)
    parser.add_argument("--check", action="store_true",
                        help="do not write; exit 1 and show the diff when the file is stale")
    args = parser.parse_args(argv)
    if args.check:
        diff = stale_diff(args.path)
        if diff:
            print(diff, end="")
            print(f"{args.path} is stale: run `seqgate openapi` (or python -m openapi.generate)",
                  file=sys.stderr)
            return 1
        return 0
    print(write(args.path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
