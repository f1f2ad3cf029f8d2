"""POST /v1/chat/completions: messages → prompt ids (chat template, system-prompt prefix) and
engine deltas → a response or stream chunks."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

from adapters.errors import CHAT_NAMES, ApiError, ParamNames
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
    FunctionCall,
    TokenLogprobEntry,
    ToolCall,
    ToolCallDelta,
    TopLogprob,
    Usage,
)
from adapters.prompt_size import encode_bounded
from adapters.reasoning import ReasoningSplitter, parser_name, starts_inside
from adapters.schema_budget import within_budget
from adapters.schema_prompt import carried, instruction
from adapters.structured import (
    compile_grammar,
    compile_requested,
    guided_grammar,
    response_schema,
)
from adapters.token_text import TokenText
from adapters.tool_syntax import ToolStreamParser
from adapters.tools import (
    ToolPlan,
    call_block,
    native_call_id,
    tool_format,
    tool_grammar,
    tool_plan,
    tool_syntax,
    with_tool_prompt,
)
from adapters.usage import UsageCounter
from engine import JobDelta, TokenLogprob
from engine.sample.grammar import CompiledGrammar, Grammar, GrammarCompiler

_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


def check_supported(req: ChatCompletionRequest) -> None:
    """Refuse, by name, parameters whose meaning we cannot honour (silence would mislead)."""
    if req.audio is not None:
        raise ApiError.unsupported("audio")
    if req.modalities and set(req.modalities) != {"text"}:
        raise ApiError.unsupported("modalities", ' (only ["text"])')
    if req.prediction is not None:
        raise ApiError.unsupported("prediction")
    if req.web_search_options is not None:
        raise ApiError.unsupported("web_search_options")
    if req.echo:
        raise ApiError.unsupported("echo", " on chat (/v1/completions echoes the prompt, with "
                                   "its log-probabilities under logprobs)")
    if req.top_logprobs and not req.logprobs:
        raise ApiError.bad_request("top_logprobs requires logprobs=true", param="top_logprobs")


def _text(m: ChatMessage, where: str, required: bool = True) -> str | None:
    """A message's content as text (text parts joined)."""
    if isinstance(m.content, list):
        if len(m.content) > MAX_CONTENT_PARTS:
            raise ApiError.bad_request(f"a message takes at most {MAX_CONTENT_PARTS} content "
                                       f"parts, got {len(m.content)}", param=f"{where}.content")
        texts = []
        for j, part in enumerate(m.content):
            if part.type != "text" or part.text is None:
                raise ApiError.unsupported(f"{where}.content[{j}].type",
                                           f" (content part {part.type!r}: text only)")
            texts.append(part.text)
        return "\n".join(texts)
    if m.content is None and required:
        raise ApiError.bad_request(f"{where}.content is required", param=f"{where}.content",
                                   code="missing_required_parameter")
    return m.content


def _calls(m: ChatMessage, where: str) -> list[tuple[str, str, Any]]:
    """An assistant message's calls (tool_calls, or the legacy function_call) as (id, name,
    arguments parsed from their JSON text); a 400 naming the call when one is malformed."""
    if m.tool_calls is not None and m.function_call is not None:
        raise ApiError.bad_request(f"{where} has both tool_calls and function_call",
                                   param=f"{where}.function_call")
    items = m.tool_calls if m.tool_calls is not None else (
        [{"id": "", "type": "function", "function": m.function_call}]
        if m.function_call is not None else [])
    out = []
    for j, call in enumerate(items):
        at = f"{where}.tool_calls[{j}]" if m.tool_calls is not None else f"{where}.function_call"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ApiError.bad_request(f"{at} must be a function call with a name",
                                       param=at if m.tool_calls is None else f"{at}.function")
        if m.tool_calls is not None and call.get("type", "function") != "function":
            raise ApiError.bad_request(f"{at}.type must be 'function'", param=f"{at}.type")
        args = fn.get("arguments", "{}")
        try:
            parsed = json.loads(args) if isinstance(args, str) else None
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):
            param = f"{at}.function.arguments" if m.tool_calls is not None else f"{at}.arguments"
            raise ApiError.bad_request(f"{param} must be a JSON object in a string, got "
                                       f"{str(args)[:80]!r}", param=param)
        out.append((str(call.get("id") or ""), fn["name"], parsed))
    return out


