"""Logits → tokens for a sub-batch: penalties, bias, filters, seeded draws, logprobs. Pure tensor
code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.outputs import TokenLogprob

if TYPE_CHECKING:
    from engine.request.job import Sequence


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


# Top-k and top-p look for their cut among this many of a row's most likely tokens first (a
# partial sort); a row whose cut lies further down (top-p without top-k over a flat
# distribution) sorts its whole vocabulary.
CANDIDATES = 256


def filter_logits(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p, each per row (0 / 1.0 / 0 switch a filter off).

    The three filters judge the same temperature-scaled distribution and a token survives only
    if all three keep it; the most likely token always survives. Rows with every filter off cost
    one division; min-p needs no sort; top-k and top-p sort only a row's CANDIDATES most likely
    tokens unless the cut lies beyond them. (Sorting 16 rows of SmolLM2's 49k logits took longer
    on 2 cores than a tenth of the whole forward of 32 rows.)
    """
    scaled = logits / temperature[:, None]
    out = scaled
    if bool((min_p > 0).any()):
        probs = scaled.softmax(dim=-1)
        low = probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True)
        out = scaled.masked_fill(low, float("-inf"))  # never the most likely token
    ranked = (top_k > 0) | (top_p < 1.0)
    if bool(ranked.any()):
        rows = ranked.nonzero().squeeze(1)
        cut = _cut_ranked(scaled[rows], top_k[rows], top_p[rows])
        out = out.clone() if out is scaled else out
        out[rows] = out[rows].masked_fill(cut, float("-inf"))
    return out


def _cut_ranked(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Where top-k or top-p removes a token ([rows, vocab] bool). The ranks and the mass before
    each token come from a partial sort of the CANDIDATES most likely tokens, or a full sort for
    rows whose cut may lie beyond them."""
    vocab = logits.shape[-1]
    k = min(vocab, max(CANDIDATES, int(top_k.max())))
    values, order = torch.topk(logits, k, dim=-1)  # sorted, most likely first
    probs = (values - torch.logsumexp(logits, dim=-1, keepdim=True)).exp()
    mass = probs.cumsum(dim=-1)
    # Beyond the candidates, tokens survive only where neither filter has cut by then.
    beyond = (top_k == 0) & (mass[:, -1] < top_p)
    if k < vocab and bool(beyond.any()):
        values, order = torch.sort(logits, dim=-1, descending=True)
        probs = (values - torch.logsumexp(logits, dim=-1, keepdim=True)).exp()
        mass, k = probs.cumsum(dim=-1), vocab
    ranks = torch.arange(k, device=logits.device)[None, :]
    limit = torch.where(top_k > 0, top_k, vocab)
    # Keep the smallest set whose mass reaches top_p: drop a token when the mass before it
    # already does.
    drop = (ranks >= limit[:, None]) | (mass - probs >= top_p[:, None])
    drop[:, 0] = False  # the most likely token always survives
    cut = torch.ones_like(logits, dtype=torch.bool)  # not among the candidates: cut
    return cut.scatter_(1, order, drop)


def sample_rows(
    logits: torch.Tensor, seqs: list[Sequence], default_gen: torch.Generator
) -> list[int]:
    """Draw one token per row from filtered logits, each row from its own generator when seeded.

    Inverse transform: one uniform number per row, located in the row's cumulative
    distribution. Rows without a seed take theirs from the engine's generator; a seeded row
    from its own, so its tokens do not depend on the batch it runs in (and no per-row
    multinomial call costs a step its time).
    """
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
    u = torch.empty(len(seqs), device=dev)
    unseeded = [i for i, s in enumerate(seqs) if s.generator is None]
    if unseeded:
        u[unseeded] = torch.rand(len(unseeded), generator=default_gen, device=dev)
    for i, s in enumerate(seqs):
        if s.generator is not None:
            u[i] = torch.rand(1, generator=s.generator, device=dev)[0]
    cdf = probs.cumsum(dim=-1)
    picks = torch.searchsorted(cdf, u[:, None] * cdf[:, -1:], right=True).squeeze(1)
    picks = picks.clamp_(max=probs.shape[-1] - 1)
    # Rounding at the very top of a cdf can land past the last token with any mass.
    empty = probs.gather(1, picks[:, None]).squeeze(1) == 0
    if bool(empty.any()):
        picks = torch.where(empty, probs.argmax(dim=-1), picks)
    return picks.tolist()


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
