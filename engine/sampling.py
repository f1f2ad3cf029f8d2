"""Logits → tokens for a sub-batch: penalties, bias, filters, seeded draws, logprobs. Pure tensor
code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.outputs import TokenLogprob

if TYPE_CHECKING:
    from engine.job import Sequence


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence], vocab: int) -> torch.Tensor:
    """Repetition (HF: prompt and output), presence and frequency (OpenAI: output only) penalties.

    Returns `logits` unchanged when no row asks for a penalty, so the common case costs nothing.
    """
    rows = [
        i
        for i, s in enumerate(seqs)
        if s.params.presence_penalty
        or s.params.frequency_penalty
        or s.params.repetition_penalty != 1.0
    ]
    if not rows:
        return logits
    logits = logits.clone()
    for i in rows:
        s, p = seqs[i], seqs[i].params
        if s.counts is None:
            s.counts = torch.zeros(vocab, dtype=torch.float32, device=logits.device)
            if s.generated:
                s.counts.index_add_(
                    0,
                    torch.tensor(s.generated, device=logits.device),
                    torch.ones(len(s.generated), device=logits.device),
                )
        row = logits[i]
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(s.job.prompt_ids)), device=logits.device)
            seen = torch.unique(torch.cat([seen, s.counts.nonzero().flatten()]))
            vals = row[seen]
            row[seen] = torch.where(
                vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
            )
        if p.frequency_penalty:
            row -= p.frequency_penalty * s.counts
        if p.presence_penalty:
            row -= p.presence_penalty * (s.counts > 0).float()
    return logits


def apply_logit_bias(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    rows = [i for i, s in enumerate(seqs) if s.params.logit_bias]
    if not rows:
        return logits
    logits = logits.clone()
    for i in rows:
        bias = seqs[i].params.logit_bias
        ids = torch.tensor(list(bias.keys()), device=logits.device)
        logits[i, ids] += torch.tensor(
            list(bias.values()), dtype=logits.dtype, device=logits.device
        )
    return logits


def block_stop_tokens(
    logits: torch.Tensor, seqs: list[Sequence], eos_ids: list[int]
) -> torch.Tensor:
    """Before `min_new_tokens` are out, EOS and stop tokens cannot be chosen."""
    rows = [i for i, s in enumerate(seqs) if len(s.generated) < s.params.min_new_tokens]
    if not rows:
        return logits
    logits = logits.clone()
    for i in rows:
        blocked = set(eos_ids) | set(seqs[i].params.stop_token_ids)
        logits[i, list(blocked)] = float("-inf")
    return logits


def filter_logits(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p, each per row (0 / 1.0 / 0 switch a filter off)."""
    logits = logits / temperature[:, None]
    vocab = logits.shape[-1]
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, vocab)
    remove = ranks >= k[:, None]
    probs = sorted_logits.softmax(dim=-1)
    # Keep the smallest set whose mass reaches top_p: drop a token when the mass before it already
    # does.
    mass_before = probs.cumsum(dim=-1) - probs
    remove |= mass_before >= top_p[:, None]
    remove |= probs < (min_p[:, None] * probs[:, :1])
    remove[:, 0] = False  # the most likely token always survives
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def sample_rows(
    logits: torch.Tensor, seqs: list[Sequence], default_gen: torch.Generator
) -> list[int]:
    """Draw one token per row from filtered logits, each row from its own generator when seeded."""
    dev = logits.device
    p = [s.params for s in seqs]
    filtered = filter_logits(
        logits,
        torch.tensor([max(x.temperature, 1e-5) for x in p], device=dev),
        torch.tensor([x.top_k for x in p], device=dev),
        torch.tensor([x.top_p for x in p], device=dev),
        torch.tensor([x.min_p for x in p], device=dev),
    )
    probs = filtered.softmax(dim=-1)
    out = []
    for i, s in enumerate(seqs):
        out.append(int(torch.multinomial(probs[i], 1, generator=s.generator or default_gen)))
    return out


def logprobs_for(logits: torch.Tensor, tokens: list[int], top_n: list[int]) -> list[TokenLogprob]:
    """The chosen tokens' log-probabilities (and top alternatives) under `logits`."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, torch.tensor(tokens, device=lp.device)[:, None]).squeeze(1).tolist()
    k = max(top_n) if top_n else 0
    tops = lp.topk(k, dim=-1) if k else None
    out = []
    for i, tok in enumerate(tokens):
        top = []
        if tops is not None and top_n[i]:
            top = list(
                zip(tops.indices[i, : top_n[i]].tolist(), tops.values[i, : top_n[i]].tolist())
            )
        out.append(TokenLogprob(tok, chosen[i], top))
    return out