def template_messages(messages: list[ChatMessage], tools: str = "generic"
                      ) -> list[dict[str, Any]]:
    """Messages as chat templates take them: text content, `developer` rendered as `system`,
    and tool traffic as the tool format says (adapters/tools.py): a native format passes
    assistant calls and `tool` messages to the template; `generic` writes calls as their blocks
    and tool results as user messages."""
    if not messages:
        raise ApiError.bad_request("messages must not be empty", param="messages")
    if len(messages) > MAX_MESSAGES:
        raise ApiError.bad_request(f"messages takes at most {MAX_MESSAGES} messages, got "
                                   f"{len(messages)}", param="messages")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if m.role not in _ROLES:
            raise ApiError.bad_request(f"{where}.role must be one of {', '.join(_ROLES)}, "
                                       f"got {m.role!r}", param=f"{where}.role")
        if m.role in ("tool", "function"):
            content = _text(m, where)
            if tools != "generic":
                out.append({"role": "tool", "content": content, "name": m.name or "",
                            "tool_call_id": native_call_id(m.tool_call_id or "", tools)})
                continue
            block = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("tool_responses"):  # results of one turn's calls together
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "tool_responses": True})
            continue
        if m.role != "assistant" and (m.tool_calls is not None or m.function_call is not None):
            raise ApiError.bad_request(f"only assistant messages carry tool calls, not "
                                       f"{m.role!r}", param=f"{where}.tool_calls")
        calls = _calls(m, where) if m.role == "assistant" else []
        content = _text(m, where, required=not calls) or ""
        if calls and tools != "generic":
            out.append({"role": "assistant", "content": content, "tool_calls": [
                {"id": native_call_id(cid, tools), "type": "function",
                 "function": {"name": name, "arguments": args}} for cid, name, args in calls]})
            continue
        if calls:
            blocks = "\n".join(call_block(name, args) for _, name, args in calls)
            content = f"{content}\n{blocks}" if content else blocks
        out.append({"role": "system" if m.role == "developer" else m.role, "content": content})
    for msg in out:
        msg.pop("tool_responses", None)
    return out


# What a chat template is called with; chat_template_kwargs may not replace them.
_TEMPLATE_ARGUMENTS = frozenset({"conversation", "messages", "tools", "tokenize",
                                 "add_generation_prompt", "documents", "chat_template",
                                 "continue_final_message", "return_dict"})


def template_kwargs(req: ChatCompletionRequest) -> dict[str, Any]:
    """The request's own chat-template variables (`chat_template_kwargs`, `reasoning_effort`)."""
    extra = dict(req.chat_template_kwargs or {})
    if taken := sorted(_TEMPLATE_ARGUMENTS & extra.keys()):
        raise ApiError.bad_request(f"chat_template_kwargs may not set {', '.join(taken)}",
                                   param="chat_template_kwargs")
    if req.reasoning_effort is not None:
        extra.setdefault("reasoning_effort", req.reasoning_effort)
    return extra


