"""POST /v1/completions (legacy): prompts as text or token ids → engine jobs, and deltas →
a response or stream chunks. One engine job per prompt; choice index = prompt × n + sequence."""

from __future__ import annotations

from dataclasses import dataclass

from msgspec import UNSET

from adapters.errors import COMPLETION_NAMES, ApiError
from adapters.limits import MAX_CHOICES, MAX_PROMPTS
from adapters.openai_params import (
    JobSpec,
    ResponseMeta,
    max_tokens_for,
    openai_finish_reason,
    sampling_params,
)
from adapters.openai_types import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    PromptLogprob,
)
from adapters.prompt_size import encode_bounded
from adapters.structured import (
    compile_requested,
    guided_grammar,
    response_schema,
)
from adapters.token_text import TokenText
from adapters.usage import UsageCounter
from engine import JobDelta, TokenLogprob
from engine.sample.grammar import CompiledGrammar, Grammar, GrammarCompiler

# OpenAI's own default for this endpoint (chat has none).
DEFAULT_MAX_TOKENS = 16


@dataclass
class Prompt:
    """One prompt of a completions request: its ids and its text (for echo)."""

    ids: list[int]
    text: str


def _is_ids(x: object) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def parse_prompts(prompt: str | list, tokenizer, max_model_len: int | None = None) -> list[Prompt]:
    """Text, list of texts, token ids, or list of token-id lists → prompts (400 otherwise)."""
    if isinstance(prompt, str):
        items: list = [prompt]
    elif _is_ids(prompt) and prompt:
        items = [prompt]
    elif isinstance(prompt, list) and prompt and (
            all(isinstance(p, str) for p in prompt) or all(_is_ids(p) for p in prompt)):
        items = prompt
    else:
        raise ApiError.bad_request("prompt must be a string, a list of strings, a list of token "
                                   "ids, or a list of token-id lists, and not empty",
                                   param="prompt", code="invalid_type")
    if len(items) > MAX_PROMPTS:
        raise ApiError.bad_request(f"at most {MAX_PROMPTS} prompts per request", param="prompt")
    out = []
    for item in items:
        if isinstance(item, str):
            ids = tokenizer.encode(item) if max_model_len is None else \
                encode_bounded(tokenizer, item, max_model_len, "prompt")
            out.append(Prompt(ids, item))
        else:
            if not item:
                raise ApiError.bad_request("a token-id prompt must not be empty", param="prompt")
            vocab = len(tokenizer)
            if bad := [t for t in item if not 0 <= t < vocab]:
                raise ApiError.bad_request(f"token id {bad[0]} is outside the vocabulary "
                                           f"[0, {vocab})", param="prompt")
            out.append(Prompt(list(item), tokenizer.decode(item)))
    if any(not p.ids for p in out):
        raise ApiError.bad_request("the prompt is empty after tokenization", param="prompt")
    return out


def check_supported(req: CompletionRequest) -> None:
    if req.suffix:
        raise ApiError.unsupported("suffix", " (no fill-in-the-middle)")
    n = 1 if req.n is None else req.n
    if req.best_of is not None and req.best_of != n:
        raise ApiError.unsupported("best_of", " (only best_of equal to n)")
    if req.logprobs is not None and not 0 <= req.logprobs <= 20:
        raise ApiError.bad_request(f"logprobs must be in [0, 20], got {req.logprobs}",
                                   param="logprobs")


def completion_grammar(req: CompletionRequest,
                       grammars: GrammarCompiler | None) -> CompiledGrammar | None:
    """The grammar of a `guided_*` extra or a `response_format`, compiled (one per request: every
    prompt's job shares it)."""
    schema = response_schema(req.response_format)
    guided = guided_grammar(req)
    if guided is not None and schema is not None:
        raise ApiError.bad_request(f"{guided[1]} cannot be combined with a response_format",
                                   param=guided[1])
    grammar = guided or ((Grammar.json_schema(schema), "response_format")
                         if schema is not None else None)
    return compile_requested(grammars, grammar)


