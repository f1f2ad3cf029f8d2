"""Logits → tokens for a sub-batch: penalties, bias, filters, seeded draws, logprobs. Pure tensor
code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.outputs import TokenLogprob
from engine.staging import to_device

if TYPE_CHECKING:
    from engine.request.job import Sequence


# Columns of a row whose maximum `greedy_tokens` takes at once: few enough that the argmax
# within a chunk is cheap, enough that the one over the chunks' maxima is too. A vocabulary
# that is not a multiple of it goes to `argmax` whole.
_ARGMAX_CHUNK = 64


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(dim=-1)`: each row's first largest column (its first NaN, if any).

    On the CPU, ATen's argmax keeps an index beside every comparison and runs several times
    slower than a plain maximum (docs/benchmarks/speed.md). So the row is cut into chunks of
    64 columns: their maxima (NaN where a chunk holds one), the first chunk holding the
    largest of those (or the first NaN), then the first largest column (or NaN) within it,
    which is the row's."""
    if logits.device.type != "cpu" or logits.dim() != 2 or logits.shape[-1] % _ARGMAX_CHUNK \
            or not logits.is_contiguous():
        return logits.argmax(dim=-1)
    rows, vocab = logits.shape
    chunks = logits.view(rows, vocab // _ARGMAX_CHUNK, _ARGMAX_CHUNK)
    first = chunks.amax(dim=-1).argmax(dim=-1)
    within = chunks[torch.arange(rows), first].argmax(dim=-1)
    return first * _ARGMAX_CHUNK + within


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence], vocab: int) -> torch.Tensor:
    """Repetition (HF: prompt and output), presence and frequency (OpenAI: output only) penalties,
    for all penalised rows at once.

    Returns `logits` unchanged when no row asks for a penalty, so the common case costs nothing.
    """
    rows = [i for i, s in enumerate(seqs) if s.params.presence_penalty
            or s.params.frequency_penalty or s.params.repetition_penalty != 1.0]
    if not rows:
        return logits
    dev = logits.device
    for i in rows:
        _track(seqs[i], vocab, dev)
    counts = torch.stack([seqs[i].counts for i in rows])
    prompt = torch.stack([seqs[i].prompt_seen for i in rows])
    rep, freq, pres = to_device([[seqs[i].params.repetition_penalty for i in rows],
                                 [seqs[i].params.frequency_penalty for i in rows],
                                 [seqs[i].params.presence_penalty for i in rows]],
                                dev, torch.float32)[:, :, None]
    at = to_device(rows, dev)
    vals = logits.index_select(0, at)
    penalised = torch.where(vals > 0, vals / rep, vals * rep)
    vals = torch.where(prompt | (counts > 0), penalised, vals)
    vals = vals - freq * counts - pres * (counts > 0).float()
    logits = logits.clone()
    logits.index_copy_(0, at, vals.to(logits.dtype))
    return logits


def _track(s: Sequence, vocab: int, device: torch.device) -> None:
    """A penalised row's token counts over its output and the prompt's tokens as a mask, made
    the first time it is penalised (the decoder counts each token it accepts from then on)."""
    if s.counts is not None:
        return
    s.counts = torch.zeros(vocab, dtype=torch.float32, device=device)
    if s.generated:
        s.counts.index_add_(0, to_device(s.generated, device),
                            torch.ones(len(s.generated), device=device))
    s.prompt_seen = torch.zeros(vocab, dtype=torch.bool, device=device)
    if s.params.repetition_penalty != 1.0:
        s.prompt_seen[to_device(sorted(set(s.job.prompt_ids)), device)] = True