def render_prompt(tokenizer, messages: list[dict[str, Any]],
                  max_model_len: int | None = None,
                  tools: list[dict[str, Any]] | None = None,
                  variables: dict[str, Any] | None = None) -> list[int]:
    """Prompt ids for the conversation, as the model's chat template renders it (with `tools`
    for a template that renders them, and the request's `variables`). The engine's prefix cache
    finds whatever head of them it already holds: no prefix is marked here."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ApiError.bad_request("This model has no chat template; use /v1/completions.",
                                   param="messages", code="chat_template_missing")
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                             add_generation_prompt=True, **(variables or {}))
    except Exception as exc:  # a template's own checks (role order, ...) are the client's error
        raise ApiError.bad_request(f"The chat template rejected the messages: {exc}",
                                   param="messages") from None
    # The template writes the special tokens itself; adding them again would double the BOS.
    if max_model_len is not None:
        return encode_bounded(tokenizer, text, max_model_len, "messages",
                              add_special_tokens=False)
    return tokenizer.encode(text, add_special_tokens=False)


def _has_tool_traffic(messages: list[ChatMessage]) -> bool:
    return any(m.role in ("tool", "function") or m.tool_calls is not None
               or m.function_call is not None for m in messages)


def chat_grammar(req: ChatCompletionRequest, plan: ToolPlan | None,
                 grammars: GrammarCompiler | None, fits: Callable[[Any], Any] | None = None,
                 thinks: bool | None = None) -> CompiledGrammar | None:
    """The grammar the answer must follow: the tools' (calls, or a plain answer under `auto`),
    a `guided_*` extra, or the response_format's schema; None when the answer is free.
    `fits` bounds a schema to the answer's token budget (adapters/schema_budget.py); with a
    reasoning parser (`thinks` not None) the grammar starts after the think block."""
    schema = response_schema(req.response_format)
    guided = guided_grammar(req)
    fits = fits or (lambda s: s)
    if guided is not None and guided[1] == "guided_json" and isinstance(req.guided_json, dict):
        guided = Grammar.json_schema(fits(req.guided_json)), "guided_json"
    if guided is not None and schema is not None:
        raise ApiError.bad_request(f"{guided[1]} cannot be combined with a response_format",
                                   param=guided[1])
    grammar: tuple[Grammar, str] | None = guided
    if plan is not None and plan.calls_allowed:
        if guided is not None:
            raise ApiError.bad_request(f"{guided[1]} cannot be combined with tools",
                                       param=guided[1])
        if grammars is None:
            raise RuntimeError("a grammar compiler is needed for tools")
        for i, tool in enumerate(plan.tools):  # name the tool whose schema is at fault
            where = f"{plan.param}[{i}]" + ("" if plan.legacy else ".function")
            compile_grammar(grammars, Grammar.json_schema(tool.parameters), f"{where}.parameters")
        grammar = Grammar.lark(tool_grammar(plan, schema)), plan.param
    elif schema is not None:
        grammar = Grammar.json_schema(fits(schema)), "response_format"
    # A client grammar that writes the think block itself is taken as it is.
    if grammar is not None and thinks is not None and "<think>" not in grammar[0].source:
        grammar = Grammar.after_thinking(grammar[0], thinks), grammar[1]
    return compile_requested(grammars, grammar)


def chat_prompt(req: ChatCompletionRequest, tokenizer, max_model_len: int,
                schema_prompt: bool = True) -> tuple[list[int], ToolPlan | None]:
    """The request's prompt ids (its tools described as the tool format says, the schema its
    answer is held to shown unless `schema_prompt` or the request's extra says not) and its tool
    plan. /v1/messages/count_tokens counts these ids too, so they are what a job would run."""
    plan = tool_plan(req.tools, req.tool_choice, req.parallel_tool_calls, req.functions,
                     req.function_call)
    fmt = tool_format(tokenizer) if plan or _has_tool_traffic(req.messages) else "generic"
    messages = template_messages(req.messages, fmt)
    template_tools = None
    if plan is not None:
        plan = dataclasses.replace(plan, syntax=tool_syntax(tokenizer, fmt))
    if plan is not None and plan.calls_allowed:
        if fmt != "generic":
            template_tools = [t.schema() for t in plan.tools]
        else:
            messages = with_tool_prompt(messages, plan)
    elif req.schema_prompt if req.schema_prompt is not None else schema_prompt:
        messages = with_schema_shown(messages, answer_schema(req))
    return render_prompt(tokenizer, messages, max_model_len, template_tools,
                         template_kwargs(req)), plan


def answer_schema(req: ChatCompletionRequest) -> dict[str, Any] | bool | None:
    """The JSON schema the answer is held to (`response_format`, `guided_json`), or None."""
    schema = response_schema(req.response_format)
    if schema is None and isinstance(req.guided_json, dict | bool):
        return req.guided_json
    if schema is None and isinstance(req.guided_json, str):
        try:
            return json.loads(req.guided_json)
        except ValueError:
            return None  # the grammar's compilation names the field
    return schema


def with_schema_shown(messages: list[dict[str, Any]], schema: dict[str, Any] | bool | None
                      ) -> list[dict[str, Any]]:
    """`messages` with the schema's instruction merged into the system message (one is added
    first where there is none), unless the conversation already shows it."""
    texts = [m["content"] for m in messages if isinstance(m.get("content"), str)]
    if schema is None or schema is False or carried(schema, texts):
        return messages
    text = instruction(schema)
    if messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{text}"},
                *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def build_chat_job(req: ChatCompletionRequest, tokenizer, max_model_len: int,
                   max_tokens_limit: int = 0, grammars: GrammarCompiler | None = None,
                   names: ParamNames = CHAT_NAMES, schema_prompt: bool = True,
                   reasoning_parser: str = "none") -> JobSpec:
    """Translate a chat request into one engine job; raises ApiError before any submission.
    `grammars` compiles structured outputs and tool grammars (here, on the request's thread);
    `names` is how the client's protocol names the parameters (/v1/messages builds chat
    requests too); `schema_prompt`: the server's default for showing a schema (`chat_prompt`);
    `reasoning_parser`: the server's, which the request's own `reasoning_parser` replaces."""
    check_supported(req)
    if req.reasoning_parser is not None:
        try:
            reasoning_parser = parser_name(req.reasoning_parser,
                                           getattr(tokenizer, "chat_template", None))
        except ValueError as exc:
            raise ApiError.bad_request(str(exc), param="reasoning_parser") from None
    prompt_ids, plan = chat_prompt(req, tokenizer, max_model_len, schema_prompt)
    # ChatOpenAI sends max_completion_tokens, older clients max_tokens; the newer name wins.
    if req.max_completion_tokens is not None:
        requested = req.max_completion_tokens
        names = names.renaming(max_new_tokens="max_completion_tokens")
    else:
        requested = req.max_tokens
    budget = max_tokens_for(requested, len(prompt_ids), max_model_len, names, max_tokens_limit)
    # Only a limit the client or the operator set bounds a schema: one that follows from the
    # prompt's length would make a new grammar (a compilation) of every prompt length.
    limited = requested is not None or max_tokens_limit > 0
    # Whether the answer may open with thinking (None: no reasoning parser), and whether the
    # prompt already opened the think block.
    thinks = starts_inside(tokenizer.decode(prompt_ids[-16:])) \
        if reasoning_parser == "think" else None
    grammar = chat_grammar(req, plan, grammars, (lambda schema: within_budget(
        schema, budget, lambda text: len(tokenizer.encode(text, add_special_tokens=False))))
        if limited else None, thinks)
    params = sampling_params(req, names, max_tokens=budget, logprobs=bool(req.logprobs),
                             top_logprobs=req.top_logprobs or 0)
    params.grammar = grammar
    if plan is not None and plan.calls_allowed and plan.syntax.special:
        params.skip_special_tokens = False  # the parser reads the calls' special opener
    return JobSpec(prompt_ids, params, plan if plan is not None and plan.calls_allowed else None,
                   thinks)


def chat_logprobs(logprobs: list[TokenLogprob], token_text: TokenText) -> list[TokenLogprobEntry]:
    entries = []
    for lp in logprobs:
        text, raw = token_text(lp.token_id)
        top = [TopLogprob(token_text(t)[0], v, token_text(t)[1]) for t, v in lp.top]
        entries.append(TokenLogprobEntry(text, lp.logprob, raw, top))
    return entries


def _answer_finish(finish: str | None, calls: int, plan: ToolPlan | None) -> str | None:
    """An answer that made calls and ended normally finishes with `tool_calls` (legacy:
    `function_call`)."""
    if calls and finish == "stop" and plan is not None:
        return "function_call" if plan.legacy else "tool_calls"
    return finish


class ChatAssembler:
    """Collects a job's deltas into the non-streaming chat response."""

    def __init__(self, meta: ResponseMeta, n: int, token_text: TokenText, logprobs: bool,
                 tools: ToolPlan | None = None, thinks: bool | None = None):
        self.meta, self.token_text, self.want_logprobs = meta, token_text, logprobs
        self.tools = tools
        self.splitters = splitters(n, thinks)
        self.thought: list[list[str]] = [[] for _ in range(n)]
        self.texts: list[list[str]] = [[] for _ in range(n)]
        self.logprobs: list[list[TokenLogprobEntry]] = [[] for _ in range(n)]
        self.finish: list[str | None] = [None] * n
        self.usage = UsageCounter()

    def add(self, delta: JobDelta) -> None:
        self.usage.add(delta)
        text = delta.text
        if self.splitters is not None:
            thought, text = self.splitters[delta.index].feed(
                text, len(delta.token_ids), last=delta.finished)
            self.thought[delta.index].append(thought)
        self.texts[delta.index].append(text)
        if delta.logprobs:
            self.logprobs[delta.index].extend(chat_logprobs(delta.logprobs, self.token_text))
        if delta.finish_reason is not None:
            self.finish[delta.index] = openai_finish_reason(delta.finish_reason)

    def _message(self, i: int) -> tuple[ChatResponseMessage, str]:
        text, finish = "".join(self.texts[i]), self.finish[i] or "stop"
        message = ChatResponseMessage(role="assistant", content=text)
        if self.splitters is not None and self.splitters[i].opened:
            message.reasoning_content = message.reasoning = "".join(self.thought[i])
        if self.tools is None:
            return message, finish
        content, calls = self.tools.syntax.parse(text)
        message.content = content
        if calls and self.tools.legacy:
            message.function_call = FunctionCall(calls[0].name, calls[0].arguments)
        elif calls:
            message.tool_calls = [ToolCall(c.id, FunctionCall(c.name, c.arguments))
                                  for c in calls]
        return message, _answer_finish(finish, len(calls), self.tools)

    def response(self) -> ChatCompletionResponse:
        choices = []
        for i in range(len(self.texts)):
            message, finish = self._message(i)
            choices.append(ChatChoice(
                index=i, message=message, finish_reason=finish,
                logprobs=ChoiceLogprobs(content=self.logprobs[i]) if self.want_logprobs else None))
        m = self.meta
        return ChatCompletionResponse(id=m.id, created=m.created, model=m.model, choices=choices,
                                      usage=self.usage.total(reasoning_tokens(self.splitters)),
                                      system_fingerprint=m.system_fingerprint)


