"""The schema a constrained answer is held to, shown to the model: its drawing, when it is left
out, and where it lands in the prompt (the embedded model's tokenizer, no engine)."""

from __future__ import annotations

import json
from typing import Literal

from openai.lib._pydantic import to_strict_json_schema
from pydantic import BaseModel, Field

from adapters.openai_chat import chat_prompt
from adapters.openai_types import ChatCompletionRequest, ChatMessage
from adapters.schema_prompt import carried, instruction


class City(BaseModel):
    name: str
    country: str
    population_millions: float = Field(ge=0, le=100)


class Step(BaseModel):
    explanation: str
    output: str


class Reasoning(BaseModel):
    steps: list[Step]
    mood: Literal["calm", "tense"] | None = Field(description="How the solver feels")
    done: bool


def test_a_model_is_drawn_as_its_answer_with_slots_to_fill():
    shape = instruction(to_strict_json_schema(City)).splitlines()[-1]
    assert shape == ('{"name": <string>, "country": <string>, '
                     '"population_millions": <number: from 0 to 100>}')


def test_references_enums_unions_and_descriptions_are_drawn():
    shape = instruction(to_strict_json_schema(Reasoning)).splitlines()[-1]
    assert shape == ('{"steps": [{"explanation": <string>, "output": <string>}, ...], '
                     '"mood": "calm" or "tense" or null, "done": true or false}')
    assert "<string: How the solver feels>" in instruction(
        {"type": "object", "properties": {"m": {"type": "string",
                                                "description": "How the solver feels"}}})


def test_what_has_no_short_shape_is_shown_as_the_schema_itself():
    schema = {"type": "object", "properties": {"a": {"allOf": [{"type": "string"}]}}}
    assert instruction(schema).endswith(json.dumps(schema))
    assert instruction({"$ref": "#/$defs/missing"}).endswith('{"$ref": "#/$defs/missing"}')
    assert instruction({"type": "object"}) == "Answer with a JSON object only."


def test_a_schema_already_in_the_conversation_is_not_shown_again():
    schema = to_strict_json_schema(City)
    assert carried(schema, [f"Follow this schema: {json.dumps(schema, indent=2)}"])
    assert carried(schema, [json.dumps(schema, separators=(",", ":"))])
    assert not carried(schema, ["Describe Paris."])
    assert carried({"type": "object"}, ["Reply in JSON please."])
    assert not carried({"type": "object"}, ["Reply please."])


def _request(messages: list[tuple[str, str]], **fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[ChatMessage(role=r, content=c) for r, c in messages],
                                 **fields)


def _text(tokenizer, req: ChatCompletionRequest, **kw) -> str:
    return tokenizer.decode(chat_prompt(req, tokenizer, 2048, **kw)[0])


CITY_FORMAT = {"type": "json_schema", "json_schema": {
    "name": "City", "strict": True, "schema": to_strict_json_schema(City)}}


def test_the_instruction_is_merged_into_the_system_message(tokenizer):
    shape = instruction(to_strict_json_schema(City))
    alone = _text(tokenizer, _request([("user", "Describe Paris.")], response_format=CITY_FORMAT))
    assert shape in alone and alone.count("<|im_start|>system") == 1
    merged = _text(tokenizer, _request([("system", "Be terse."), ("user", "Describe Paris.")],
                                       response_format=CITY_FORMAT))
    assert f"Be terse.\n\n{shape}" in merged and merged.count("<|im_start|>system") == 1
    guided = _text(tokenizer, _request([("user", "Describe Paris.")],
                                       guided_json=to_strict_json_schema(City)))
    assert shape in guided


def test_the_server_default_and_the_request_extra_turn_it_off(tokenizer):
    shape = instruction(to_strict_json_schema(City))
    req = _request([("user", "Describe Paris.")], response_format=CITY_FORMAT)
    assert shape not in _text(tokenizer, req, schema_prompt=False)
    off = _request([("user", "Describe Paris.")], response_format=CITY_FORMAT,
                   schema_prompt=False)
    assert shape not in _text(tokenizer, off)
    on = _request([("user", "Describe Paris.")], response_format=CITY_FORMAT, schema_prompt=True)
    assert shape in _text(tokenizer, on, schema_prompt=False)
    plain = _request([("user", "Describe Paris.")])
    assert _text(tokenizer, plain) == _text(tokenizer, plain, schema_prompt=False)


def test_forced_tools_get_their_own_prompt_not_a_schema(tokenizer):
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string"}}}}}
    req = _request([("user", "Call f.")], tools=[tool], tool_choice="required")
    assert "Answer with a JSON object only" not in _text(tokenizer, req)
