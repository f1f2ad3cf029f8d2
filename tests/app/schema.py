"""Access to the official OpenAI schema checker in the `shared/` folder beside the checkout.

CI clones the repository with `shared/` next to it; elsewhere the schema tests skip, saying why.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CHECKER = REPO.parent / "shared" / "tools" / "openai_schema.py"
# The schema each Responses stream event is checked against, by its type.
EVENT_SCHEMAS = {
    "response.created": "ResponseCreatedEvent",
    "response.in_progress": "ResponseInProgressEvent",
    "response.output_item.added": "ResponseOutputItemAddedEvent",
    "response.content_part.added": "ResponseContentPartAddedEvent",
    "response.output_text.delta": "ResponseTextDeltaEvent",
    "response.output_text.done": "ResponseTextDoneEvent",
    "response.reasoning_text.delta": "ResponseReasoningTextDeltaEvent",
    "response.reasoning_text.done": "ResponseReasoningTextDoneEvent",
    "response.content_part.done": "ResponseContentPartDoneEvent",
    "response.function_call_arguments.delta": "ResponseFunctionCallArgumentsDeltaEvent",
    "response.function_call_arguments.done": "ResponseFunctionCallArgumentsDoneEvent",
    "response.output_item.done": "ResponseOutputItemDoneEvent",
    "response.completed": "ResponseCompletedEvent",
    "response.incomplete": "ResponseIncompleteEvent",
    "response.failed": "ResponseFailedEvent",
    "error": "ResponseErrorEvent",
}


def load_schema_errors() -> Callable[[str, object], list[str]]:
    """`schema_errors(name, body)` from shared/tools/openai_schema.py, or skip the test."""
    if not CHECKER.is_file():
        pytest.skip(f"OpenAI schema checker not found at {CHECKER} (the shared/ folder that "
                    "sits beside the checkout)")
    spec = importlib.util.spec_from_file_location("openai_schema", CHECKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not module.SPEC.is_file():
        pytest.skip(f"OpenAI reference schema not found at {module.SPEC}")
    return module.schema_errors


def conforms_as_completion_chunk(schema_errors, chunk) -> bool:
    """Completions stream chunks share CreateCompletionResponse, whose finish_reason is a string;
    OpenAI (and vLLM) send null until a choice finishes, so that one deviation is allowed."""
    errors = schema_errors("CreateCompletionResponse", chunk, limit=50)
    return all("finish_reason: None" in e for e in errors)


def without_echo_nulls(body: dict) -> dict:
    """A completions body with each choice's echoed first token given a logprob: OpenAI's API
    sends null there (nothing precedes the prompt's first token) where its schema says number
    (openapi/checks/validate.py accepts the difference); everything else must conform."""
    import copy

    body = copy.deepcopy(body)
    for choice in body.get("choices", []):
        lp = choice.get("logprobs") or {}
        if lp.get("token_logprobs") and lp["token_logprobs"][0] is None:
            lp["token_logprobs"][0], lp["top_logprobs"][0] = 0.0, {}
    return body
