"""Check our OpenAPI document: a valid OpenAPI 3.1 document, and compatible with OpenAI's API.

`python -m openapi.checks.validate [DOCUMENT] [--reference OPENAI_OPENAPI_JSON]` validates the
document with openapi-spec-validator, then compares each operation we share with OpenAI
(`CONTRACT`) against the official schema: same field names and JSON types for what we support
(see openapi/checks/compat.py).
Exit 1 when anything disagrees.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from openapi.checks.compat import Comparison, Direction, compare
from openapi.generate import DOCUMENT

REPO = Path(__file__).resolve().parents[2]
# CI clones the repository with the shared/ folder beside it.
OPENAI_REFERENCE = REPO.parent / "shared" / "reference" / "openai-openapi" / "openapi.json"

Schema = dict[str, Any]


def spec_errors(document: Schema, limit: int = 20) -> list[str]:
    """Why the document is not a valid OpenAPI document (empty when it is)."""
    from openapi_spec_validator import OpenAPIV31SpecValidator

    errors = OpenAPIV31SpecValidator(document).iter_errors()
    return [f"{'/'.join(map(str, e.absolute_path)) or '(root)'}: {e.message[:200]}"
            for _, e in zip(range(limit), errors)]


def operation_schema(document: Schema, method: str, path: str, part: str) -> Schema:
    """`request` body schema, or the JSON schema of response `part` (a status code)."""
    op = document["paths"][path][method.lower()]
    if part == "request":
        return op["requestBody"]["content"]["application/json"]["schema"]
    return op["responses"][part]["content"]["application/json"]["schema"]


def _chat_chunk_schema(_: Schema) -> tuple[Schema, Schema]:
    # Stream events are documented as text only (OpenAPI 3.1 cannot type SSE events), so the
    # chunk's schema is made the way the app documents response bodies, from the struct it
    # encodes the chunks with.
    from adapters.openai_types import ChatCompletionChunk
    from app.api_docs import json_schema

    schema = json_schema(ChatCompletionChunk, response=True)
    return schema, schema


_chat_chunk_schema.__name__ = "POST /v1/chat/completions stream chunk"


def _responses_event_schema(name: str) -> Callable[[Schema], tuple[Schema, Schema]]:
    """A /v1/responses stream event's schema, made from its struct like the chat chunk's."""
    def get(_: Schema) -> tuple[Schema, Schema]:
        from adapters import responses_types
        from app.api_docs import json_schema

        schema = json_schema(getattr(responses_types, name), response=True)
        return schema, schema

    get.__name__ = f"POST /v1/responses stream {name}"
    return get


def _from_document(method: str, path: str, part: str) -> Callable[[Schema], tuple[Schema, Schema]]:
    def get(document: Schema) -> tuple[Schema, Schema]:
        return operation_schema(document, method, path, part), document

    get.__name__ = f"{method} {path} {part}"
    return get


@dataclass(frozen=True)
class Contract:
    """One of our schemas that must stay compatible with one of OpenAI's components."""

    ours: Callable[[Schema], tuple[Schema, Schema]]  # document -> (schema, its root)
    openai: str  # components/schemas name in OpenAI's document
    direction: Direction

    @property
    def name(self) -> str:
        return f"{self.ours.__name__} ~ {self.openai}"


CONTRACT: tuple[Contract, ...] = (
    Contract(_from_document("POST", "/v1/chat/completions", "request"),
             "CreateChatCompletionRequest", "request"),
    Contract(_from_document("POST", "/v1/chat/completions", "200"),
             "CreateChatCompletionResponse", "response"),
    Contract(_chat_chunk_schema, "CreateChatCompletionStreamResponse", "response"),
    Contract(_from_document("POST", "/v1/completions", "request"),
             "CreateCompletionRequest", "request"),
    Contract(_from_document("POST", "/v1/completions", "200"),
             "CreateCompletionResponse", "response"),
    Contract(_from_document("GET", "/v1/models", "200"), "ListModelsResponse", "response"),
    Contract(_from_document("GET", "/v1/models/{model_id}", "200"), "Model", "response"),
    Contract(_from_document("POST", "/v1/chat/completions", "400"), "ErrorResponse", "response"),
    Contract(_from_document("POST", "/v1/embeddings", "request"), "CreateEmbeddingRequest",
             "request"),
    Contract(_from_document("POST", "/v1/embeddings", "200"), "CreateEmbeddingResponse",
             "response"),
    Contract(_from_document("POST", "/v1/responses", "request"), "CreateResponse", "request"),
    Contract(_from_document("POST", "/v1/responses", "200"), "Response", "response"),
    Contract(_from_document("GET", "/v1/responses/{response_id}", "200"), "Response",
             "response"),
    Contract(_from_document("GET", "/v1/responses/{response_id}/input_items", "200"),
             "ResponseItemList", "response"),
    Contract(_from_document("POST", "/v1/responses/{response_id}/cancel", "200"), "Response",
             "response"),
    *(Contract(_responses_event_schema(ours), theirs, "response") for ours, theirs in (
        ("LifecycleEvent", "ResponseCompletedEvent"),
        ("OutputItemEvent", "ResponseOutputItemDoneEvent"),
        ("ContentPartEvent", "ResponseContentPartDoneEvent"),
        ("TextDeltaEvent", "ResponseTextDeltaEvent"),
        ("TextDoneEvent", "ResponseTextDoneEvent"),
        ("ArgumentsDeltaEvent", "ResponseFunctionCallArgumentsDeltaEvent"),
        ("ArgumentsDoneEvent", "ResponseFunctionCallArgumentsDoneEvent"),
        ("ErrorEvent", "ResponseErrorEvent"))),
)