def apply_logit_bias(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    pairs = [(i, tok, b) for i, s in enumerate(seqs) for tok, b in s.params.logit_bias.items()]
    if not pairs:
        return logits
    rows, ids, bias = zip(*pairs)
    at = to_device([rows, ids], logits.device)
    logits = logits.clone()
    logits.index_put_((at[0], at[1]), to_device(bias, logits.device, logits.dtype),
                      accumulate=True)
    return logits


def block_stop_tokens(
    logits: torch.Tensor, seqs: list[Sequence], eos_ids: list[int]
) -> torch.Tensor:
    """Before `min_new_tokens` are out, EOS and stop tokens cannot be chosen."""
    pairs = [(i, t) for i, s in enumerate(seqs) if len(s.generated) < s.params.min_new_tokens
             for t in set(eos_ids) | set(s.params.stop_token_ids)]
    if not pairs:
        return logits
    at = to_device(list(zip(*pairs)), logits.device)
    logits = logits.clone()
    # The value made where the logits are: a Python float would be copied from the host.
    logits.index_put_((at[0], at[1]), torch.full((), float("-inf"), device=logits.device))
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
    any_min_p: bool | None = None,
    ranked: list[int] | None = None,
    max_top_k: int | None = None,
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
    # Which filters are on is known on the host where the caller passes it (no device sync).
    if any_min_p if any_min_p is not None else bool((min_p > 0).any()):
        probs = scaled.softmax(dim=-1)
        low = probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True)
        out = scaled.masked_fill(low, float("-inf"))  # never the most likely token
    if ranked is None:
        ranked = ((top_k > 0) | (top_p < 1.0)).nonzero().squeeze(1).tolist()
    if ranked:
        rows = to_device(ranked, logits.device)
        cut = _cut_ranked(scaled[rows], top_k[rows], top_p[rows],
                          int(top_k.max()) if max_top_k is None else max_top_k)
        out = out.clone() if out is scaled else out
        out[rows] = out[rows].masked_fill(cut, float("-inf"))
    return out


def _cut_ranked(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                max_top_k: int) -> torch.Tensor:
    """Where top-k or top-p removes a token ([rows, vocab] bool). The ranks and the mass before
    each token come from a partial sort of the CANDIDATES most likely tokens, or a full sort for
    rows whose cut may lie beyond them. On a GPU the whole vocabulary is always sorted: that is
    cheap there, and asking whether the candidates suffice would wait for the device."""
    vocab = logits.shape[-1]
    k = vocab if logits.device.type != "cpu" else min(vocab, max(CANDIDATES, max_top_k))
    values, order = torch.topk(logits, k, dim=-1)  # sorted, most likely first
    probs = (values - torch.logsumexp(logits, dim=-1, keepdim=True)).exp()
    mass = probs.cumsum(dim=-1)
    # Beyond the candidates, tokens survive only where neither filter has cut by then.
    if k < vocab and bool(((top_k == 0) & (mass[:, -1] < top_p)).any()):
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


def filtered_probs(logits: torch.Tensor, params: list) -> torch.Tensor:
    """Each row's sampling distribution: its logits under its own temperature, top-k, top-p
    and min-p (`params[i]` the row's SamplingParams)."""
    temperature, top_k, top_p, min_p = to_device(
        [[max(x.temperature, 1e-5) for x in params], [x.top_k for x in params],
         [x.top_p for x in params], [x.min_p for x in params]], logits.device, torch.float32)
    return filter_logits(logits, temperature, top_k.long(), top_p, min_p,
                         any_min_p=any(x.min_p > 0 for x in params),
                         ranked=[i for i, x in enumerate(params) if x.top_k > 0 or x.top_p < 1.0],
                         max_top_k=max(x.top_k for x in params)).softmax(dim=-1)


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
    probs = filtered_probs(logits, [s.params for s in seqs])
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
    return torch.where(empty, probs.argmax(dim=-1), picks).tolist()


def logprobs_for(logits: torch.Tensor, tokens: list[int], top_n: list[int],
                 ranks: bool = False) -> list[TokenLogprob]:
    """The chosen tokens' log-probabilities (and top alternatives, and with `ranks` each
    token's rank) under `logits`."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, to_device(tokens, lp.device)[:, None]).squeeze(1)
    k = max(top_n) if top_n else 0
    rank = ((lp > chosen[:, None]).sum(1) + 1).tolist() if ranks else [None] * len(tokens)
    if not k:
        return [TokenLogprob(tok, c, [], r) for tok, c, r in zip(tokens, chosen.tolist(), rank)]
    tops = lp.topk(k, dim=-1)
    # One copy to the host of everything the rows report.
    host = torch.cat([chosen[:, None], tops.values, tops.indices.to(lp.dtype)], dim=1).tolist()
    return [TokenLogprob(tok, row[0], [(int(t), v) for t, v in zip(row[1 + k:1 + k + n],
                                                                    row[1:1 + n])], r)
            for tok, row, n, r in zip(tokens, host, top_n, rank)]
