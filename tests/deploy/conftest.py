"""Fixtures for the deployment tests: the parsed Dockerfile and compose.yaml, the app's routes and
CLI. There is no Docker engine here, so these check what can be checked without one."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from app.__main__ import build_parser
from app.factory import create_app
from app.settings import Settings

REPO = Path(__file__).resolve().parents[2]
# CI clones the repository with the shared/ folder beside it.
SHARED = REPO.parent / "shared"


@dataclass
class Stage:
    """One FROM … stage of the Dockerfile: its name and instructions (from the BuildKit parser)."""

    name: str
    commands: list = field(default_factory=list)

    def all(self, cmd: str) -> list:
        return [c for c in self.commands if c.cmd == cmd]

    def last(self, cmd: str):
        found = self.all(cmd)
        assert found, f"stage {self.name!r} has no {cmd}"
        return found[-1]

    def env(self) -> dict[str, str]:
        """ENV keys set in this stage, in order (later wins)."""
        out: dict[str, str] = {}
        for c in self.all("ENV"):
            out.update(zip(c.value[::2], c.value[1::2]))
        return out


def dockerfile_stages(path: Path) -> list[Stage]:
    import dockerfile  # the BuildKit parser, compiled

    stages: list[Stage] = []
    for command in dockerfile.parse_file(str(path)):
        if command.cmd == "FROM":
            value = command.value
            stages.append(Stage(value[2] if len(value) > 2 else str(len(stages))))
        elif stages:
            stages[-1].commands.append(command)
    return stages


def exec_args(command) -> list[str]:
    """CMD / ENTRYPOINT / HEALTHCHECK arguments, exec form or shell form."""
    args = list(command.value)
    if command.cmd == "HEALTHCHECK":
        assert args[0] == "CMD", f"HEALTHCHECK should run a command: {command.original}"
        args = args[1:]
    return args if command.json else shlex.split(" ".join(args))


def health_url(args: list[str]) -> str:
    """The URL a health check command fetches."""
    found = re.findall(r"https?://[^\s'\"]+", " ".join(args))
    assert len(found) == 1, f"expected one URL in the health check: {args}"
    return found[0]


def url_port_and_path(url: str) -> tuple[int, str]:
    parts = urlsplit(url)
    return parts.port or 80, parts.path


@pytest.fixture(scope="session")
def stages() -> list[Stage]:
    return dockerfile_stages(REPO / "Dockerfile")


@pytest.fixture(scope="session")
def runtime(stages) -> Stage:
    """The stage the image runs (the last one)."""
    return stages[-1]


@pytest.fixture(scope="session")
def compose() -> dict:
    return yaml.safe_load((REPO / "compose.yaml").read_text(encoding="utf-8"))


@pytest.fixture(scope="session")
def routes() -> set[tuple[str, str]]:
    """(method, path) of every route the app serves, from the app itself."""
    app = create_app(Settings())
    return {(method, route.path) for route in app.routes for method in route.methods}


@pytest.fixture(scope="session")
def cli():
    return build_parser()


# The session's live server (real SmolLM2 on a free port) comes from the app tests.
from tests.app.conftest import gateway_engine, live_server  # noqa: E402, F401
