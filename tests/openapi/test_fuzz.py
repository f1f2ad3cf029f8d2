"""Schemathesis against a live server with the real model: no 5xx, and every response matches our
own document (status code, content type, headers, JSON body).

Two runs: every operation with positive and negative cases from the committed document, and the
chat and completion operations with requests steered to reach the engine (tests/openapi/fuzzing).
The budget is small here (FUZZ_MAX_EXAMPLES per operation and run, default 20, fuzzing phase
only); `make fuzz` runs the same tests with a larger budget and schemathesis' coverage phase.
"""

from __future__ import annotations

import json
import os
from collections import Counter

import pytest
import schemathesis
from schemathesis.config import SchemathesisConfig

from engine.model.loader import DEFAULT_MODEL_NAME
from openapi.generate import DOCUMENT
from tests.openapi.fuzzing import bound_generation, steer_to_generation

pytestmark = pytest.mark.slow

MAX_EXAMPLES = int(os.environ.get("FUZZ_MAX_EXAMPLES", "20"))
COVERAGE = os.environ.get("FUZZ_COVERAGE", "0") == "1"

# Tallies for the summary conftest prints: "run: operation" -> cases, (run, status) -> responses.
CASES: Counter[str] = Counter()
STATUSES: Counter[tuple[str, int]] = Counter()


def _config(mode: str, coverage: bool) -> SchemathesisConfig:
    return SchemathesisConfig.from_dict({
        "seed": 20240601,
        "phases": {"examples": {"enabled": True}, "coverage": {"enabled": coverage},
                   "fuzzing": {"enabled": True}, "stateful": {"enabled": False}},
        "generation": {"max-examples": MAX_EXAMPLES, "mode": mode, "database": "none"},
        # Not "every schema-valid request succeeds": the server checks more than the schema can
        # say (a non-empty prompt, the served model's name, the context length) and answers
        # those with a documented 400/404 in OpenAI's error envelope.
        "checks": {"positive_data_acceptance": {"enabled": False}},
    })


# The committed document (test_document.py checks that it is the live app's).
_DOCUMENT = json.loads(DOCUMENT.read_text(encoding="utf-8"))
schema = schemathesis.openapi.from_dict(_DOCUMENT, config=_config("all", COVERAGE))
steered = schemathesis.openapi.from_dict(steer_to_generation(_DOCUMENT, DEFAULT_MODEL_NAME),
                                         config=_config("positive", False))


def _call_and_validate(run: str, case, live_server) -> None:
    bound_generation(case.path, case.body)
    response = case.call(base_url=live_server.url, timeout=60)
    CASES[f"{run}: {case.operation.label}"] += 1
    STATUSES[run, response.status_code] += 1
    # Validated against our document's responses (the steered copy keeps them unchanged).
    case.validate_response(response, transport_kwargs={"base_url": live_server.url})


@schema.parametrize()
def test_api_conforms_to_its_document(case, live_server):
    _call_and_validate("document", case, live_server)


@steered.parametrize()
def test_generation_conforms_to_the_document(case, live_server):
    assert live_server.gateway.model_name == DEFAULT_MODEL_NAME
    _call_and_validate("generation", case, live_server)
