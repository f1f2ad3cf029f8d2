"""Reasoning split from the answer, whole and streamed at any chunk boundary (no model)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from adapters.reasoning import OPEN, ReasoningSplitter, parser_name, starts_inside


def split(text: str, inside: bool = False) -> tuple[str | None, str]:
    """(reasoning, content) of a whole output, fed at once; reasoning None where it did not
    think."""
    reasoning, content = ReasoningSplitter.starting(inside).feed(text, last=True)
    return (reasoning if inside or text.lstrip().startswith(OPEN) else None), content


@pytest.mark.parametrize(("text", "inside", "want"), [
    ("<think>Paris is in France.</think>\n\nParis.", False, ("Paris is in France.", "Paris.")),
    ("  <think>a</think>b", False, ("a", "b")),
    ("No thinking here.", False, (None, "No thinking here.")),
    ("The tag <think> later is content.", False, (None, "The tag <think> later is content.")),
    ("still thinking</think>\nAnswer", True, ("still thinking", "Answer")),
    ("<think>cut short", False, ("cut short", "")),
    ("<thi", False, (None, "<thi")),
])
def test_whole_outputs(text, inside, want):
    assert split(text, inside) == want


def _streamed(text: str, cuts: list[int], inside: bool) -> tuple[str, str]:
    s = ReasoningSplitter.starting(inside)
    reasoning, content, last = [], [], 0
    ends = sorted({min(c, len(text)) for c in cuts} - {len(text)}) + [len(text)]
    for cut in ends:
        r, c = s.feed(text[last:cut], last=cut == ends[-1])
        reasoning.append(r)
        content.append(c)
        last = cut
    return "".join(reasoning), "".join(content)


pieces = st.lists(st.sampled_from(["<think>", "</think>", "<", "</", "think", ">", "a", " ", "\n",
                                   "Paris", "é"]), max_size=12).map("".join)


@given(think=pieces, answer=pieces, opened=st.booleans(), inside=st.booleans(),
       cuts=st.lists(st.integers(0, 60), max_size=8))
def test_any_chunking_splits_as_the_whole(think, answer, opened, inside, cuts):
    text = (("<think>" if opened and not inside else "") + think.replace("</think>", "") +
            ("</think>" if opened or inside else "") + answer)
    reasoning, content = split(text, inside)
    assert _streamed(text, cuts, inside) == (reasoning or "", content)


def test_the_parser_comes_from_the_template_or_the_setting():
    assert parser_name(None, "{{ '<think>' }}") == "think"
    assert parser_name("auto", "plain template") == "none"
    assert parser_name("qwen3", None) == "think" and parser_name("none", "<think>") == "none"
    with pytest.raises(ValueError):
        parser_name("nonsense", None)
    assert starts_inside("<|im_start|>assistant\n<think>\n")
    assert not starts_inside("<|im_start|>assistant\n<think>\n\n</think>\n\n")


# A chat template in the style of Qwen3's: it knows <think>, and `enable_thinking: false` closes
# an empty think block in the generation prompt. DEEPSEEK_R1_LIKE opens one instead.
QWEN3_LIKE = (
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}")
DEEPSEEK_R1_LIKE = (
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}"
    "{%- endif %}")


def _job(tokenizer, template, **fields):
    import copy

    from adapters.openai_chat import build_chat_job
    from adapters.openai_types import ChatCompletionRequest, ChatMessage

    tok = copy.copy(tokenizer)
    tok.chat_template = template
    req = ChatCompletionRequest(messages=[ChatMessage(role="user", content="Hi")], max_tokens=8,
                                **fields)
    return build_chat_job(req, tok, 2048, reasoning_parser=parser_name("auto", template)), tok


def test_the_template_and_its_variables_decide_where_the_output_starts(tokenizer):
    spec, tok = _job(tokenizer, QWEN3_LIKE)
    assert spec.thinks is False  # it may open a think block itself
    off, tok = _job(tokenizer, QWEN3_LIKE, chat_template_kwargs={"enable_thinking": False})
    assert tok.decode(off.prompt_ids).endswith("<think>\n\n</think>\n\n") and off.thinks is False
    opened, _ = _job(tokenizer, DEEPSEEK_R1_LIKE)
    assert opened.thinks is True
    plain, _ = _job(tokenizer, tokenizer.chat_template)
    assert plain.thinks is None  # SmolLM2's template does not think: no parser


def test_chat_template_kwargs_may_not_replace_the_call(tokenizer):
    from adapters.errors import ApiError

    with pytest.raises(ApiError) as info:
        _job(tokenizer, QWEN3_LIKE, chat_template_kwargs={"tools": []})
    assert info.value.param == "chat_template_kwargs"


def test_the_answer_carries_the_thinking_apart(tokenizer):
    from adapters.openai_chat import ChatAssembler, ChatChunker
    from adapters.openai_params import ResponseMeta
    from adapters.token_text import TokenText
    from engine import JobDelta

    meta = ResponseMeta("chatcmpl-t", 1, "m", "fp")
    deltas = [JobDelta("j", 0, [1], "<thi", None, None, 3, 0, 1),
              JobDelta("j", 0, [2], "nk>It is", None, None, 3, 0, 2),
              JobDelta("j", 0, [3], " Paris.</think>\n\nParis", None, None, 3, 0, 3),
              JobDelta("j", 0, [4], ".", "stop", None, 3, 0, 4)]
    whole = ChatAssembler(meta, 1, TokenText(tokenizer), False, thinks=False)
    chunks = ChatChunker(meta, 1, TokenText(tokenizer), True, thinks=False)
    streamed = []
    for d in deltas:
        whole.add(d)
        streamed += [c.choices[0].delta for c in chunks.on_delta(d) if c.choices]
    message = whole.response().choices[0].message
    assert (message.reasoning_content, message.reasoning, message.content) == (
        "It is Paris.", "It is Paris.", "Paris.")
    assert whole.response().usage.completion_tokens_details.reasoning_tokens == 3
    reasoning = "".join(d.reasoning_content for d in streamed if isinstance(
        d.reasoning_content, str))
    content = "".join(d.content for d in streamed if isinstance(d.content, str))
    assert (reasoning, content) == ("It is Paris.", "Paris.")
    first_content = next(i for i, d in enumerate(streamed) if isinstance(d.content, str)
                         and d.content)
    assert all(not isinstance(d.reasoning_content, str) for d in streamed[first_content:])
    assert chunks.finish()[0].usage.completion_tokens_details.reasoning_tokens == 3


@pytest.mark.parametrize("opened", [False, True])
def test_a_grammar_starts_after_the_think_block(tokenizer, opened):
    """One grammar: free thinking up to the first </think>, then the answer's own grammar (a
    schema, a regex, a choice, a Lark grammar); the block optional unless the prompt opened it."""
    import llguidance.hf
    from llguidance import LLMatcher

    from engine.sample.grammar import Grammar

    vocab = llguidance.hf.from_tokenizer(tokenizer)

    def accepts(grammar: Grammar, text: str) -> bool:
        m = LLMatcher(vocab, grammar.llguidance_text())
        ok = m.consume_tokens(tokenizer.encode(text, add_special_tokens=False))
        return bool(ok) and m.is_accepting()

    for answer, text in [(Grammar.json_schema({"type": "object"}), '{"k": 1}'),
                         (Grammar.regex("[A-Z][a-z]+\\."), "Paris."),
                         (Grammar.choice(["yes", "no"]), "yes"),
                         (Grammar.lark('start: "a" B\nB: /[0-9]+/'), "a12")]:
        wrapped = Grammar.after_thinking(answer, opened)
        head = "" if opened else "<think>"
        assert accepts(wrapped, f"{head}Let me see.</think>\n\n{text}"), answer.kind
        assert not accepts(wrapped, f"{head}a</think> b</think>{text}")  # one block only
        assert accepts(wrapped, text) != opened  # without thinking: only where none is open
