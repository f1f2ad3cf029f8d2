"""What enters the prefix cache, and when: each prompt once prefilled, and each sequence that
ended normally, with its answer (RadixAttention caches finished requests too: a chat client sends
the answer back as history in its next turn). Aborted and failed sequences are not cached: a
client that gave up is unlikely to send that history back."""

from __future__ import annotations

import torch

from engine.kv.batch import SubBatch
from engine.kv.radix_cache import PrefixEntry, RadixPrefixCache
from engine.kv.slabs import RowKV, row_from_cache
from engine.request.job import Job, SeqStatus

CACHED_ENDINGS = frozenset({SeqStatus.EOS, SeqStatus.STOP_TOKEN, SeqStatus.STOP_STRING,
                            SeqStatus.LENGTH, SeqStatus.GRAMMAR})


class CachePolicy:
    """Inserts into `cache` what the step produced that a later request may start with."""

    def __init__(self, cache: RadixPrefixCache):
        self.cache = cache

    def prompt_done(self, job: Job, hidden: torch.Tensor | None) -> None:
        """A prompt's KV (and its hidden states, for contrastive search) is complete."""
        if self.cache.capacity_bytes:
            row = row_from_cache(job.kv)
            self.cache.insert(job.fill_ids, PrefixEntry(row.keys, row.values, hidden,
                                                          row.length))

    def step_done(self, sub_batches: list[SubBatch]) -> None:
        """Cache every sequence that ended this step normally, prompt and answer. Its KV is still
        in the batch until the next step's regroup drops the row."""
        if not self.cache.capacity_bytes:
            return
        for sb in sub_batches:
            for i, s in enumerate(sb.seqs):
                if s.status not in CACHED_ENDINGS or s.kv_len <= len(s.job.prompt_ids):
                    continue
                ids = (s.job.prompt_ids + s.generated)[: s.kv_len]
                hidden = s.hidden if s.hidden is not None and len(s.hidden) == s.kv_len else None
                row = sb.row(i)
                if len(ids) < row.length:  # a speculative step kept columns past its stop
                    row = RowKV([k[:, : len(ids)] for k in row.keys],
                                [v[:, : len(ids)] for v in row.values], len(ids))
                self.cache.insert(ids, PrefixEntry(row.keys, row.values, hidden, row.length))
