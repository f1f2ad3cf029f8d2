"""Fixtures for the OpenAPI tests: our committed document and OpenAI's reference document."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from openapi.generate import DOCUMENT

REPO = Path(__file__).resolve().parents[2]
# CI clones the repository with the shared/ folder beside it.
SHARED = REPO.parent / "shared"


@pytest.fixture(scope="session")
def document() -> dict:
    if not DOCUMENT.is_file():
        pytest.fail(f"{DOCUMENT} is missing: run `python -m openapi.generate`")
    return json.loads(DOCUMENT.read_text(encoding="utf-8"))


@pytest.fixture(scope="session")
def openai_reference() -> dict:
    path = SHARED / "reference" / "openai-openapi" / "openapi.json"
    if not path.is_file():
        pytest.skip(f"OpenAI's reference document not found at {path} (the shared/ folder that "
                    "sits beside the checkout)")
    return json.loads(path.read_text(encoding="utf-8"))


# The session's live server (real SmolLM2 on a free port) comes from the app tests.
from tests.app.conftest import gateway_engine, live_server  # noqa: E402, F401


def pytest_terminal_summary(terminalreporter):
    """How many cases schemathesis sent, per operation, and what came back."""
    test_fuzz = sys.modules.get("tests.openapi.test_fuzz")
    if test_fuzz is None or not test_fuzz.CASES:
        return
    total = sum(test_fuzz.CASES.values())
    terminalreporter.write_sep("-", f"schemathesis: {total} cases")
    for op, n in sorted(test_fuzz.CASES.items()):
        terminalreporter.write_line(f"  {n:5d}  {op}")
    for run in sorted({run for run, _ in test_fuzz.STATUSES}):
        statuses = ", ".join(f"{code}: {n}" for (r, code), n in sorted(test_fuzz.STATUSES.items())
                             if r == run)
        terminalreporter.write_line(f"  {run} responses by status: {statuses}")
