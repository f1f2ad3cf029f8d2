"""POST /v1/chat/completions: messages → prompt ids (chat template, system-prompt prefix) and
engine deltas → a response or stream chunks."""

from __future__ import annotations

from adapters.errors import CHAT_NAMES, ApiError
from adapters.limits import MAX_CONTENT_PARTS, MAX_MESSAGES
from adapters.openai_params import (
    JobSpec,
    ResponseMeta,
    max_tokens_for,
    openai_finish_reason,
    sampling_params,
)
from adapters.openai_types import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatResponseMessage,
    ChoiceLogprobs,
    ChunkChoice,
    ChunkDelta,
    TokenLogprobEntry,
    TopLogprob,
    Usage,
)
from adapters.prompt_size import encode_bounded
from adapters.token_text import TokenText
from adapters.usage import UsageCounter
from engine import JobDelta, TokenLogprob

_ROLES = ("system", "developer", "user", "assistant")


def check_supported(req: ChatCompletionRequest) -> None:
    """Refuse, by name, parameters whose meaning we cannot honour (silence would mislead)."""
    if req.tools:
        raise ApiError.unsupported("tools", " (no tool calling)")
    if req.tool_choice not in (None, "none"):
        raise ApiError.unsupported("tool_choice", " (no tool calling)")
    if req.functions:
        raise ApiError.unsupported("functions", " (no function calling)")
    if req.function_call not in (None, "none"):
        raise ApiError.unsupported("function_call", " (no function calling)")
    if req.response_format and req.response_format.get("type", "text") != "text":
        raise ApiError.unsupported("response_format", ' (only {"type": "text"})')
    if req.audio is not None:
        raise ApiError.unsupported("audio")
    if req.modalities and set(req.modalities) != {"text"}:
        raise ApiError.unsupported("modalities", ' (only ["text"])')
    if req.prediction is not None:
        raise ApiError.unsupported("prediction")
    if req.web_search_options is not None:
        raise ApiError.unsupported("web_search_options")
    if req.top_logprobs and not req.logprobs:
        raise ApiError.bad_request("top_logprobs requires logprobs=true", param="top_logprobs")


def template_messages(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """Messages as chat templates take them: text content, `developer` rendered as `system`."""
    if not messages:
        raise ApiError.bad_request("messages must not be empty", param="messages")
    if len(messages) > MAX_MESSAGES:
        raise ApiError.bad_request(f"messages takes at most {MAX_MESSAGES} messages, got "
                                   f"{len(messages)}", param="messages")
    out = []
    for i, m in enumerate(messages):
        if m.role in ("tool", "function"):
            raise ApiError.unsupported(f"messages[{i}].role",
                                       f" (role {m.role!r}: no tool calling)")
        if m.role not in _ROLES:
            raise ApiError.bad_request(f"messages[{i}].role must be one of {', '.join(_ROLES)}, "
                                       f"got {m.role!r}", param=f"messages[{i}].role")
        if m.tool_calls:
            raise ApiError.unsupported(f"messages[{i}].tool_calls", " (no tool calling)")
        if isinstance(m.content, list):
            if len(m.content) > MAX_CONTENT_PARTS:
                raise ApiError.bad_request(f"a message takes at most {MAX_CONTENT_PARTS} content "
                                           f"parts, got {len(m.content)}",
                                           param=f"messages[{i}].content")
            texts = []
            for j, part in enumerate(m.content):
                if part.type != "text" or part.text is None:
                    raise ApiError.unsupported(f"messages[{i}].content[{j}].type",
                                               f" (content part {part.type!r}: text only)")
                texts.append(part.text)
            content = "\n".join(texts)
        elif m.content is None:
            raise ApiError.bad_request(f"messages[{i}].content is required",
                                       param=f"messages[{i}].content",
                                       code="missing_required_parameter")
        else:
            content = m.content
        out.append({"role": "system" if m.role == "developer" else m.role, "content": content})
    return out


def render_prompt(tokenizer, messages: list[dict[str, str]],
                  max_model_len: int | None = None) -> list[int]:
    """Prompt ids for the conversation, as the model's chat template renders it. (The engine's
    prefix cache finds whatever head of them it already holds: no prefix is marked here.)"""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ApiError.bad_request("This model has no chat template; use /v1/completions.",
                                   param="messages", code="chat_template_missing")
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=True)
    except Exception as exc:  # a template's own checks (role order, ...) are the client's error
        raise ApiError.bad_request(f"The chat template rejected the messages: {exc}",
                                   param="messages") from None
    # The template writes the special tokens itself; adding them again would double the BOS.
    if max_model_len is not None:
        return encode_bounded(tokenizer, text, max_model_len, "messages",
                              add_special_tokens=False)
    return tokenizer.encode(text, add_special_tokens=False)