def build_completion_jobs(req: CompletionRequest, tokenizer, max_model_len: int,
                          max_tokens_limit: int = 0, grammars: GrammarCompiler | None = None
                          ) -> tuple[list[JobSpec], list[Prompt]]:
    """One job per prompt; everything is checked before any job is submitted."""
    check_supported(req)
    grammar = completion_grammar(req, grammars)
    prompts = parse_prompts(req.prompt, tokenizer, max_model_len)
    n = 1 if req.n is None else req.n
    if len(prompts) * n > MAX_CHOICES:
        raise ApiError.bad_request(f"prompts × n must be at most {MAX_CHOICES}, got "
                                   f"{len(prompts)} × {n}", param="n")
    requested = DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    jobs = []
    for p in prompts:
        budget = max_tokens_for(requested, len(p.ids), max_model_len, COMPLETION_NAMES,
                                max_tokens_limit)
        params = sampling_params(req, COMPLETION_NAMES, max_tokens=budget,
                                 logprobs=req.logprobs is not None,
                                 top_logprobs=req.logprobs or 0,
                                 prompt_logprobs=prompt_logprobs_of(req))
        params.grammar = grammar
        jobs.append(JobSpec(p.ids, params))
    return jobs, prompts


def prompt_logprobs_of(req: CompletionRequest) -> int | None:
    """How many alternatives each prompt token's log-probability reports, when they are asked:
    by `prompt_logprobs` (vLLM's), or by `echo` with `logprobs` (OpenAI's: the echoed prompt's
    tokens lead the choice's logprobs, the first with null)."""
    if req.prompt_logprobs is not None:
        return max(req.prompt_logprobs, req.logprobs or 0) if req.echo else req.prompt_logprobs
    return req.logprobs if req.echo and req.logprobs is not None else None


def vllm_prompt_logprobs(entries: list[TokenLogprob | None], k: int, token_text: TokenText
                         ) -> list[dict[str, PromptLogprob] | None]:
    """vLLM's `prompt_logprobs`: per prompt token, the token and its `k` top alternatives."""
    out: list[dict[str, PromptLogprob] | None] = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        ranked = {str(t): PromptLogprob(v, r + 1, token_text.text(t))
                  for r, (t, v) in enumerate(entry.top[:k])}
        ranked.setdefault(str(entry.token_id), PromptLogprob(
            entry.logprob, entry.rank, token_text.text(entry.token_id)))
        out.append(ranked)
    return out


class _LogprobsBuilder:
    """Completions-format logprobs for one choice: parallel lists, with character offsets (an
    echoed prompt's tokens first, from `prompt_logprobs` of the choice's first delta)."""

    def __init__(self, prompt: Prompt, echo: bool, top: int | None):
        self.lp = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        self.prompt, self.offset, self.echo, self.top_n = prompt, 0, echo, top

    def add(self, delta: JobDelta, token_text: TokenText) -> CompletionLogprobs:
        part = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        entries: list[TokenLogprob | None] = list(delta.logprobs or [])
        if self.echo and delta.prompt_logprobs is not None:
            entries = [*delta.prompt_logprobs, *entries]
        for entry in entries:
            if entry is None:  # the prompt's first token: nothing precedes it
                text, logprob, top = token_text.text(self.prompt.ids[0]), None, None
            else:
                text, logprob = token_text.text(entry.token_id), entry.logprob
                top = {token_text.text(t): v for t, v in entry.top[: self.top_n]}
                top.setdefault(text, entry.logprob)  # the chosen token always appears (vLLM)
            for target in (self.lp, part):
                target.tokens.append(text)
                target.token_logprobs.append(logprob)
                target.top_logprobs.append(top)
                target.text_offset.append(self.offset)
            self.offset += len(text)
        return part


