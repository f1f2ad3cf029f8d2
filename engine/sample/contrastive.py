"""Contrastive search (Su et al., 2022): model confidence minus a degeneration penalty.

score(v) = (1 - alpha) * p(v | context) - alpha * max_j cos(h_v, h_j), over the top-k candidates v,
where h_j are the last layer's hidden states of the context tokens and h_v is the last layer's
hidden state of v placed after the context.

A row's step: its candidates (proposed from the previous step's logits) are all fed at the row's
next position in the step's forward, each attending to the row's context and itself; the best
candidate is chosen from their hidden states, and its K/V, hidden state and next-token logits are
kept as the row's own (as transformers does), so a token costs k fed tokens, not 1 + k.
"""

from __future__ import annotations

import torch


def contrastive_scores(
    probs: torch.Tensor,
    candidate_hidden: torch.Tensor,
    context_hidden: list[torch.Tensor],
    alpha: torch.Tensor,
) -> torch.Tensor:
    """Scores [rows, k] of each row's candidates: `probs` [rows, k], `candidate_hidden`
    [rows, k, d], each row's context states [t_i, d], `alpha` [rows]. The penalty is one batched
    product over the rows, contexts padded to the longest."""
    cand = torch.nn.functional.normalize(candidate_hidden.float(), dim=-1)
    ctx = torch.nn.utils.rnn.pad_sequence(
        [torch.nn.functional.normalize(h.float(), dim=-1) for h in context_hidden],
        batch_first=True)
    lengths = torch.tensor([len(h) for h in context_hidden], device=ctx.device)
    padding = torch.arange(ctx.shape[1], device=ctx.device)[None, :] >= lengths[:, None]
    sims = torch.bmm(cand, ctx.transpose(1, 2)).masked_fill_(padding[:, None, :], float("-inf"))
    penalty = sims.max(dim=-1).values
    return (1.0 - alpha[:, None]) * probs.float() - alpha[:, None] * penalty
