"""Load settings the way a container would, and collect every complaint the settings code makes.

A deployment file should start the server without a single settings warning: an unknown
SEQGATE_* variable or serving.properties key is reported by app/settings.py itself, so these tests
ask that code rather than keep a copy of its list.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

from app.settings import Settings, load_settings


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def load_as_container(args, env: Mapping[str, str],
                      config: Path | None = None) -> tuple[Settings, list[str]]:
    """Settings from parsed CLI args, a container's environment and a properties file (a local
    path standing in for the mounted one), and the warnings logged while building them."""
    handler = _Collect()
    logger = logging.getLogger("seqgate.settings")
    logger.addHandler(handler)
    try:
        flags = {**vars(args), "config": str(config) if config else None}
        settings = load_settings(flags, env=dict(env))
    finally:
        logger.removeHandler(handler)
    return settings, handler.messages


def read_env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines as compose's env_file reads them (comments and blank lines skipped)."""
    env: dict[str, str] = {}
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        assert sep, f"{path}: not KEY=VALUE: {raw!r}"
        env[key.strip()] = value.strip()
    return env
