import msgspec
import pytest

from adapters.errors import ApiError
from adapters.openai_chat import (
    ChatAssembler,
    ChatChunker,
    build_chat_job,
    check_supported,
    render_prompt,
    template_messages,
)
from adapters.openai_params import ResponseMeta
from adapters.openai_types import ChatCompletionRequest, ChatMessage, ContentPart
from adapters.token_text import TokenText
from engine import JobDelta, TokenLogprob

META = ResponseMeta("chatcmpl-test", 1700000000, "SmolLM2-135M-Instruct", "fp_test")
SYSTEM = "You are a careful assistant who answers in one short sentence, politely and precisely."


def msg(role, content):
    return ChatMessage(role=role, content=content)


def test_developer_is_system_and_text_parts_join():
    out = template_messages([msg("developer", "be brief"),
                             msg("user", [ContentPart(type="text", text="a"),
                                          ContentPart(type="text", text="b")])])
    assert out == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a\nb"}]


@pytest.mark.parametrize(("messages", "param"), [
    ([], "messages"),
    ([msg("user", [ContentPart(type="text", text="a"), ContentPart(type="image_url")])],
     "messages[0].content[1].type"),
    ([msg("wizard", "q")], "messages[0].role"),
    ([msg("user", None)], "messages[0].content"),
    ([ChatMessage(role="assistant", content=None, tool_calls=[{"id": "x"}])],
     "messages[0].tool_calls[0].function"),
    ([ChatMessage(role="assistant", content=None, tool_calls=[
        {"id": "x", "type": "function", "function": {"name": "f", "arguments": "{oops"}}])],
     "messages[0].tool_calls[0].function.arguments"),
    ([ChatMessage(role="user", content="q", tool_calls=[])], "messages[0].tool_calls"),
    ([msg("tool", None)], "messages[0].content"),
])
def test_bad_messages_name_the_parameter(messages, param):
    with pytest.raises(ApiError) as info:
        template_messages(messages)
    assert info.value.status == 400 and info.value.param == param


@pytest.mark.parametrize(("kw", "param"), [
    ({"audio": {"voice": "x"}}, "audio"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"top_logprobs": 2}, "top_logprobs"),
])
def test_unsupported_parameters_are_refused_by_name(kw, param):
    with pytest.raises(ApiError) as info:
        check_supported(ChatCompletionRequest(messages=[msg("user", "q")], **kw))
    assert info.value.status == 400 and info.value.param == param


def test_harmless_values_of_unsupported_parameters_pass():
    check_supported(ChatCompletionRequest(messages=[msg("user", "q")], tools=[],
                                          tool_choice="none", response_format={"type": "text"},
                                          modalities=["text"]))


def test_prompt_is_the_chat_templates_render(tokenizer):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}]
    ids = render_prompt(tokenizer, messages)
    full = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tokenizer.decode(ids) == full
    assert ids == tokenizer.encode(full, add_special_tokens=False)


def test_build_chat_job(tokenizer):
    req = ChatCompletionRequest(messages=[msg("system", SYSTEM), msg("user", "Hi")],
                                max_completion_tokens=5, max_tokens=99, temperature=0)
    spec = build_chat_job(req, tokenizer, 8192)
    assert spec.params.max_new_tokens == 5 and spec.params.strategy == "greedy"
    with pytest.raises(ApiError) as info:
        build_chat_job(ChatCompletionRequest(messages=[msg("user", "Hi")], max_tokens=20),
                       tokenizer, 30)
    assert info.value.code == "context_length_exceeded"


def deltas():
    lp = [TokenLogprob(token_id=28, logprob=-0.5, top=[(28, -0.5), (29, -1.5)])]
    return [
        JobDelta("j", 0, [28], "H", None, lp, 12, 0, 1),
        JobDelta("j", 1, [29], "Y", None, lp, 12, 0, 1),
        JobDelta("j", 0, [30], "i", "stop", lp, 12, 0, 2),
        JobDelta("j", 1, [], "", "length", [], 12, 0, 1),
    ]


def as_json(obj):
    return msgspec.json.decode(msgspec.json.encode(obj))


def test_assembler_response_conforms(tokenizer, schema_errors):
    a = ChatAssembler(META, 2, TokenText(tokenizer), logprobs=True)
    for d in deltas():
        a.add(d)
    body = as_json(a.response())
    assert schema_errors("CreateChatCompletionResponse", body) == []
    assert [c["message"]["content"] for c in body["choices"]] == ["Hi", "Y"]
    assert [c["finish_reason"] for c in body["choices"]] == ["stop", "length"]
    assert body["choices"][0]["message"]["refusal"] is None
    assert len(body["choices"][0]["logprobs"]["content"]) == 2
    assert body["usage"] == {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15,
                             "prompt_tokens_details": {"cached_tokens": 0}}


def test_assembler_without_logprobs_sends_null(tokenizer):
    a = ChatAssembler(META, 1, TokenText(tokenizer), logprobs=False)
    a.add(JobDelta("j", 0, [28], "H", "stop", None, 3, 0, 1))
    assert as_json(a.response())["choices"][0]["logprobs"] is None


def test_chunks_conform_role_first_finish_last_usage_at_end(tokenizer, schema_errors):
    c = ChatChunker(META, 2, TokenText(tokenizer), include_usage=True)
    chunks = [as_json(x) for x in c.start()]
    for d in deltas():
        chunks += [as_json(x) for x in c.on_delta(d)]
    chunks += [as_json(x) for x in c.finish()]
    for chunk in chunks:
        assert schema_errors("CreateChatCompletionStreamResponse", chunk) == [], chunk
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all("usage" in ch for ch in chunks) and chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 3
    assert all(ch["usage"] is None for ch in chunks[:-1])
    finishing = [ch["choices"][0] for ch in chunks if ch["choices"]
                 and ch["choices"][0]["finish_reason"]]
    assert [(f["index"], f["finish_reason"]) for f in finishing] == [(0, "stop"), (1, "length")]
    assert finishing[1]["delta"] == {}


def test_chunks_without_usage_have_no_usage_key(tokenizer):
    c = ChatChunker(META, 1, TokenText(tokenizer), include_usage=False)
    out = [as_json(x) for x in c.on_delta(JobDelta("j", 0, [28], "H", None, None, 3, 0, 1))]
    assert "usage" not in out[0] and c.finish() == []
    # Text held back for a possible stop string produces no chunk at all.
    assert c.on_delta(JobDelta("j", 0, [29], "", None, None, 3, 0, 2)) == []
