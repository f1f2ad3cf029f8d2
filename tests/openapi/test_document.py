"""The committed OpenAPI document: current, valid, and compatible with OpenAI's API."""

from __future__ import annotations

import copy

import pytest

from openapi.checks.validate import (
    ACCEPTED,
    CONTRACT,
    Contract,
    check_contract,
    spec_errors,
    unknown_extensions,
)
from openapi.generate import DOCUMENT, stale_diff


def _ids(contract: Contract) -> str:
    return contract.name


def test_committed_document_is_what_the_app_generates():
    diff = stale_diff(DOCUMENT, context=1)
    assert not diff, (f"{DOCUMENT.name} is stale: run `seqgate openapi` (or python -m "
                      f"openapi.generate) and commit it\n{diff[:4000]}")


def test_document_is_valid_openapi(document):
    assert document["openapi"].startswith("3.1")
    assert spec_errors(document) == []


def test_every_operation_is_documented_for_clients(document):
    for path, item in document["paths"].items():
        for method, op in item.items():
            assert op.get("operationId") and op.get("summary"), f"{method.upper()} {path}"
            assert "200" in op["responses"], f"{method.upper()} {path}"


@pytest.mark.parametrize("contract", CONTRACT, ids=_ids)
def test_field_names_and_types_match_openai(contract, document, openai_reference):
    result = check_contract(contract, document, openai_reference)
    found = {(contract.name, p.path): p for p in result.problems if p.kind != "required"}
    unexpected = [str(p) for key, p in found.items() if key not in ACCEPTED]
    assert unexpected == []
    # An accepted deviation that no longer occurs should leave the list.
    gone = [path for (name, path) in ACCEPTED if name == contract.name
            and (name, path) not in found]
    assert gone == [], f"no longer deviating, remove from openapi.checks.validate.ACCEPTED: {gone}"
    assert unknown_extensions(result) == [], "fields OpenAI's API does not have (misspelled?)"


@pytest.mark.parametrize("contract", CONTRACT, ids=_ids)
def test_required_fields_match_openai(contract, document, openai_reference):
    """A response promises (marks required) every field OpenAI's clients rely on; a request
    requires nothing OpenAI leaves optional."""
    result = check_contract(contract, document, openai_reference)
    assert [str(p) for p in result.problems if p.kind == "required"] == []


def test_the_contract_check_catches_a_breaking_change(document, openai_reference):
    """A chat request whose `messages` became a string, or a response whose `created` became a
    string, must be reported: the check above is not vacuous."""
    broken = copy.deepcopy(document)
    op = broken["paths"]["/v1/chat/completions"]["post"]
    op["requestBody"]["content"]["application/json"]["schema"]["properties"]["messages"] = {
        "type": "string"}
    op["responses"]["200"]["content"]["application/json"]["schema"]["properties"]["created"] = {
        "type": "string"}
    request, response = CONTRACT[0], CONTRACT[1]
    assert [p.path for p in check_contract(request, broken, openai_reference).problems] == [
        "messages"]
    assert "created" in [p.path for p in check_contract(response, broken,
                                                        openai_reference).problems]
