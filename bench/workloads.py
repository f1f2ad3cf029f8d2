"""Request bodies for the serving benchmark: the ShareGPT sweep, the shared-system-prompt
scenario and the splitting scenario. Bodies carry no `model`; `for_server` adds the one each
server expects.

Every request is greedy (temperature 0) and streamed, with stream_options.include_usage so that
seqgate reports its token counts (transformers serve ignores the field, logs so once, and always
puts usage in its last chunk).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from bench.sharegpt import Request, shuffled_exchanges, text_token_ids

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"

# The shared system prompt of the prompt-cache scenario (about 400 tokens with SmolLM2's
# tokenizer; the run records the exact count).
SYSTEM_PROMPT = """\
You are Quill, the reading assistant of Harbor Lane Books, an independent bookshop with two \
branches, one by the old harbor and one in the university quarter. You help customers find books, \
answer questions about orders, and suggest what to read next. Follow these rules in every reply.

1. Be friendly, direct and brief. Prefer short paragraphs and plain words. Do not use emoji.
2. When a customer asks for a recommendation, ask at most one clarifying question, then suggest \
two or three titles. For each, give the author, one sentence on why it fits, and whether it is a \
quick read or a long one. Never invent titles or authors; if you are not sure a book exists, say so.
3. Stock and prices change daily. Never promise that a book is in stock. Say that the customer can \
check the live stock on the shop's website or ask a bookseller at either branch.
4. Orders: a customer can collect an order at either branch, or have it posted. Posting within the \
country takes two to four working days and is free above forty pounds. Orders abroad take one to \
three weeks. If an order is late, apologise once, ask for the order number, and explain that a \
bookseller will reply by email within one working day. Never ask for card details or passwords.
5. Returns: unread books can be returned within thirty days with the receipt, for a refund or \
store credit. Damaged or faulty books are replaced at no cost. Signed copies and special orders \
cannot be returned unless they are faulty.
6. Opening hours: the harbor branch opens from nine to six, Monday to Saturday, and from eleven to \
four on Sunday. The university branch opens from ten to eight, every day except public holidays.
7. If a question has nothing to do with books, reading or the shop, answer it briefly and kindly \
if you can, and then offer to help with something book related.
8. If you do not know an answer, say that you do not know, and suggest asking a bookseller.
"""


# Words for distinct system prompts (`distinct_system_prompts`).
PROMPT_WORDS = ("river mountain ledger compass harbor lantern orchard meadow canyon glacier quarry "
                "beacon thicket prairie summit delta estuary plateau fjord lagoon archipelago "
                "tundra savanna marsh grove dune ridge valley basin cove").split()


def distinct_system_prompts(tokenizer, count: int, tokens: int, seed: int) -> list[str]:
    """`count` system prompts of at least `tokens` tokens that share no prefix block: routing
    over replicas (bench.routing, tests/app/replicas) sends each to wherever its head is cached."""
    rng = random.Random(seed)
    out = []
    for k in range(count):
        text = f"You are assistant number {k} of run {seed}."
        while len(tokenizer.encode(text)) < tokens:
            text += " " + " ".join(rng.choice(PROMPT_WORDS) for _ in range(20))
        out.append(text)
    return out


def sharegpt_chat(req: Request, max_tokens: int | None = None, stream: bool = True,
                  system: str | None = None) -> dict:
    """A greedy chat request for one ShareGPT request (its budget, or `max_tokens`)."""
    messages = ([{"role": "system", "content": system}] if system else []) + req.messages
    body = {"messages": messages, "max_tokens": max_tokens or req.max_tokens, "temperature": 0,
            "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def sweep_bodies(requests: Sequence[Request]) -> list[dict]:
    return [sharegpt_chat(r) for r in requests]


def prompt_cache_bodies(requests: Sequence[Request]) -> list[dict]:
    """The sweep's requests, each behind the one shared SYSTEM_PROMPT."""
    return [sharegpt_chat(r, system=SYSTEM_PROMPT) for r in requests]


def agreement_bodies(requests: Sequence[Request], top_logprobs: bool = False) -> list[dict]:
    """Non-streamed greedy chats, each with its ShareGPT budget; with `top_logprobs`, asking for
    each token's two likeliest candidates (to tell a near tie from a real divergence)."""
    bodies = [sharegpt_chat(r, stream=False) for r in requests]
    if top_logprobs:
        for b in bodies:
            b.update(logprobs=True, top_logprobs=2)
    return bodies


def log_spaced(count: int, lo: int, hi: int) -> list[int]:
    """`count` integers from lo to hi, evenly spaced on a log scale."""
    if count == 1:
        return [hi]
    return [round(lo * (hi / lo) ** (i / (count - 1))) for i in range(count)]


def splitting_prompts(tokenizer, count: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    """`count` prompts of exact token lengths log-spaced from lo to hi (two orders of magnitude
    for 10 → 1000), cut from ShareGPT user text, in a shuffled arrival order."""
    lengths = log_spaced(count, lo, hi)
    random.Random(seed).shuffle(lengths)
    text = text_token_ids(tokenizer, sum(lengths), seed=seed)
    prompts, at = [], 0
    for n in lengths:
        prompts.append(text[at:at + n])
        at += n
    return prompts


def splitting_bodies(prompts: Sequence[list[int]], new_tokens: int) -> list[dict]:
    """Completions over token-id prompts, exactly `new_tokens` each (min_tokens is seqgate's
    extension), so every configuration does the same work."""
    return [{"prompt": p, "max_tokens": new_tokens, "min_tokens": new_tokens, "temperature": 0,
             "stream": True, "stream_options": {"include_usage": True}} for p in prompts]


def for_server(bodies: Sequence[dict], model: str | None) -> list[dict]:
    """Copies of `bodies` naming `model` (left out where None: both servers then use theirs)."""
    return [dict(b, model=model) if model else dict(b) for b in bodies]


# Input-grounded requests (speculative decoding's benchmark): the answer copies its input.
GROUNDED = "Repeat the following text, fixing any spelling mistakes:\n\n{text}"


def grounded_messages(tokenizer, count: int, seed: int, max_tokens: int
                      ) -> list[tuple[list[dict], int]]:
    """(messages, budget) of `count` rewriting requests over ShareGPT replies of 40-400 tokens,
    each budget the reply's length capped at `max_tokens`."""
    out = []
    for _, reply in shuffled_exchanges(seed):
        n = len(tokenizer.encode(reply, add_special_tokens=False))
        if 40 <= n <= 400:
            out.append(([{"role": "user", "content": GROUNDED.format(text=reply)}],
                        min(n, max_tokens)))
            if len(out) == count:
                return out
    raise ValueError(f"only {len(out)} ShareGPT replies of 40-400 tokens")


def grounded_bodies(tokenizer, count: int, seed: int, max_tokens: int) -> list[dict]:
    """Streamed greedy chats of `grounded_messages`."""
    return [{"messages": messages, "max_tokens": budget, "temperature": 0, "stream": True,
             "stream_options": {"include_usage": True}}
            for messages, budget in grounded_messages(tokenizer, count, seed, max_tokens)]
