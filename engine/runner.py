"""ModelRunner: turns prompts and sub-batches into logits (and hidden states when asked). No
policy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicCache

from engine.batch import RowKV, SubBatch
from engine.fused import FusedCache
from engine.radix_cache import PrefixEntry


@dataclass
class PrefillResult:
    """A prompt's KV (a batch-1 DynamicCache), the logits for its first new token, and hidden
    states.
    """

    cache: DynamicCache
    logits: torch.Tensor  # [vocab]
    hidden: torch.Tensor | None  # [prompt tokens, hidden] (last layer), when asked
    length: int


class ModelRunner:
    """Owns the model's forward calls: chunked prefill, batched decode, contrastive look-ahead."""

    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.model = model
        self.device = device
        self.vocab_size = model.get_output_embeddings().weight.shape[0]

    def _forward(self, **kwargs):
        return self.model(use_cache=True, return_dict=True, **kwargs)

    def prefill(
        self,
        ids: list[int],
        prefix: PrefixEntry | None,
        chunk: int,
        want_hidden: bool,
    ) -> PrefillResult:
        """Run `ids` through the model in chunks of at most `chunk` tokens.

        With `prefix`, its KV stands for the first `prefix.length` ids and only the rest is
        computed.
        """
        end = len(ids)
        start = 0
        hidden_parts: list[torch.Tensor] = []
        if prefix is not None:
            cache = DynamicCache(
                ddp_cache_data=[(k[None], v[None]) for k, v in zip(prefix.keys, prefix.values)]
            )
            start = prefix.length
            if want_hidden and prefix.hidden is not None:
                hidden_parts.append(prefix.hidden)
        else:
            cache = DynamicCache()
        logits = None
        while start < end:
            stop = min(end, start + chunk)
            out = self._forward(
                input_ids=torch.tensor([ids[start:stop]], device=self.device),
                attention_mask=torch.ones((1, stop), dtype=torch.long, device=self.device),
                position_ids=torch.arange(start, stop, device=self.device)[None],
                past_key_values=cache,
                output_hidden_states=want_hidden,
                logits_to_keep=1,
            )
            logits = out.logits[0, -1]
            if want_hidden:
                hidden_parts.append(out.hidden_states[-1][0])
            start = stop
        assert logits is not None, "prefill needs at least one token to compute"
        hidden = torch.cat(hidden_parts) if want_hidden else None
        return PrefillResult(cache, logits.float(), hidden, end)

    def decode(self, sb: SubBatch, want_hidden: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Feed every row's pending token; returns logits [rows, vocab] and last-layer hidden
        [rows, hidden].
        """
        sb.reserve(sb.width + 1)
        out = self._forward(
            **sb.decode_inputs(),
            past_key_values=sb.cache,
            output_hidden_states=want_hidden,
        )
        sb.advance()
        hidden = out.hidden_states[-1][:, -1] if want_hidden else None
        return out.logits[:, -1].float(), hidden

    def decode_fused(
        self, sub_batches: list[SubBatch], want_hidden: bool
    ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Feed every sub-batch's pending tokens in one forward (attention still per sub-batch).

        Returns, per sub-batch, what `decode` returns for it.
        """
        for sb in sub_batches:
            sb.reserve(sb.width + 1)
        inputs = [sb.decode_inputs() for sb in sub_batches]
        out = self._forward(
            input_ids=torch.cat([i["input_ids"] for i in inputs]),
            position_ids=torch.cat([i["position_ids"] for i in inputs]),
            past_key_values=FusedCache(sub_batches),
            output_hidden_states=want_hidden,
        )
        logits = out.logits[:, -1].float()
        hidden = out.hidden_states[-1][:, -1] if want_hidden else None
        results, start = [], 0
        for sb in sub_batches:
            sb.advance()
            end = start + sb.size
            results.append((logits[start:end], hidden[start:end] if want_hidden else None))
            start = end
        return results

    def lookahead(self, row: RowKV, candidates: list[int]) -> torch.Tensor:
        """Last-layer hidden states of each candidate token placed after `row` ([k, hidden])."""
        k = len(candidates)
        cache = DynamicCache(
            ddp_cache_data=[
                (kk[None].expand(k, -1, -1, -1), vv[None].expand(k, -1, -1, -1))
                for kk, vv in zip(row.keys, row.values)
            ]
        )
        out = self._forward(
            input_ids=torch.tensor(candidates, device=self.device)[:, None],
            attention_mask=torch.ones((k, row.length + 1), dtype=torch.long, device=self.device),
            position_ids=torch.full((k, 1), row.length, device=self.device),
            past_key_values=cache,
            output_hidden_states=True,
            logits_to_keep=1,
        )
        return out.hidden_states[-1][:, -1]
