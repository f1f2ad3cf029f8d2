"""Constrained decoding: grammars compiled by llguidance over the model's own tokenizer, and the
token masks that keep each constrained row inside its grammar.

A `Grammar` says what the output must match (a JSON schema, a regular expression, a choice of
literal strings, or a Lark grammar); `GrammarCompiler.compile` turns it into a `CompiledGrammar`
off the engine thread (the adapters call it while they prepare a request), keeps the result in a
bounded LRU keyed by the grammar, and pays the lexer's lazy set-up there too, so a job reaches the
engine with its grammar ready. Each sequence decodes with its own copy of the compiled matcher.

Why llguidance rather than xgrammar (docs/benchmarks/grammar.md): a never-seen schema compiles
much faster, on a request thread that shares the machine's cores with the engine; xgrammar
computes a mask faster, but both are far below a step, and applying the mask to the logits costs
more than computing it with either; llguidance has no heavy dependencies where xgrammar pulls
triton; and its Lark front end embeds JSON schemas, which the tool-call grammars need.
"""

from __future__ import annotations

import functools
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import llguidance
import llguidance.hf
import torch
from llguidance import LLMatcher

# The numpy entry, not llguidance.torch's: the same call into the library, without the
# torch.compile'd helper that module builds at import (seconds of every process start).
from llguidance.numpy import fill_next_token_bitmask_par

from engine.errors import InvalidGrammar

GRAMMAR_CACHE_ENTRIES = 256
# Bounds on the work one grammar may cost (llguidance's defaults are 4x looser): a pathological
# regex such as (a{1000}){1000} costs a quarter of the time per mask with these, and the
# mask-cost check below refuses it at compile; normal grammars stay far within either.
PARSER_LIMITS = dict(step_lexer_fuel=50_000, max_lexer_states=20_000, initial_lexer_fuel=300_000,
                     step_max_items=20_000)
# A grammar whose start-state mask (after its one-time set-up) costs more CPU than its limit is
# refused: every step would pay about as much, on the engine thread. The limit is a share of the
# engine's own decode step (20 ms was set against a 100 ms CPU step; a GPU step is a
# few ms), within these bounds.
MAX_MASK_SECONDS = 0.02
MIN_MASK_SECONDS = 0.001
MASK_SHARE_OF_STEP = 0.25


def mask_limit(step_seconds: float) -> float:
    """The most CPU one grammar's mask may cost, for a decode step of `step_seconds`
    (0: not measured yet, the fixed ceiling)."""
    if step_seconds <= 0:
        return MAX_MASK_SECONDS
    return min(MAX_MASK_SECONDS, max(MIN_MASK_SECONDS, MASK_SHARE_OF_STEP * step_seconds))
# JSON is written as json.dumps writes it: `{"a": 1, "b": [2, 3]}`. llguidance's default lets the
# model put any whitespace between tokens, and a small model sampling at temperature 1 then fills
# the answer with blank lines until its token budget ends. A schema's own "x-guidance" wins.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_BITS = torch.arange(32, dtype=torch.int32)



