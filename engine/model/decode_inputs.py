"""What a sub-batch's rows feed in one decode step, and the attention mask for it.

A row feeds its pending token, or, in contrastive search, its k candidates, all at the row's next
position, or, under speculative decoding (engine.sample.speculative), its pending token and its
draft at consecutive positions. Attention sees `slots` queries per row (the most any row feeds;
fewer-fed rows are padded there alone, the linear layers never see the padding), and each query
attends to the row's context plus new columns: its own alone (a diagonal, so candidates never see
each other), or, for a draft, every one up to its own (causal). The row's KV is read in place,
in its sub-batch's slab.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kv.batch import SubBatch
from engine.staging import split_to_device


@dataclass
class DecodeFeed:
    """A sub-batch's tokens for one decode step, row by row."""

    ids: torch.Tensor  # [tokens]
    positions: torch.Tensor  # [tokens]: each row's next position, for each token it feeds
    first: torch.Tensor  # [rows]: the index in `ids` of each row's first token
    first_host: list[int]  # the same, on the host (the engine reads it without a device sync)
    slots: int  # queries per row in attention: the most tokens any row feeds
    # Each token's place in the [rows * slots] attention layout, when some row feeds fewer than
    # `slots` (None: the tokens fill it exactly).
    index: torch.Tensor | None
    context: torch.Tensor  # [rows, width] bool: the slab columns each row attends to
    # Speculative decoding: each row's draft, fed after its pending token (every row of the
    # sub-batch has one, or none feeds any); None: no draft fed.
    drafts: list[list[int]] | None = None

    @classmethod
    def of(cls, sb: SubBatch) -> DecodeFeed:
        device = sb.cache.layers[0].device
        drafts = [s.draft for s in sb.seqs]
        if not all(drafts):  # a row without a draft would keep every row to none
            drafts = None
            for s in sb.seqs:
                s.draft = []
        fed = [s.candidates.ids if s.candidates is not None else [s.pending_token, *s.draft]
               for s in sb.seqs]
        sizes = [len(f) for f in fed]
        starts = [0]
        for n in sizes[:-1]:
            starts.append(starts[-1] + n)
        tokens = starts[-1] + sizes[-1]
        # A draft's tokens sit at consecutive positions; candidates share the next one.
        offsets = [j for n in sizes for j in range(n)] if drafts else [0] * tokens
        counts, lengths, ids, first, offset = split_to_device(
            [sizes, sb.lengths(), [t for f in fed for t in f], starts, offsets], device)
        slots = max(sizes)
        index = None
        if tokens != slots * sb.size:
            row = torch.arange(sb.size, device=device).repeat_interleave(counts,
                                                                        output_size=tokens)
            index = row * slots + torch.arange(tokens, device=device) - first[row]
        context = sb.decode_mask(lengths)[:, :-1]
        positions = lengths.repeat_interleave(counts, output_size=tokens) + offset
        return cls(ids, positions, first, starts, slots, index, context, drafts)

    @property
    def tokens(self) -> int:
        return len(self.ids)

    def padded(self, packed: torch.Tensor) -> torch.Tensor:
        """[tokens, ...] → [rows, slots, ...], padding slots with zeros."""
        rows = len(self.first)
        if self.index is None:
            return packed.view(rows, self.slots, *packed.shape[1:])
        out = packed.new_zeros((rows * self.slots, *packed.shape[1:]))
        out[self.index] = packed
        return out.view(rows, self.slots, *packed.shape[1:])

    def packed(self, padded: torch.Tensor) -> torch.Tensor:
        """[rows, slots, ...] → [tokens, ...]: the padding slots dropped."""
        flat = padded.flatten(0, 1)
        return flat if self.index is None else flat[self.index]

    def one_token_mask(self) -> torch.Tensor:
        """[rows, width + 1] bool, when every row feeds one token: its context and the new
        column."""
        return torch.cat([self.context, self.context.new_ones((len(self.first), 1))], dim=1)

    def allowed(self) -> torch.Tensor:
        """[rows, 1, slots, width + slots] bool: each query sees its row's context and its own
        new column, or with drafts every new column up to its own."""
        rows, width = self.context.shape
        own = torch.ones((self.slots, self.slots), dtype=torch.bool,
                         device=self.context.device).tril_()
        if self.drafts is None:
            own = torch.eye(self.slots, dtype=torch.bool, device=self.context.device)
        return torch.cat([self.context[:, None, :].expand(rows, self.slots, width),
                          own[None].expand(rows, -1, -1)], dim=-1)[:, None]

    def mask(self, dtype: torch.dtype) -> torch.Tensor:
        """`allowed` as an additive mask."""
        return additive(self.allowed(), dtype)


def additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True attends) as an additive one of `dtype`: PyTorch's CPU flash kernel
    runs faster with it."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)