def build_chat_job(req: ChatCompletionRequest, tokenizer, max_model_len: int,
                   max_tokens_limit: int = 0) -> JobSpec:
    """Translate a chat request into one engine job; raises ApiError before any submission."""
    check_supported(req)
    prompt_ids = render_prompt(tokenizer, template_messages(req.messages), max_model_len)
    # ChatOpenAI sends max_completion_tokens, older clients max_tokens; the newer name wins.
    if req.max_completion_tokens is not None:
        requested, param = req.max_completion_tokens, "max_completion_tokens"
    else:
        requested, param = req.max_tokens, "max_tokens"
    budget = max_tokens_for(requested, len(prompt_ids), max_model_len, param, CHAT_NAMES,
                            max_tokens_limit)
    params = sampling_params(req, CHAT_NAMES, max_tokens=budget, logprobs=bool(req.logprobs),
                             top_logprobs=req.top_logprobs or 0)
    return JobSpec(prompt_ids, params)


def chat_logprobs(logprobs: list[TokenLogprob], token_text: TokenText) -> list[TokenLogprobEntry]:
    entries = []
    for lp in logprobs:
        text, raw = token_text(lp.token_id)
        top = [TopLogprob(token_text(t)[0], v, token_text(t)[1]) for t, v in lp.top]
        entries.append(TokenLogprobEntry(text, lp.logprob, raw, top))
    return entries


class ChatAssembler:
    """Collects a job's deltas into the non-streaming chat response."""

    def __init__(self, meta: ResponseMeta, n: int, token_text: TokenText, logprobs: bool):
        self.meta, self.token_text, self.want_logprobs = meta, token_text, logprobs
        self.texts: list[list[str]] = [[] for _ in range(n)]
        self.logprobs: list[list[TokenLogprobEntry]] = [[] for _ in range(n)]
        self.finish: list[str | None] = [None] * n
        self.usage = UsageCounter()

    def add(self, delta: JobDelta) -> None:
        self.usage.add(delta)
        self.texts[delta.index].append(delta.text)
        if delta.logprobs:
            self.logprobs[delta.index].extend(chat_logprobs(delta.logprobs, self.token_text))
        if delta.finish_reason is not None:
            self.finish[delta.index] = openai_finish_reason(delta.finish_reason)

    def response(self) -> ChatCompletionResponse:
        choices = [
            ChatChoice(
                index=i,
                message=ChatResponseMessage(role="assistant", content="".join(self.texts[i])),
                logprobs=ChoiceLogprobs(content=self.logprobs[i]) if self.want_logprobs else None,
                finish_reason=self.finish[i] or "stop",
            )
            for i in range(len(self.texts))
        ]
        m = self.meta
        return ChatCompletionResponse(id=m.id, created=m.created, model=m.model, choices=choices,
                                      usage=self.usage.total(),
                                      system_fingerprint=m.system_fingerprint)


class ChatChunker:
    """Turns a job's deltas into stream chunks: role first, text deltas, finish, then usage."""

    def __init__(self, meta: ResponseMeta, n: int, token_text: TokenText, include_usage: bool):
        self.meta, self.n, self.token_text = meta, n, token_text
        self.include_usage = include_usage
        self.usage = UsageCounter()

    def _chunk(self, choices: list[ChunkChoice], usage: Usage | None = None) -> ChatCompletionChunk:
        m = self.meta
        chunk = ChatCompletionChunk(id=m.id, created=m.created, model=m.model, choices=choices,
                                    system_fingerprint=m.system_fingerprint)
        if self.include_usage:
            chunk.usage = usage
        return chunk

    def start(self) -> list[ChatCompletionChunk]:
        return [self._chunk([ChunkChoice(i, ChunkDelta(role="assistant", content=""))])
                for i in range(self.n)]

    def on_delta(self, delta: JobDelta) -> list[ChatCompletionChunk]:
        self.usage.add(delta)
        finish = openai_finish_reason(delta.finish_reason)
        logprobs = (ChoiceLogprobs(content=chat_logprobs(delta.logprobs, self.token_text))
                    if delta.logprobs else None)
        if not delta.text and logprobs is None and finish is None:
            return []  # nothing the client can see (e.g. text held back for a stop string)
        body = ChunkDelta(content=delta.text) if delta.text or logprobs else ChunkDelta()
        return [self._chunk([ChunkChoice(delta.index, body, logprobs, finish)])]

    def finish(self) -> list[ChatCompletionChunk]:
        return [self._chunk([], self.usage.total())] if self.include_usage else []
