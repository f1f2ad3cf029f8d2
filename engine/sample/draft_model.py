"""A draft model for speculative decoding (vLLM's draft-model method, llama.cpp's `-md`): a
smaller causal LM that shares the target's tokenizer proposes each drafting row's next tokens,
its own greedy continuation of the row's context.

A greedy continuation is a point mass for each context, so the verification is the prompt-lookup
one unchanged (engine.sample.speculative): greedy rows keep their output token for token, and
sampled rows keep their distribution by the same rejection sampling.

Each drafting row keeps the draft model's KV of its context in a transformers `DynamicCache`. A
step feeds only what that cache lacks (the tokens the target kept since, and its pending token),
after cutting the cache back to the longest prefix it shares with the row's context (refused
drafts; steps that did not draft). Only rows that draft hold a cache, at most
`speculative_max_rows` of them, and a row's cache goes when it stops running.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.errors import ModelLoadError
from engine.kv.radix_cache import common_prefix
from engine.model.loader import LoadedModel, load_model
from engine.model.prepare import prepare
from engine.model.runner import cache_keyword

log = logging.getLogger("seqgate.speculative")

RowKey = tuple[str, int]  # (job id, sequence index)


@dataclass
class _Row:
    tokens: list[int]  # the context whose KV `cache` holds
    cache: object  # transformers.DynamicCache


class DraftModel:
    """Proposes drafts with a second, smaller model (see the module docstring)."""

    def __init__(self, loaded: LoadedModel, target_vocab: int):
        self.model = loaded.model
        self.device = loaded.device
        self.target_vocab = target_vocab
        self.max_len = getattr(self.model.config, "max_position_embeddings", None) or 2048
        self._cache_keyword = cache_keyword(self.model)
        self._rows: dict[RowKey, _Row] = {}

    @classmethod
    def load(cls, config: EngineConfig, target: LoadedModel,
             target_vocab: int) -> DraftModel | None:
        """The configured draft model, or None when none is set or speculation is off; a draft
        whose tokenizer differs from the target's is refused by name."""
        if not config.speculative_model or not config.num_speculative_tokens:
            return None
        draft_config = dataclasses.replace(
            config, model_id=config.speculative_model, speculative_model=None, revision=None,
            tensor_parallel_degree=1, fuse_sub_batches=False, decode_attention="sdpa")
        loaded = load_model(draft_config)
        if loaded.tokenizer.get_vocab() != target.tokenizer.get_vocab():
            raise ModelLoadError(
                f"option.speculative_model={config.speculative_model!r}: its tokenizer differs "
                f"from the served model's ({target.name}); a draft model must share it")
        # The served model's fast paths for its layers (block kernels, lean layers); its
        # attention stays the model's own, over a transformers cache.
        prepare(loaded, draft_config)
        log.info("draft model %s proposes up to %d tokens per row", loaded.name,
                 config.num_speculative_tokens)
        return cls(loaded, target_vocab)

    @property
    def rows(self) -> int:
        """Rows holding a draft cache."""
        return len(self._rows)

    def keep_only(self, keys: set[RowKey]) -> None:
        """Drop the caches of rows no longer running."""
        for key in [k for k in self._rows if k not in keys]:
            del self._rows[key]

    def propose(self, key: RowKey, context: list[int], k: int) -> list[int]:
        """Up to `k` tokens: the draft model's greedy continuation of `context` (the row's
        prompt, its output and its pending token). A draft that fails (out of memory) is no
        draft: the row decodes on without one, and its cache is built again next time."""
        if k <= 0 or len(context) + k > self.max_len:
            self._rows.pop(key, None)
            return []
        try:
            return self._continue(key, context, k)
        except Exception:
            log.exception("the draft model failed; row %s goes on without a draft", key)
            self._rows.pop(key, None)
            return []

    def _continue(self, key: RowKey, context: list[int], k: int) -> list[int]:
        from transformers import DynamicCache

        row = self._rows.get(key)
        if row is None:
            row = self._rows[key] = _Row([], DynamicCache(config=self.model.config))
        shared = common_prefix(row.tokens, context, len(context) - 1)  # feed one at least
        if shared < len(row.tokens):
            row.cache.crop(shared)
            del row.tokens[shared:]
        feed, out = context[shared:], []
        for _ in range(k):
            ids = torch.tensor([feed], device=self.device)
            logits = self.model(input_ids=ids, use_cache=True, logits_to_keep=1,
                                **{self._cache_keyword: row.cache}).logits
            row.tokens += feed
            token = int(logits[0, -1].argmax())
            if token >= self.target_vocab:  # a padding row of a larger embedding
                break
            out.append(token)
            feed = [token]
        return out