# Field names we accept or send that OpenAI's API does not have. Each is a known extension from
# vLLM's OpenAI server or DJL's parameters; a name not listed here is more likely a misspelling of
# an OpenAI field than a new feature.
EXTENSIONS = {
    "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
    "skip_special_tokens", "priority",  # vLLM sampling and scheduling parameters
    "guided_json", "guided_regex", "guided_choice", "guided_grammar",  # vLLM structured outputs
    "response_format",  # chat's, which vLLM also takes on /v1/completions
    "continuous_usage_stats",  # vLLM stream_options
    "decoding_strategy", "penalty_alpha",  # DJL / transformers contrastive search
    "prompt_logprobs",  # vLLM: the prompt tokens' log-probabilities
    "echo",  # /v1/completions', taken on chat only to be refused by name
    "chat_template_kwargs",  # vLLM: variables for the chat template (enable_thinking, ...)
    "reasoning", "reasoning_content",  # vLLM: a reasoning model's thinking, apart from content
    "schema_prompt",  # seqgate's: show the model a constraining schema (adapters/schema_prompt.py)
    "reasoning_parser",  # seqgate's: this request's reasoning parser (adapters/reasoning.py)
    "max_model_len",  # vLLM's model card
    # chat's sampling fields, which /v1/responses takes too (its request is chat's underneath)
    "n", "stop", "seed", "presence_penalty", "frequency_penalty", "logit_bias",
}

# Differences from OpenAI's document that are deliberate, keyed by (contract name, field path).
ACCEPTED = {
    ("POST /v1/embeddings 200 ~ CreateEmbeddingResponse", "data[].embedding"):
        "with encoding_format=base64 the vector is a base64 string, as OpenAI's API sends it "
        "(its document types only the float list)",
    ("POST /v1/completions request ~ CreateCompletionRequest", "prompt"):
        "OpenAI's API turns a null prompt into '<|endoftext|>'; we refuse it with 400 "
        "(param=prompt) rather than generate from nothing",
    ("POST /v1/completions 200 ~ CreateCompletionResponse", "choices[].finish_reason"):
        "the same struct is the stream chunk, where finish_reason is null until the choice ends "
        "(as OpenAI streams it, with this very schema)",
    ("POST /v1/completions 200 ~ CreateCompletionResponse", "usage"):
        "null in stream chunks unless stream_options.include_usage, as OpenAI streams it",
    ("POST /v1/completions 200 ~ CreateCompletionResponse", "choices[].logprobs.token_logprobs[]"):
        "with echo, the first prompt token has no logprob; OpenAI's API sends null there too",
    ("POST /v1/completions 200 ~ CreateCompletionResponse", "choices[].logprobs.top_logprobs[]"):
        "with echo, the first prompt token has no alternatives; OpenAI's API sends null too",
    **{("GET /v1/responses/{response_id}/input_items 200 ~ ResponseItemList", name):
       "an empty page (after= the last item) has no first or last item: null says so"
       for name in ("first_id", "last_id")},
}

def unknown_extensions(result: Comparison) -> list[str]:
    """Our fields that are neither OpenAI's nor in EXTENSIONS."""
    return [e for e in result.extensions
            if e.rsplit(".", 1)[-1].removesuffix("[]") not in EXTENSIONS]


def check_contract(contract: Contract, document: Schema, reference: Schema) -> Comparison:
    ours, root = contract.ours(document)
    theirs = reference["components"]["schemas"][contract.openai]
    return compare(ours, root, theirs, reference, contract.direction)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m openapi.checks.validate",
                                     description=__doc__)
    parser.add_argument("document", nargs="?", type=Path, default=DOCUMENT)
    parser.add_argument("--reference", type=Path, default=OPENAI_REFERENCE,
                        help="OpenAI's openapi.json (default: %(default)s)")
    args = parser.parse_args(argv)
    document = json.loads(args.document.read_text(encoding="utf-8"))
    failed = False
    for error in spec_errors(document):
        print(f"invalid OpenAPI: {error}")
        failed = True
    if not args.reference.is_file():
        print(f"OpenAI reference not found at {args.reference}: compatibility not checked")
        return int(failed)
    reference = json.loads(args.reference.read_text(encoding="utf-8"))
    for contract in CONTRACT:
        result = check_contract(contract, document, reference)
        print(f"{contract.name}: extensions: {', '.join(result.extensions) or 'none'}")
        for problem in result.problems:
            reason = ACCEPTED.get((contract.name, problem.path))
            print(f"  accepted: {problem} ({reason})" if reason else f"  PROBLEM: {problem}")
            failed |= reason is None
        for extension in unknown_extensions(result):
            print(f"  PROBLEM: {extension}: not an OpenAI field nor a known extension")
            failed = True
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