@dataclass(frozen=True)
class Grammar:
    """What a constrained output must match. `source` is the grammar as text, the key of the
    compile cache. (A schema's keys keep their order: properties are generated in the order the
    schema lists them, so two orderings are two grammars.)"""

    kind: str  # json_schema | regex | choice | lark | grammar (Lark or GBNF, llguidance decides)
    source: str

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | bool) -> Grammar:
        return cls("json_schema", json.dumps(schema, separators=(",", ":")))

    @classmethod
    def json_object(cls) -> Grammar:
        """Any JSON object (OpenAI's `{"type": "json_object"}`)."""
        return cls.json_schema({"type": "object"})

    @classmethod
    def regex(cls, pattern: str) -> Grammar:
        return cls("regex", pattern)

    @classmethod
    def choice(cls, options: list[str]) -> Grammar:
        return cls("choice", json.dumps(list(options)))

    @classmethod
    def lark(cls, text: str) -> Grammar:
        return cls("lark", text)

    @classmethod
    def after_thinking(cls, answer: Grammar, opened: bool) -> Grammar:
        """`answer` after a reasoning model's think block, free text up to the first `</think>`:
        the block optional, or already `opened` by the prompt (then it must close first)."""
        return cls("thinking", json.dumps({"kind": answer.kind, "source": answer.source,
                                           "opened": opened}))

    @classmethod
    def lark_or_gbnf(cls, text: str) -> Grammar:
        """A client's grammar: Lark, or llama.cpp's GBNF (converted to Lark by llguidance)."""
        return cls("grammar", text)

    def llguidance_text(self) -> str:
        """The grammar in llguidance's own serialisation."""
        try:
            if self.kind == "json_schema":
                return LLMatcher.grammar_from_json_schema(self.source, defaults=JSON_STYLE)
            if self.kind == "regex":
                return LLMatcher.grammar_from_regex(self.source)
            if self.kind == "choice":
                options = json.loads(self.source)
                return LLMatcher.grammar_from_lark(
                    "start: " + " | ".join(json.dumps(o) for o in options))
            if self.kind == "lark":
                return LLMatcher.grammar_from_lark(self.source)
            if self.kind == "grammar":
                return llguidance.grammar_from("grammar", self.source)
            if self.kind == "thinking":
                return self._after_thinking()
        except ValueError as exc:
            raise InvalidGrammar(str(exc)) from None
        raise ValueError(f"unknown grammar kind {self.kind!r}")

    def _after_thinking(self) -> str:
        """One grammar, so the mask stays exact across the block's end: an outer Lark grammar
        whose think text is lazy up to (and with) the first `</think>`, then the answer's own
        grammar by reference."""
        spec = json.loads(self.source)
        inner = Grammar(spec["kind"], spec["source"]).llguidance_text()
        try:
            grammars = json.loads(inner)["grammars"]
        except (ValueError, KeyError, TypeError):
            grammars = [{"lark_grammar": inner}]
        block = "think SPACE" if spec["opened"] else '("<think>" think SPACE)?'
        outer = (f"start: {block} @answer\n"
                 'think[suffix="</think>"]: /(?s:.*)/\n'
                 "SPACE: /[ \\t\\n]*/\n")
        return json.dumps({"grammars": [{"lark_grammar": outer},
                                        {**grammars[0], "name": "answer"}, *grammars[1:]]})


class CompiledGrammar:
    """A compiled grammar: a matcher at its start state, copied for each sequence."""

    def __init__(self, grammar: Grammar, template: LLMatcher):
        self.grammar = grammar
        self._template = template

    def matcher(self) -> LLMatcher:
        return self._template.deep_copy()


