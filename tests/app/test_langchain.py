"""LangChain's ChatOpenAI and OpenAI (completions) against the live server."""

from __future__ import annotations

import pytest
from langchain_openai import ChatOpenAI, OpenAI
from langchain_openai.chat_models.base import OpenAIContextOverflowError

pytestmark = pytest.mark.slow  # a live server with the real model


@pytest.fixture
def chat_model(live_server) -> ChatOpenAI:
    return ChatOpenAI(base_url=live_server.base_url, api_key="unused", model="",
                      temperature=0, max_tokens=10, max_retries=0, timeout=60)


def test_invoke_stream_batch_agree(chat_model, live_server):
    question = "Name a fruit."
    answer = chat_model.invoke(question)
    assert answer.content and answer.response_metadata["finish_reason"] in ("stop", "length")
    assert answer.usage_metadata["output_tokens"] >= 1
    streamed = "".join(chunk.content for chunk in chat_model.stream(question))
    assert streamed == answer.content
    batch = chat_model.batch([question, "Name a color."])
    assert batch[0].content == answer.content and batch[1].content


def test_system_message_and_default_sampling(live_server):
    model = ChatOpenAI(base_url=live_server.base_url, api_key="unused", model="",
                       max_tokens=6, max_retries=0, timeout=60)
    reply = model.invoke([("system", "You answer in French."), ("human", "Hello!")])
    assert isinstance(reply.content, str) and reply.content


def test_context_overflow_is_recognised(live_server):
    model = ChatOpenAI(base_url=live_server.base_url, api_key="unused", model="",
                       max_tokens=9000, max_retries=0, timeout=60)
    with pytest.raises(OpenAIContextOverflowError):
        model.invoke("hi")


def test_legacy_completions_llm(live_server):
    llm = OpenAI(base_url=live_server.base_url, api_key="unused", model="",
                 temperature=0, max_tokens=6, max_retries=0, timeout=60)
    text = llm.invoke("The capital of France is")
    direct = live_server.client().completions.create(model="", prompt="The capital of France is",
                                                      max_tokens=6, temperature=0)
    assert text == direct.choices[0].text
    results = llm.generate(["One, two,", "Red, green,"])
    assert len(results.generations) == 2 and all(g[0].text for g in results.generations)
