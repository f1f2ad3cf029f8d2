"""What the fuzz tests send: bounded in cost, and (for one run) steered towards generation.

`bound_generation` keeps requests cheap: the fuzzer picks any integers the document allows, and a
`max_tokens` of 10**9 on the CPU model is a test that never ends, not a finding. Only integers
that are already there (or a missing or null length limit) change; a value of the wrong type
stays, so the server still has to refuse it.

`steer_to_generation` narrows a copy of the document so most generated chat and completion
requests pass validation and reach the engine (the served model's name, known roles, text
content): random roles and model names would otherwise stop nearly all of them at a 400 or 404.
Responses are still checked against the unchanged response schemas.
"""

from __future__ import annotations

import copy
from typing import Any

MAX_NEW_TOKENS = 4
MAX_CHOICES = 2

# Body field -> the most the fuzzer may ask for.
_CAPS = {"max_tokens": MAX_NEW_TOKENS, "max_completion_tokens": MAX_NEW_TOKENS,
         "max_output_tokens": MAX_NEW_TOKENS, "min_tokens": MAX_NEW_TOKENS, "n": MAX_CHOICES,
         "best_of": MAX_CHOICES}
_DJL_CAPS = {"max_new_tokens": MAX_NEW_TOKENS, "min_new_tokens": MAX_NEW_TOKENS}
GENERATING = ("/v1/chat/completions", "/v1/completions")
# Generating routes whose length limit is required (Anthropic's), bounded but not steered.
BOUNDED = ("/v1/messages",)
# Fields steering leaves out: refused by name (tools, audio, suffix, best_of), or valid only in
# combinations a schema cannot state (stream_options needs stream; logit_bias keys are token ids).
_LEFT_OUT = ("tools", "tool_choice", "functions", "function_call", "parallel_tool_calls", "audio",
             "prediction", "web_search_options", "modalities", "response_format", "suffix",
             "best_of", "stream_options", "logit_bias", "stop_token_ids")
# Sane values for the sampling fields, so they reach the sampler rather than a 400. Test data,
# not a copy of the server's limits: if those move, fewer requests get through, nothing breaks.
# Integers are listed (a range would also yield 1.0, which JSON Schema calls an integer).
_NUMBERS = {"temperature": (0, 2), "top_p": (0.01, 1), "min_p": (0, 1),
            "frequency_penalty": (-2, 2), "presence_penalty": (-2, 2),
            "repetition_penalty": (0.5, 2), "penalty_alpha": (0, 1)}
_INTEGERS = {"top_k": [0, 1, 5, 50], "logprobs": [0, 1, 5], "top_logprobs": [0, 1, 5],
             "seed": [0, 1, 2**31 - 1], "max_tokens": [1, MAX_NEW_TOKENS],
             "max_completion_tokens": [1, MAX_NEW_TOKENS], "min_tokens": [0, MAX_NEW_TOKENS],
             "n": [1, MAX_CHOICES]}
_TEXT = {"type": "string", "minLength": 1, "maxLength": 200}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _cap(body: dict, caps: dict[str, int]) -> None:
    for key, limit in caps.items():
        if _is_int(body.get(key)) and body[key] > limit:
            body[key] = limit


def bound_generation(path: str, body: Any) -> Any:
    """The body with its generation lengths and choice counts capped (in place, and returned)."""
    if not isinstance(body, dict):
        return body
    if path in BOUNDED:  # a missing limit is the server's 400 to give, not ours to fill
        _cap(body, _CAPS)
    elif path in GENERATING:
        _cap(body, _CAPS)
        # Without a limit (absent or null) the server may generate up to the context length.
        if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            body["max_tokens"] = MAX_NEW_TOKENS
    elif path == "/v1/responses":
        _cap(body, _CAPS)
        if body.get("max_output_tokens") is None:  # as chat: no limit, up to the context
            body["max_output_tokens"] = MAX_NEW_TOKENS
    elif path == "/invocations":
        params = body.get("parameters")
        if isinstance(params, dict):
            _cap(params, _DJL_CAPS)
            if params.get("max_new_tokens") is None:
                params["max_new_tokens"] = MAX_NEW_TOKENS
    return body


def steer_to_generation(document: dict, model: str) -> dict:
    """A copy of the document with only the generating operations, their requests narrowed."""
    doc = copy.deepcopy(document)
    doc["paths"] = {p: doc["paths"][p] for p in GENERATING}
    for item in doc["paths"].values():
        schema = item["post"]["requestBody"]["content"]["application/json"]["schema"]
        props = schema["properties"]
        props["model"] = {"enum": [model]}
        for name in _LEFT_OUT:
            props.pop(name, None)
        for name, prop in list(props.items()):
            kinds = {alt.get("type") for alt in prop.get("anyOf", [prop])}
            if name in _NUMBERS and "number" in kinds:
                lo, hi = _NUMBERS[name]
                props[name] = {"anyOf": [{"type": "number", "minimum": lo, "maximum": hi},
                                         {"type": "null"}]}
            elif name in _INTEGERS and "integer" in kinds:
                props[name] = {"enum": [*_INTEGERS[name], None]}
        if "decoding_strategy" in props:
            props["decoding_strategy"] = {"enum": ["greedy", "sample", "contrastive", None]}
        if "prompt" in props:
            props["prompt"] = {"anyOf": [_TEXT, {"type": "array", "items": _TEXT, "minItems": 1,
                                                  "maxItems": 3}]}
        if "messages" in props:
            message = props["messages"]["items"]
            message["properties"] = {"role": {"enum": ["system", "user", "assistant"]},
                                     "content": _TEXT}
            message["required"] = ["role", "content"]
            message["additionalProperties"] = False
            props["messages"].update(minItems=1, maxItems=4)
        schema["additionalProperties"] = False
    return doc