class GrammarCompiler:
    """Compiles grammars over one tokenizer, from any thread, with a bounded cache."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: list[int],
                 capacity: int = GRAMMAR_CACHE_ENTRIES,
                 step_seconds: Callable[[], float] = lambda: 0.0):
        self._hf_tokenizer = tokenizer
        self._step_seconds = step_seconds  # the engine's decode step, as it measures it
        self.vocab_size = vocab_size
        self._eos_ids = eos_ids
        self._capacity = capacity
        self._tokenizer: llguidance.LLTokenizer | None = None  # built on first use (~0.3 s)
        self._cache: OrderedDict[Grammar, CompiledGrammar | InvalidGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.compiled = 0  # grammars compiled or refused (cache misses)

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self._eos_ids)
            return self._tokenizer

    def compile(self, grammar: Grammar) -> CompiledGrammar:
        """The compiled grammar, from the cache or built now. Raises InvalidGrammar.

        Building drops the GIL (llguidance), so a compile on a request thread does not hold up
        the engine thread; the first mask is computed here, where its lazy set-up costs nothing
        to the running batch. Refusals are cached too: a grammar that took a second to refuse
        costs that second once.
        """
        with self._lock:
            hit = self._cache.get(grammar)
            if hit is not None:
                self._cache.move_to_end(grammar)
        if isinstance(hit, InvalidGrammar):
            raise hit
        if hit is not None:
            return hit
        try:
            result: CompiledGrammar | InvalidGrammar = CompiledGrammar(grammar,
                                                                        self._build(grammar))
        except InvalidGrammar as exc:
            result = exc
        with self._lock:
            self.compiled += 1
            self._cache[grammar] = result
            while len(self._cache) > self._capacity:
                self._cache.popitem(last=False)
        if isinstance(result, InvalidGrammar):
            raise result
        return result

    def _build(self, grammar: Grammar) -> LLMatcher:
        """A matcher at the grammar's start, its lexer set up and its mask cost checked."""
        text = grammar.llguidance_text()
        matcher = LLMatcher(self._llg_tokenizer(), text, log_level=0,
                            limits=llguidance.LLParserLimits(**PARSER_LIMITS))
        if matcher.is_error():
            raise InvalidGrammar(matcher.get_error())
        matcher.compute_bitmask()  # the lexer's lazy set-up, paid here
        t0 = time.thread_time()  # CPU time: a busy machine does not make a grammar expensive
        matcher.compute_bitmask()  # what a step will pay, set-up done
        cost = time.thread_time() - t0
        if matcher.is_error():
            raise InvalidGrammar(matcher.get_error())
        limit = mask_limit(self._step_seconds())
        if cost > limit:
            raise InvalidGrammar(f"too expensive to enforce: a token mask takes {cost * 1e3:.1f} "
                                 f"ms of CPU (the limit is {limit * 1e3:.1f} ms, a quarter of this "
                                 "engine's decode step)")
        return matcher

    def __len__(self) -> int:
        return len(self._cache)


class GrammarMasks:
    """Applies the rows' grammars to a step's logits: one bitmask computation for all of them
    (llguidance's thread pool) and one masked fill. Rows without a grammar cost nothing."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self._executor: llguidance.LLExecutor | None = None
        self.masked_tokens = 0  # row-steps masked since start
        self.mask_seconds = 0.0  # time spent computing and applying those masks

    def apply(self, logits: torch.Tensor, matchers: list[LLMatcher | None]) -> torch.Tensor:
        """`logits` with every token a row's grammar forbids at -inf (a copy when any row has a
        grammar; `logits` itself when none does)."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return logits
        t0 = time.perf_counter()
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        # Rows without a grammar keep every bit set; the others are filled by llguidance.
        words = (self.vocab_size + 31) // 32
        # llguidance fills host memory; pinned, it reaches a GPU without a synchronisation.
        bitmask = torch.full((len(matchers), words), -1, dtype=torch.int32,
                             pin_memory=logits.device.type == "cuda")
        fill_next_token_bitmask_par(self._executor, [(matchers[i], i) for i in rows],
                                    bitmask.numpy())
        allowed = unpack_bitmask(bitmask.to(logits.device, non_blocking=True), logits.shape[-1])
        logits = logits.masked_fill(~allowed, float("-inf"))
        self.masked_tokens += len(rows)
        self.mask_seconds += time.perf_counter() - t0
        return logits


@functools.cache
def _bit_table(device: torch.device) -> torch.Tensor:
    """The shifts that unpack a word, kept on each device that asked for them."""
    return _BITS.to(device)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, words] int32 bitmask (bit j of word w allows token 32w+j) → [rows, vocab_size]
    bool; tokens past the bitmask's end (a model vocabulary larger than the tokenizer's) are
    forbidden."""
    bits = ((bitmask[:, :, None] >> _bit_table(bitmask.device)) & 1).bool()
    bits = bits.reshape(bitmask.shape[0], -1)[:, :vocab_size]
    if bits.shape[1] < vocab_size:
        bits = torch.nn.functional.pad(bits, (0, vocab_size - bits.shape[1]), value=False)
    return bits
