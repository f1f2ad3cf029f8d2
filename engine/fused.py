"""One forward call for every sub-batch: batched linear layers, attention per sub-batch.

Splitting the rolling batch saves the KV padding of mixed lengths, but on a CPU one forward per
sub-batch re-reads every weight once per sub-batch. Only attention depends on the KV layout, so
the fused decode runs the model once over all rows and splits the work at attention alone: each
sub-batch's rows attend over their own slab with their own padding mask.

It plugs into transformers through its public extension points: an attention function
registered in `AttentionInterface` (which hands plain tensors to the model's original
implementation, so every other forward is unchanged) and a `Cache` whose layers return the
per-sub-batch KV as a `GroupedKV`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, DynamicLayer
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from engine.batch import SubBatch

FUSED_ATTENTION = "seqgate_fused"


@dataclass
class GroupedKV:
    """One layer's keys and values, per sub-batch, after this step's token was written."""

    keys: list[torch.Tensor]  # [rows, kv_heads, width + 1, dim] per sub-batch
    values: list[torch.Tensor]
    masks: list[torch.Tensor]  # [rows, 1, 1, width + 1] bool, True where a row attends
    rows: list[int]  # rows per sub-batch, in the order the queries are stacked


class FusedLayer(DynamicLayer):
    """Routes one layer's new KV rows to each sub-batch's slab layer."""

    def __init__(self, sub_batches: list[SubBatch], layer_idx: int, masks: list[torch.Tensor]):
        super().__init__()
        self.slabs = [sb.cache.layers[layer_idx] for sb in sub_batches]
        self.rows = [sb.size for sb in sub_batches]
        self.masks = masks
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        keys, values, start = [], [], 0
        for slab, n in zip(self.slabs, self.rows):
            k, v = slab.update(key_states[start : start + n], value_states[start : start + n])
            keys.append(k)
            values.append(v)
            start += n
        grouped = GroupedKV(keys, values, self.masks, self.rows)
        return grouped, grouped

    def get_seq_length(self) -> int:
        return max(slab.length for slab in self.slabs)


class FusedCache(Cache):
    """The cache handed to the fused forward: one FusedLayer per model layer."""

    def __init__(self, sub_batches: list[SubBatch]):
        masks = [sb.decode_mask()[:, None, None, :] for sb in sub_batches]
        n_layers = len(sub_batches[0].cache.layers)
        layers = [FusedLayer(sub_batches, i, masks) for i in range(n_layers)]
        super().__init__(layers=layers)


def install(model: torch.nn.Module) -> bool:
    """Route `model`'s attention through the fused dispatcher. False when the model does not use
    transformers' attention interface (then the engine runs one forward per sub-batch)."""
    if not getattr(model, "_supports_attention_backend", False):
        return False
    original = model.config._attn_implementation
    if original == FUSED_ATTENTION:
        return True
    inner = ALL_ATTENTION_FUNCTIONS.get_interface(original, None) if original != "eager" else None
    if inner is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        inner = sdpa_attention_forward if original == "sdpa" else _eager(model)
    mask_fn = ALL_MASK_ATTENTION_FUNCTIONS[original if original in ("sdpa", "eager") else "sdpa"]

    def attention(module, query, key, value, attention_mask, **kwargs):
        if not isinstance(key, GroupedKV):
            return inner(module, query, key, value, attention_mask, **kwargs)
        outs, start = [], 0
        for k, v, mask, n in zip(key.keys, key.values, key.masks, key.rows):
            out, _ = inner(module, query[start : start + n], k, v, mask, **kwargs)
            outs.append(out)
            start += n
        return torch.cat(outs), None

    AttentionInterface.register(FUSED_ATTENTION, attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(FUSED_ATTENTION, mask_fn)
    model.set_attn_implementation(FUSED_ATTENTION)
    return model.config._attn_implementation == FUSED_ATTENTION


def _eager(model: torch.nn.Module):
    module = __import__(type(model).__module__, fromlist=["eager_attention_forward"])
    return module.eager_attention_forward
