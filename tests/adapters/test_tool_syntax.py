"""The native call syntaxes of Llama 3.1+ and Mistral beside Hermes's: detection from the chat
template, the call grammars, whole and streamed parsing, the history as each template takes it,
and each end to end on a live server. The templates are written for these tests, after the
families' own (their tool parts kept, the rest cut)."""

from __future__ import annotations

import copy
import dataclasses
import json
import re

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken

from adapters.openai_chat import build_chat_job
from adapters.openai_types import ChatCompletionRequest
from adapters.tool_syntax import HERMES, LLAMA3, ToolStreamParser, mistral
from adapters.tools import native_call_id, tool_format, tool_grammar, tool_plan
from engine import Engine, EngineConfig
from engine.sample.grammar import Grammar, GrammarCompiler
from tests.adapters.test_tools import ANSWERS as HERMES_ANSWERS
from tests.adapters.test_tools import HERMES as HERMES_TEMPLATE
from tests.adapters.test_tools import HISTORY, WEATHER, accepts

# Llama 3.1's tool part: tools in the first user turn, a call as the whole assistant turn in
# `{"name": …, "parameters": …}`, one call per turn, results in the `ipython` role.
LLAMA3_TEMPLATE = """\
{%- if messages[0].role == 'system' %}{%- set system_message = messages[0].content %}\
{%- set messages = messages[1:] %}{%- else %}{%- set system_message = "" %}{%- endif %}\
<|start_header_id|>system<|end_header_id|>

{% if tools is not none %}Environment: ipython
{% endif %}{{ system_message }}<|eot_id|>
{%- if tools is not none %}{%- set first = messages[0].content %}{%- set messages = messages[1:] %}\
<|start_header_id|>user<|end_header_id|>

Given the following functions, please respond with a JSON for a function call with its proper \
arguments that best answers the given prompt.

Respond in the format {"name": function name, "parameters": dictionary of argument name and its \
value}.Do not use variables.

{% for t in tools %}{{ t | tojson(indent=4) }}

{% endfor %}{{ first }}<|eot_id|>
{%- endif %}
{%- for message in messages %}
{%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}\
<|start_header_id|>{{ message.role }}<|end_header_id|>

{{ message.content | trim }}<|eot_id|>
{%- elif 'tool_calls' in message %}
{%- if not message.tool_calls | length == 1 %}\
{{ raise_exception("This model only supports single tool-calls at once!") }}{%- endif %}
{%- set tool_call = message.tool_calls[0].function %}<|start_header_id|>assistant<|end_header_id|>

{{ '{"name": "' + tool_call.name + '", ' }}{{ '"parameters": ' }}\
{{ tool_call.arguments | tojson }}{{ "}" }}<|eot_id|>
{%- else %}<|start_header_id|>ipython<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

# Mistral 7B v0.3's: tools before the last user turn, calls after [TOOL_CALLS] as a JSON array,
# call ids of exactly 9 letters or digits (the template refuses others), results by call id.
MISTRAL_TEMPLATE = """\
{%- set user_messages = messages | selectattr('role', 'equalto', 'user') | list %}
{%- for message in messages %}
{%- if message.role == 'user' %}
{%- if tools is not none and message == user_messages[-1] %}[AVAILABLE_TOOLS] [\
{%- for tool in tools %}{{ tool | tojson }}{% if not loop.last %}, {% endif %}{% endfor %}\
][/AVAILABLE_TOOLS]{% endif %}[INST] {{ message.content }}[/INST]
{%- elif message.tool_calls is defined and message.tool_calls is not none %}[TOOL_CALLS] [
{%- for tool_call in message.tool_calls %}{%- set out = tool_call.function | tojson %}\
{{ out[:-1] }}{%- if tool_call.id is not defined or tool_call.id | length != 9 %}\
{{ raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}{% endif %}\
, "id": "{{ tool_call.id }}"}{% if not loop.last %}, {% endif %}
{%- endfor %}]</s>
{%- elif message.role == 'assistant' %} {{ message.content }}</s>
{%- elif message.role == 'tool' %}
{%- if message.tool_call_id | length != 9 %}\
{{ raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}{% endif %}\
[TOOL_RESULTS] {"content": {{ message.content | tojson }}, "call_id": \
"{{ message.tool_call_id }}"}[/TOOL_RESULTS]
{%- endif %}
{%- endfor %}"""

TEMPLATES = {"hermes": HERMES_TEMPLATE, "llama3": LLAMA3_TEMPLATE, "mistral": MISTRAL_TEMPLATE}
SUM = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                   "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}


def with_template(tokenizer, template: str):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = template
    return tok


@pytest.fixture(scope="module")
def special_tokenizer(tokenizer):
    """SmolLM2's tokenizer with `[TOOL_CALLS]` as one special token, as Mistral's have it."""
    tok = with_template(tokenizer, MISTRAL_TEMPLATE)
    tok.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    return tok


def plan(tools, choice, syntax, parallel=None):
    return dataclasses.replace(tool_plan(tools, choice, parallel, None, None), syntax=syntax)


def test_the_family_is_read_from_the_template(tokenizer):
    found = {name: tool_format(with_template(tokenizer, t)) for name, t in TEMPLATES.items()}
    assert found == {"hermes": "hermes", "llama3": "llama3", "mistral": "mistral"}
    later_mistral = MISTRAL_TEMPLATE.replace("[TOOL_CALLS] [", "[TOOL_CALLS]{{ x }}[ARGS][")
    assert tool_format(with_template(tokenizer, later_mistral)) == "generic"  # not built


# -- grammars ---------------------------------------------------------------------------------

ROME = {"city": "Rome"}


def test_llama3_grammar(compiler):
    call = json.dumps({"name": "get_weather", "parameters": ROME})
    auto = tool_grammar(plan([WEATHER, SUM], "auto", LLAMA3), None)
    assert accepts(compiler, auto, call) and accepts(compiler, auto, "It is sunny.")
    assert accepts(compiler, auto, json.dumps({"name": "add", "parameters": {"a": 1, "b": 2}}))
    assert not accepts(compiler, auto, json.dumps({"name": "get_weather", "arguments": ROME}))
    assert not accepts(compiler, auto, '{"weather": "sunny"}')  # a text may not open like a call
    required = tool_grammar(plan([WEATHER], "required", LLAMA3), None)
    assert not accepts(compiler, required, "It is sunny.")
    assert not accepts(compiler, required, call + "; " + call)  # one call per answer
    answer = tool_grammar(plan([WEATHER], "auto", LLAMA3), {
        "type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]})
    assert accepts(compiler, answer, '{"answer": "sunny"}') and accepts(compiler, answer, call)


def test_mistral_grammar_in_text(compiler, tokenizer):
    syntax = mistral(tokenizer)
    assert not syntax.special  # SmolLM2 has no such token: the grammar spells it
    one = {"name": "get_weather", "arguments": ROME}
    calls = "[TOOL_CALLS] " + json.dumps([one, one])
    auto = tool_grammar(plan([WEATHER], "auto", syntax), None)
    assert accepts(compiler, auto, calls) and accepts(compiler, auto, "It is sunny.")
    assert not accepts(compiler, auto, "[TOOL_CALLS] sunny")
    single = tool_grammar(plan([WEATHER], "required", syntax, parallel=False), None)
    assert accepts(compiler, single, "[TOOL_CALLS] " + json.dumps([one]))
    assert not accepts(compiler, single, calls)


def test_mistral_grammar_writes_the_special_token(special_tokenizer):
    syntax = mistral(special_tokenizer)
    marker = special_tokenizer.convert_tokens_to_ids("[TOOL_CALLS]")
    assert syntax.special and syntax.marker_lark == f"<[{marker}]>"
    compiler = GrammarCompiler(special_tokenizer, len(special_tokenizer), [2])
    calls = "[TOOL_CALLS] " + json.dumps([{"name": "get_weather", "arguments": ROME}])
    assert special_tokenizer.encode(calls, add_special_tokens=False)[0] == marker
    required = tool_grammar(plan([WEATHER], "required", syntax), None)
    assert accepts(compiler, required, calls)
    matcher = compiler.compile(Grammar.lark(required)).matcher()
    spelled = special_tokenizer.encode("[TOOL", add_special_tokens=False)  # not the token
    assert matcher.validate_tokens(spelled) == 0
    auto = tool_grammar(plan([WEATHER], "auto", syntax), None)
    assert accepts(compiler, auto, "It is sunny.") and accepts(compiler, auto, calls)


def test_a_token_flagged_special_only_where_it_is_added_counts(tokenizer):
    """Some tokenizers flag `[TOOL_CALLS]` special in their added tokens without listing it
    among the special tokens; decoding skips it all the same, so the grammar writes it too."""
    tok = with_template(tokenizer, MISTRAL_TEMPLATE)
    tok.add_tokens([AddedToken("[TOOL_CALLS]", special=True)])
    marker = tok.convert_tokens_to_ids("[TOOL_CALLS]")
    assert marker not in tok.all_special_ids
    assert tok.decode([marker], skip_special_tokens=True) == ""
    assert mistral(tok).special


def test_the_special_opener_is_kept_in_the_answer_text(special_tokenizer):
    req = ChatCompletionRequest(messages=HISTORY[:1], tools=[WEATHER], tool_choice="required")
    special_compiler = GrammarCompiler(special_tokenizer, len(special_tokenizer), [2])
    spec = build_chat_job(req, special_tokenizer, 8192, grammars=special_compiler)
    assert spec.tools.syntax.special and spec.params.skip_special_tokens is False


# -- parsing ----------------------------------------------------------------------------------

def _llama(name, args):
    return json.dumps({"name": name, "parameters": args})


LLAMA3_ANSWERS = [_llama("get_weather", ROME), "  " + _llama("f", {"k": [1]}),
                  '{"answer": "sunny"}', '{"name": "Paris", "country": "France"}',
                  "Plain {braces} text.", "  ", "{", '{"name": "get_w',
                  "Sure: " + _llama("f", {})]
MISTRAL_ANSWERS = ["[TOOL_CALLS] " + json.dumps([{"name": "a", "arguments": {"x": "]"}},
                                                 {"name": "b", "arguments": {}}]),
                   "It is [TOOL_CALLS] sunny.", "[TOOL", "[TOOL_CALLS] [{\"name\": \"a\"",
                   "Let me see. [TOOL_CALLS] [{\"name\": \"a\", \"arguments\": {}}]"]


@pytest.mark.parametrize(("syntax", "answer", "content", "calls"), [
    (LLAMA3, LLAMA3_ANSWERS[0], None, [("get_weather", ROME)]),
    (LLAMA3, LLAMA3_ANSWERS[1], None, [("f", {"k": [1]})]),
    (LLAMA3, LLAMA3_ANSWERS[2], LLAMA3_ANSWERS[2], []),
    (LLAMA3, LLAMA3_ANSWERS[3], LLAMA3_ANSWERS[3], []),  # no arguments key: an answer
    (LLAMA3, "Sure: " + LLAMA3_ANSWERS[0], "Sure: " + LLAMA3_ANSWERS[0], []),  # calls open it
    (LLAMA3, LLAMA3_ANSWERS[7], LLAMA3_ANSWERS[7], []),  # cut by max_tokens
    (mistral(None), MISTRAL_ANSWERS[0], None, [("a", {"x": "]"}), ("b", {})]),
    (mistral(None), MISTRAL_ANSWERS[4], MISTRAL_ANSWERS[4], []),  # calls open the answer
    (mistral(None), MISTRAL_ANSWERS[3], MISTRAL_ANSWERS[3], []),
])
def test_whole_answers(syntax, answer, content, calls):
    got_content, got = syntax.parse(answer)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls


@settings(max_examples=120, deadline=None)
@given(st.sampled_from([(LLAMA3, a) for a in LLAMA3_ANSWERS]
                       + [(mistral(None), a) for a in MISTRAL_ANSWERS]
                       + [(HERMES, a) for a in HERMES_ANSWERS]),
       st.lists(st.integers(0, 200), max_size=8))
@example((mistral(None), MISTRAL_ANSWERS[0]), [len(MISTRAL_ANSWERS[0]) - 1])  # "]" alone last
def test_streams_carry_what_the_whole_answer_holds(case, cuts):
    """However the answer is cut into deltas, the stream carries what the whole answer holds."""
    syntax, answer = case
    bounds = sorted({min(c, len(answer)) for c in cuts} | {0, len(answer)})
    parser, text, calls = ToolStreamParser(syntax), "", []
    for a, b in zip(bounds, bounds[1:]):
        t, c = parser.feed(answer[a:b])
        text, calls = text + t, calls + c
    text += parser.finish()
    content, expected = syntax.parse(answer)
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in expected]
    if not expected:
        assert text == answer
    elif content is None:
        assert text == ""


def test_mistral_without_a_tokenizer_is_text():
    assert mistral(None).marker_lark == '"[TOOL_CALLS]"'


# -- history ----------------------------------------------------------------------------------

def test_llama3_history(tokenizer, compiler):
    tok = with_template(tokenizer, LLAMA3_TEMPLATE)
    req = ChatCompletionRequest(messages=HISTORY, tools=[WEATHER], max_tokens=8)
    text = tok.decode(build_chat_job(req, tok, 8192, grammars=compiler).prompt_ids)
    assert '"name": "get_weather"' in text and "Environment: ipython" in text
    assert '{"name": "get_weather", "parameters": {"city": "Rome"}}' in text
    assert "<|start_header_id|>ipython<|end_header_id|>\n\nsunny, 24 C" in text


def test_mistral_history_maps_call_ids(tokenizer, compiler):
    tok = with_template(tokenizer, MISTRAL_TEMPLATE)
    req = ChatCompletionRequest(messages=HISTORY, tools=[WEATHER], max_tokens=8)
    text = tok.decode(build_chat_job(req, tok, 8192, grammars=compiler).prompt_ids)
    short = native_call_id("call_1", "mistral")
    assert re.fullmatch(r"[0-9a-f]{9}", short) and native_call_id("abcDEF123", "mistral") == \
        "abcDEF123" and native_call_id("call_1", "hermes") == "call_1"
    assert f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {{"city": "Rome"}}, "id": ' \
           f'"{short}"}}]' in text
    assert f'[TOOL_RESULTS] {{"content": "sunny, 24 C", "call_id": "{short}"}}' in text
    assert text.index("[AVAILABLE_TOOLS]") < text.index("[INST] Weather in Rome?")


# -- live -------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama3", "mistral"])
def test_native_calls_on_a_live_server(smollm2, family, schema_errors):
    """The embedded model behind each family's template: forced calls come back as
    `tool_calls`, whole and streamed, and a second turn with the results renders."""
    from app.factory import create_app
    from tests.app.conftest import settings as server_settings
    from tests.app.conftest import start_server

    tok = with_template(smollm2.tokenizer, TEMPLATES[family])
    engine = Engine(EngineConfig(max_rolling_batch_size=2),
                    loaded=dataclasses.replace(smollm2, tokenizer=tok))
    engine.start()
    server = start_server(create_app(server_settings(), engine=engine))
    ask = dict(model="", messages=[{"role": "user", "content": "Weather in Rome?"}],
               tools=[WEATHER], tool_choice="required", temperature=0, max_tokens=60)
    try:
        client = server.client()
        reply = client.chat.completions.create(**ask)
        streamed = {}
        for chunk in client.chat.completions.create(**ask, stream=True):
            for call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                streamed.setdefault(call.index, []).append(call.function.arguments or "")
        call = reply.choices[0].message.tool_calls[0]
        again = client.chat.completions.create(**{**ask, "tool_choice": "auto", "messages": [
            *ask["messages"], reply.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "sunny"}], "max_tokens": 4})
    finally:
        server.stop()
        engine.stop(drain=False)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments)["city"], str)
    assert ["".join(parts) for parts in streamed.values()][0] == call.function.arguments
    assert not schema_errors("CreateChatCompletionResponse", reply.model_dump(exclude_unset=True))
    assert again.choices[0].finish_reason in ("length", "stop", "tool_calls")
