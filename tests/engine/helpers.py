"""Test helpers: prompts of varied length, a reference greedy decoder, collecting engine output."""

from __future__ import annotations

import torch

from engine import JobHandle
from engine.model import llama_layers as lean

SENTENCES = [
    "The river ran quietly past the old mill, carrying leaves from the autumn trees.",
    "Engineers measured the bridge twice before they trusted the numbers.",
    "A small robot learned to sort coloured blocks by watching children play.",
    "In the morning market, traders called out prices for fish, bread and spices.",
]


def prompt_of(tokenizer, n_sentences: int, question: str) -> list[int]:
    body = " ".join(SENTENCES[i % len(SENTENCES)] for i in range(n_sentences))
    return tokenizer.encode(f"{body}\nQuestion: {question}\nAnswer:")


def varied_prompts(tokenizer, count: int) -> list[list[int]]:
    """Prompts whose lengths span about two orders of magnitude (≈5 to ≈500 tokens)."""
    sizes = [0, 1, 2, 4, 8, 16, 24, 32, 3, 12, 6, 20][:count]
    out = []
    for i, n in enumerate(sizes):
        ids = (
            prompt_of(tokenizer, n, f"what happens in part {i}?")
            if n
            else tokenizer.encode(f"Hi {i}!")
        )
        out.append(ids)
    return out


def reference_greedy(
    model, ids: list[int], max_new_tokens: int, min_new_tokens: int = 0
) -> list[int]:
    """transformers' own greedy decoding, one sequence, no padding (its own decoder layers, also
    where an engine gave the model lean ones)."""
    with torch.inference_mode(), lean.original_layers(model):
        out = model.generate(
            torch.tensor([ids], device=model.device),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            min_new_tokens=min_new_tokens,
        )
    return out[0, len(ids) :].tolist()


def collect(handle: JobHandle) -> dict[int, dict]:
    """Drain a sync handle: per sequence index, its tokens, text, finish reason and deltas."""
    seqs: dict[int, dict] = {}
    for d in handle.iter_sync(timeout=0):
        s = seqs.setdefault(
            d.index, {"tokens": [], "text": "", "finish": None, "deltas": [], "logprobs": []}
        )
        s["tokens"] += d.token_ids
        s["text"] += d.text
        s["deltas"].append(d)
        s["logprobs"] += d.logprobs or []
        if d.finish_reason:
            s["finish"] = d.finish_reason
    return seqs