class CompletionAssembler:
    """Collects every job's deltas into the non-streaming completions response."""

    def __init__(self, meta: ResponseMeta, prompts: list[Prompt], n: int, echo: bool,
                 token_text: TokenText, logprobs: bool, top: int | None = None,
                 prompt_logprobs: int | None = None):
        self.meta, self.n, self.token_text = meta, n, token_text
        count = len(prompts) * n
        self.texts = [[prompts[i // n].text] if echo else [] for i in range(count)]
        self.logprobs = [_LogprobsBuilder(prompts[i // n], echo, top)
                         if logprobs else None for i in range(count)]
        self.prompt_k = prompt_logprobs
        self.prompt_logprobs: list = [UNSET] * count
        self.finish: list[str | None] = [None] * count
        self.usage = UsageCounter()

    def add(self, prompt_index: int, delta: JobDelta) -> None:
        i = prompt_index * self.n + delta.index
        self.usage.add(delta)
        self.texts[i].append(delta.text)
        if (lp := self.logprobs[i]) is not None:
            lp.add(delta, self.token_text)
        if self.prompt_k is not None and delta.prompt_logprobs is not None:
            self.prompt_logprobs[i] = vllm_prompt_logprobs(delta.prompt_logprobs, self.prompt_k,
                                                           self.token_text)
        if delta.finish_reason is not None:
            self.finish[i] = openai_finish_reason(delta.finish_reason)

    def response(self) -> CompletionResponse:
        choices = [CompletionChoice(index=i, text="".join(t),
                                    logprobs=self.logprobs[i].lp if self.logprobs[i] else None,
                                    finish_reason=self.finish[i] or "stop",
                                    prompt_logprobs=self.prompt_logprobs[i])
                   for i, t in enumerate(self.texts)]
        m = self.meta
        return CompletionResponse(id=m.id, created=m.created, model=m.model, choices=choices,
                                  system_fingerprint=m.system_fingerprint,
                                  usage=self.usage.total())


class CompletionChunker:
    """Turns deltas into completions stream chunks (same shape as the response, one choice)."""

    def __init__(self, meta: ResponseMeta, prompts: list[Prompt], n: int, echo: bool,
                 token_text: TokenText, logprobs: bool, include_usage: bool,
                 top: int | None = None, prompt_logprobs: int | None = None):
        self.meta, self.prompts, self.n, self.echo = meta, prompts, n, echo
        self.token_text, self.include_usage = token_text, include_usage
        count = len(prompts) * n
        self.logprobs = [_LogprobsBuilder(prompts[i // n], echo, top)
                         if logprobs else None for i in range(count)]
        self.prompt_k = prompt_logprobs
        self.usage = UsageCounter()

    def _chunk(self, choices: list[CompletionChoice]) -> CompletionResponse:
        m = self.meta
        # Unlike chat's, this schema has no null usage: it is absent until the last chunk.
        return CompletionResponse(id=m.id, created=m.created, model=m.model, choices=choices,
                                  system_fingerprint=m.system_fingerprint)

    def start(self) -> list[CompletionResponse]:
        if not self.echo:
            return []
        return [self._chunk([CompletionChoice(i, self.prompts[i // self.n].text, None, None)])
                for i in range(len(self.prompts) * self.n)]

    def on_delta(self, prompt_index: int, delta: JobDelta) -> list[CompletionResponse]:
        i = prompt_index * self.n + delta.index
        self.usage.add(delta)
        builder = self.logprobs[i]
        lp = builder.add(delta, self.token_text) if builder is not None else None
        finish = openai_finish_reason(delta.finish_reason)
        prompt = UNSET
        if self.prompt_k is not None and delta.prompt_logprobs is not None:
            prompt = vllm_prompt_logprobs(delta.prompt_logprobs, self.prompt_k, self.token_text)
        if not delta.text and finish is None and not (lp and lp.tokens) and prompt is UNSET:
            return []
        return [self._chunk([CompletionChoice(i, delta.text, lp, finish, prompt)])]

    def finish(self) -> list[CompletionResponse]:
        if not self.include_usage:
            return []
        chunk = self._chunk([])
        chunk.usage = self.usage.total()
        return [chunk]