class ChatChunker:
    """Turns a job's deltas into stream chunks: role first, text deltas (and whole tool calls
    as they complete), finish, then usage."""

    def __init__(self, meta: ResponseMeta, n: int, token_text: TokenText, include_usage: bool,
                 tools: ToolPlan | None = None, thinks: bool | None = None):
        self.meta, self.n, self.token_text = meta, n, token_text
        self.include_usage = include_usage
        self.tools = tools
        self.splitters = splitters(n, thinks)
        self.parsers = [ToolStreamParser(tools.syntax) for _ in range(n)] \
            if tools is not None else None
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
        text, calls, thought = delta.text, [], ""
        if self.splitters is not None:
            thought, text = self.splitters[delta.index].feed(text, len(delta.token_ids),
                                                             last=delta.finished)
        if self.parsers is not None:
            parser = self.parsers[delta.index]
            first = parser.calls
            text, calls = parser.feed(text)
            if finish is not None:
                text += parser.finish()
                finish = _answer_finish(finish, parser.calls, self.tools)
            calls = list(enumerate(calls, start=first))
        if not text and logprobs is None and finish is None and not calls and not thought:
            return []  # nothing the client can see (e.g. text held back for a stop string)
        bodies: list[tuple[ChunkDelta, ChoiceLogprobs | None]] = []
        if thought:  # the thinking goes out before the answer it precedes
            bodies.append((ChunkDelta(reasoning_content=thought, reasoning=thought), None))
        if text or logprobs is not None:
            bodies.append((ChunkDelta(content=text), logprobs))
        for k, call in calls:
            fn = FunctionCall(call.name, call.arguments)
            if not self.tools.legacy:
                bodies.append((ChunkDelta(tool_calls=[ToolCallDelta(k, call.id, fn)]), None))
            elif k == 0:  # a legacy answer carries one function call
                bodies.append((ChunkDelta(function_call=fn), None))
        if not bodies:
            bodies.append((ChunkDelta(), None))
        last = len(bodies) - 1
        return [self._chunk([ChunkChoice(delta.index, body, lp, finish if i == last else None)])
                for i, (body, lp) in enumerate(bodies)]

    def finish(self) -> list[ChatCompletionChunk]:
        if not self.include_usage:
            return []
        return [self._chunk([], self.usage.total(reasoning_tokens(self.splitters)))]


def splitters(n: int, thinks: bool | None) -> list[ReasoningSplitter] | None:
    """One reasoning splitter per choice, where the model has a reasoning parser."""
    return None if thinks is None else [ReasoningSplitter.starting(thinks) for _ in range(n)]


def reasoning_tokens(split: list[ReasoningSplitter] | None) -> int | None:
    return None if split is None else sum(s.reasoning_tokens for s in split)
