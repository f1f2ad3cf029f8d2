"""Contrastive search (Su et al., 2022): model confidence minus a degeneration penalty.

score(v) = (1 - alpha) * p(v | context) - alpha * max_j cos(h_v, h_j), over the top-k candidates v,
where h_j are the last layer's hidden states of the context tokens and h_v is the last layer's
hidden state of v placed after the context.
"""

from __future__ import annotations

import torch


def degeneration_penalty(
    candidate_hidden: torch.Tensor, context_hidden: torch.Tensor
) -> torch.Tensor:
    """max cosine similarity of each candidate [k, d] to any context state [t, d] → [k]."""
    cand = torch.nn.functional.normalize(candidate_hidden.float(), dim=-1)
    ctx = torch.nn.functional.normalize(context_hidden.float(), dim=-1)
    return (cand @ ctx.T).max(dim=-1).values


def contrastive_choice(
    probs: torch.Tensor,
    candidate_ids: torch.Tensor,
    candidate_hidden: torch.Tensor,
    context_hidden: torch.Tensor,
    alpha: float,
) -> int:
    """The candidate with the best contrastive score; `probs` are the candidates' probabilities
    [k].
    """
    penalty = degeneration_penalty(candidate_hidden, context_hidden)
    scores = (1.0 - alpha) * probs.float() - alpha * penalty
    return int(candidate_ids[int(torch.argmax(scores))])
