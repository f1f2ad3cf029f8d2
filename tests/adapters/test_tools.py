"""Tool plans, the two tool formats, the call grammar and the answer parsers, without a server;
and the native (Hermes) path end to end on a live server whose template knows tools."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest

from adapters.errors import ApiError
from adapters.openai_chat import build_chat_job, template_messages
from adapters.openai_types import ChatCompletionRequest, ChatMessage
from adapters.structured import closed
from adapters.tool_syntax import HERMES as HERMES_SYNTAX
from adapters.tools import call_block, tool_format, tool_grammar, tool_plan
from engine import Engine, EngineConfig
from engine.sample.grammar import Grammar

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}

# A Hermes-style template (the format Qwen2.5 and Hermes 2/3 use), written for these tests: tools
# go into the system turn inside <tools>, calls come back in <tool_call> blocks, tool results go
# in as <tool_response>.
HERMES = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- elif message.role == 'assistant' %}<|im_start|>assistant
{{ message.content or '' }}
{%- for call in message.tool_calls or [] %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

HISTORY = [
    ChatMessage(role="user", content="Weather in Rome?"),
    ChatMessage(role="assistant", content=None, tool_calls=[
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]),
    ChatMessage(role="tool", tool_call_id="call_1", content="sunny, 24 C"),
]


@pytest.fixture(scope="module")
def hermes_tokenizer(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = HERMES
    return tok


# -- plans ------------------------------------------------------------------------------------

@pytest.mark.parametrize(("kw", "param"), [
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]},
     "tools[0].function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
     "tools[0].function.parameters"),
    ({"tools": [WEATHER], "functions": [WEATHER["function"]]}, "functions"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"functions": [WEATHER["function"]], "function_call": "required"}, "function_call"),
    ({"tools": [WEATHER] * 129}, "tools"),
])
def test_bad_tool_fields_name_the_parameter(kw, param):
    args = {k: kw.get(k) for k in ("tools", "tool_choice", "parallel_tool_calls", "functions",
                                   "function_call")}
    with pytest.raises(ApiError) as info:
        tool_plan(args["tools"], args["tool_choice"], args["parallel_tool_calls"],
                  args["functions"], args["function_call"])
    assert info.value.status == 400 and info.value.param == param


def test_plans():
    assert tool_plan(None, None, None, None, None) is None
    assert tool_plan([], "none", None, None, None) is None
    auto = tool_plan([WEATHER], None, None, None, None)
    assert auto.choice == "auto" and auto.parallel and not auto.legacy
    named = tool_plan([WEATHER], {"type": "function", "function": {"name": "get_weather"}},
                      False, None, None)
    assert named.choice == "get_weather" and not named.parallel
    legacy = tool_plan(None, None, None, [WEATHER["function"]], {"name": "get_weather"})
    assert legacy.legacy and legacy.choice == "get_weather" and not legacy.parallel


def test_closed_schemas():
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {}},
                                               "b": {"type": "array", "items": {
                                                   "type": "object", "properties": {"c": {}}}}},
              "$defs": {"D": {"type": "object", "properties": {"x": {}}}}}
    out = closed(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["a"]["additionalProperties"] is False
    assert out["properties"]["b"]["items"]["additionalProperties"] is False
    assert out["$defs"]["D"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # a copy
    assert closed({"type": "object", "properties": {}, "additionalProperties": True})[
        "additionalProperties"] is True  # what the schema says wins


# -- the grammar ------------------------------------------------------------------------------

def accepts(compiler, grammar: str, text: str) -> bool:
    matcher = compiler.compile(Grammar.lark(grammar)).matcher()
    ids = compiler._hf_tokenizer.encode(text, add_special_tokens=False)
    return matcher.validate_tokens(ids) == len(ids) and matcher.consume_tokens(ids) \
        and matcher.is_accepting()


def test_call_grammars(compiler):
    call = call_block("get_weather", {"city": "Rome"})
    auto = tool_grammar(tool_plan([WEATHER], "auto", None, None, None), None)
    assert accepts(compiler, auto, call)
    assert accepts(compiler, auto, "It is sunny.")
    assert not accepts(compiler, auto, call_block("get_weather", {"town": "Rome"}))
    assert not accepts(compiler, auto, call_block("get_weather", {"city": "Rome", "x": 1}))
    required = tool_grammar(tool_plan([WEATHER], "required", None, None, None), None)
    assert accepts(compiler, required, call + "\n" + call)  # parallel calls
    assert not accepts(compiler, required, "It is sunny.")
    single = tool_grammar(tool_plan([WEATHER], "required", False, None, None), None)
    assert not accepts(compiler, single, call + "\n" + call)
    assert tool_grammar(tool_plan([WEATHER], "none", None, None, None), None) is None
    with_schema = tool_grammar(tool_plan([WEATHER], "auto", None, None, None),
                               {"type": "object", "properties": {"answer": {"type": "string"}},
                                "required": ["answer"]})
    assert accepts(compiler, with_schema, '{"answer": "sunny"}')
    assert not accepts(compiler, with_schema, "sunny")


# -- parsing ----------------------------------------------------------------------------------

def test_parse_hermes_answers():
    calls_text = call_block("a", {"x": 1}) + "\n" + call_block("b", {})
    content, calls = HERMES_SYNTAX.parse(calls_text)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("a", {"x": 1}), ("b", {})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    assert HERMES_SYNTAX.parse("plain text") == ("plain text", [])
    assert HERMES_SYNTAX.parse("<tool_call>\nnot json\n</tool_call>") == (
        "<tool_call>\nnot json\n</tool_call>", [])
    # Calls open the answer: under `auto` the grammar allows a call after text only as text.
    later = "Let me check.\n" + call_block("a", {})
    assert HERMES_SYNTAX.parse(later) == (later, [])


# Hermes answers for the stream parser's test (tests/adapters/test_tool_syntax.py).
ANSWERS = [call_block("get_weather", {"city": "Rome"}) + "\n" + call_block("f", {"k": [1, 2]}),
           "  Hello, <tool_call> is just text here.", "<", "<tool", "",
           "Let me check.\n" + call_block("a", {}), call_block("a", {}) + "\r\n\t"]


# -- the two formats --------------------------------------------------------------------------

def test_formats_are_detected(tokenizer, hermes_tokenizer):
    assert tool_format(tokenizer) == "generic"  # SmolLM2's template renders no tools
    assert tool_format(hermes_tokenizer) == "hermes"


def test_generic_format_describes_tools_and_writes_history_as_text(tokenizer, compiler):
    req = ChatCompletionRequest(messages=HISTORY, tools=[WEATHER], max_tokens=8)
    text = tokenizer.decode(build_chat_job(req, tokenizer, 8192, grammars=compiler).prompt_ids)
    assert "You can call the following tools" in text and '"name":"get_weather"' in text
    assert call_block("get_weather", {"city": "Rome"}) in text
    assert "<tool_response>\nsunny, 24 C\n</tool_response>" in text
    messages = template_messages(HISTORY + [ChatMessage(role="tool", content="more")])
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]  # results merged


def test_native_format_passes_tools_and_history_to_the_template(hermes_tokenizer, compiler):
    req = ChatCompletionRequest(messages=HISTORY, tools=[WEATHER], max_tokens=8)
    spec = build_chat_job(req, hermes_tokenizer, 8192, grammars=compiler)
    text = hermes_tokenizer.decode(spec.prompt_ids)
    assert "<tools>" + json.dumps(WEATHER) in text  # the template rendered our tools
    assert "You can call the following tools" not in text
    assert '{"name": "get_weather", "arguments": {"city": "Rome"}}' in text
    assert "<tool_response>\nsunny, 24 C\n</tool_response>" in text
    assert spec.tools is not None and spec.params.grammar is not None


@pytest.mark.slow
def test_native_tool_call_becomes_tool_calls(smollm2, hermes_tokenizer):
    """A live server whose model's template knows tools: the answer, in the template's own call
    format, comes back as `tool_calls`."""
    from app.factory import create_app
    from tests.app.conftest import settings as server_settings
    from tests.app.conftest import start_server

    loaded = dataclasses.replace(smollm2, tokenizer=hermes_tokenizer)
    engine = Engine(EngineConfig(max_rolling_batch_size=2), loaded=loaded)
    engine.start()
    server = start_server(create_app(server_settings(), engine=engine))
    try:
        reply = server.client().chat.completions.create(
            model="", messages=[{"role": "user", "content": "Weather in Rome?"}],
            tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, temperature=0,
            max_tokens=60)
    finally:
        server.stop()
        engine.stop(drain=False)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls[0].function.name == "get_weather"
    assert isinstance(json.loads(choice.message.tool_calls[0].function.arguments)["city"], str)
