"""One forward call for the whole step: every sub-batch's decode tokens and every prefill chunk.

Splitting the rolling batch saves the KV padding of mixed lengths, and chunking prompts keeps
running streams from stalling behind a long prefill; but on a CPU every extra forward re-reads
every weight. Only attention depends on the KV layout, so the step's tokens are packed into one
sequence ([1, tokens]) for the linear layers, and the work is split at attention alone: each
group (a sub-batch's rows, one token each, or a prompt chunk) attends over its own KV with its
own mask.

It plugs into transformers through its public extension points: an attention function
registered in `AttentionInterface` (which hands plain tensors to the model's original
implementation, so every other forward is unchanged) and a `Cache` whose layers return the
per-group KV as a `GroupedKV`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from engine.model.decode_inputs import additive

if TYPE_CHECKING:
    from engine.model.decode_inputs import DecodeFeed

# The names the dispatcher is registered under: one per mask kind, boolean (SDPA's, also for
# other attentions) or additive (eager's). A name is global to the process, so what each model's
# attention runs is kept on its own modules (`_CALL_ATTR`). Neither says "sdpa": transformers
# checks a model's SDPA support for any name that does.
FUSED_ATTENTION = "seqgate_fused"
_FUSED_ADDITIVE = "seqgate_fused_additive"
# Attribute of an attention layer holding the compiled decode kernel it runs
# (engine.kernels.native).
DECODE_KERNEL_ATTR = "_seqgate_decode_kernel"
# Attribute of a model holding how many of its layers have the decode kernel.
_KERNEL_LAYERS_ATTR = "_seqgate_decode_kernel_layers"
# Attribute of a model holding the attention function `install` dispatches groups to.
_INNER_ATTR = "_seqgate_fused_inner"
# Attribute of each of a model's modules holding the function its attention runs per group.
_CALL_ATTR = "_seqgate_fused_call"


@dataclass
class Group:
    """One group's place in the packed sequence and the cache its KV goes to.

    A decode group is a sub-batch: `tokens` rows, one query each, over its slab; or, when rows
    feed drafts or contrastive candidates, `feed.slots` queries per row, laid out by its
    `DecodeFeed`. A prefill chunk is one row of `tokens` queries over its prompt's KV so far.
    """

    cache: Cache
    start: int  # offset in the packed token dimension
    tokens: int
    rows: int
    mask: torch.Tensor  # [rows, 1, queries per row, kv columns]: bool (True attends) or additive
    feed: DecodeFeed | None = None  # decode groups: what each row fed

    @property
    def _slotted(self) -> bool:
        return self.feed is not None and self.feed.slots > 1

    def split(self, packed: torch.Tensor) -> torch.Tensor:
        """This group's part of a packed [1, heads, tokens, dim] tensor as [rows, heads, q, dim].
        """
        part = packed[:, :, self.start : self.start + self.tokens]
        if self._slotted:  # [tokens, heads, dim] → [rows, slots, heads, dim], padded
            return self.feed.padded(part[0].transpose(0, 1)).transpose(1, 2)
        return part.transpose(0, 2) if self.rows > 1 else part

    def join(self, out: torch.Tensor) -> torch.Tensor:
        """Attention output [rows, q, heads, dim] back to the packed layout [1, tokens, ...]."""
        if self._slotted:
            return self.feed.packed(out)[None]
        return out.transpose(0, 1) if self.rows > 1 else out


@dataclass
class GroupedKV:
    """One layer's keys and values, per group, after this step's tokens were written."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    groups: list[Group]


class PackedLayer(DynamicLayer):
    """Routes one layer's new KV to each group's cache."""

    def __init__(self, groups: list[Group], layer_idx: int):
        super().__init__()
        self.groups = groups
        self.layer_idx = layer_idx
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        keys, values = [], []
        for g in self.groups:
            k, v = g.cache.update(g.split(key_states), g.split(value_states), self.layer_idx)
            keys.append(k)
            values.append(v)
        grouped = GroupedKV(keys, values, self.groups)
        return grouped, grouped

    def get_seq_length(self) -> int:
        return 0  # positions come from position_ids; nothing reads a packed cache's length


class PackedCache(Cache):
    """The cache handed to the packed forward: one PackedLayer per model layer."""

    def __init__(self, groups: list[Group], n_layers: int):
        super().__init__(layers=[PackedLayer(groups, i) for i in range(n_layers)])


# Passed as the packed forward's attention mask: a 4D mask is used as given, so transformers
# builds none (every group brings its own); the attention function below never reads it.
NO_MASK = torch.ones((1, 1, 1, 1), dtype=torch.bool)


def install(model: torch.nn.Module) -> bool:
    """Route `model`'s attention through the packed dispatcher. False when the model does not
    use transformers' attention interface (then the engine runs one forward per group).

    Models in one process may run different attention functions (SDPA, eager, a model's own):
    each model's is kept on its modules, so installing on one never redirects another."""
    if not getattr(model, "_supports_attention_backend", False):
        return False
    original = model.config._attn_implementation
    if original in (FUSED_ATTENTION, _FUSED_ADDITIVE):
        return True
    if original == "sdpa":
        inner = _sdpa
    elif original == "eager":
        inner = _eager(model)
    else:
        inner = ALL_ATTENTION_FUNCTIONS.get_interface(original, None) or _eager(model)
    additive = original == "eager"
    name = _FUSED_ADDITIVE if additive else FUSED_ATTENTION
    call = inner if inner is _sdpa else _widening(inner)
    setattr(model, _INNER_ATTR, inner)
    for module in model.modules():
        setattr(module, _CALL_ATTR, call)
    AttentionInterface.register(name, _dispatcher(_module_eager if additive else _plain_sdpa))
    ALL_MASK_ATTENTION_FUNCTIONS.register(
        name, ALL_MASK_ATTENTION_FUNCTIONS["eager" if additive else "sdpa"])
    model.set_attn_implementation(name)
    return model.config._attn_implementation == name


def _dispatcher(default):
    """The registered attention: each group of a packed step through the attention function
    `install` kept on the attention module, or a plain call straight to it; a module made
    after `install` (a model built from an installed one's config) takes `default`."""
    def dispatch(module, query, key, value, attention_mask, **kwargs):
        call = getattr(module, _CALL_ATTR, None) or default(module)
        return _grouped(call, module, query, key, value, attention_mask, **kwargs)

    return dispatch


def _module_eager(module):
    """transformers' eager attention of `module`'s model family, widening a narrower KV."""
    return _widening(_eager(module))


def _plain_sdpa(module):
    return _sdpa


def _grouped(call, module, query, key, value, attention_mask, **kwargs):
    if not isinstance(key, GroupedKV):
        return call(module, query, key, value, attention_mask, **kwargs)
    outs = []
    for g, k, v in zip(key.groups, key.keys, key.values):
        out, _ = call(module, g.split(query), k, v, g.mask, **kwargs)
        outs.append(g.join(out))
    return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)), None


def _in_query_dtype(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The KV in the query's dtype: a KV cache narrower than the model
    (engine.model.prepare._kv_dtype) widened for an attention that takes one dtype."""
    if key.dtype == query.dtype:
        return key, value
    return key.to(query.dtype), value.to(query.dtype)


def _widening(inner):
    """`inner` (an attention function other than `_sdpa`, which widens only where it does not
    run the decode kernel) given the KV in the query's dtype."""
    def attention(module, query, key, value, *args, **kwargs):
        return inner(module, query, *_in_query_dtype(query, key, value), *args, **kwargs)

    return attention


def plain_attention(model: torch.nn.Module) -> bool:
    """Whether `install` put the packed dispatcher over transformers' SDPA or eager attention,
    which read nothing from a forward's keyword arguments beyond the mask and scaling (the
    flash implementations also read position ids)."""
    inner = getattr(model, _INNER_ATTR, None)
    return inner is not None and (inner is _sdpa or inner.__name__ == "eager_attention_forward")


def _sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' SDPA attention, with one query per row run on the key-value heads.

    With grouped-query attention and no mask (a step of one sub-batch without padding, say one
    row, runs its own forward, and transformers drops the all-true mask), transformers asks the
    kernel for `enable_gqa`, whose CPU path is several times slower for a single query than
    the same product with the query heads of a group stacked as rows (SmolLM2-135M, bf16, 2
    threads, 300 keys: 273 vs 85 µs per layer). transformers stacks them itself when a mask is
    given; this does it in every case where the mask is shared by all heads. Where
    `use_decode_kernel` gave the layer engine.kernels.native's kernel and the kernel
    takes the call (one query per row, or up to 16 with their boolean mask: a draft's, a
    contrastive row's candidates, a short prompt chunk run alone), it runs instead."""
    groups = getattr(module, "num_key_value_groups", 1)
    rows, heads, q_len, dim = query.shape
    plain = not (dropout or kwargs.get("softcap") is not None
                 or kwargs.get("position_bias") is not None)
    kernel = getattr(module, DECODE_KERNEL_ATTR, None)
    boolean = attention_mask is not None and attention_mask.dtype == torch.bool
    # Several queries a row without a mask would be causal in transformers' SDPA; the kernel
    # takes them only with their boolean mask (a draft's or contrastive candidates' rows, or a
    # short prompt chunk run alone, whose causal mask transformers builds as bool).
    if kernel is not None and plain and (q_len == 1 or boolean):
        # The kernel alone says whether a call fits it (None: it does not), so no check kept
        # here could disagree with its own. It widens a narrower KV cache as it reads.
        out = kernel.decode_attention(query, key, value, attention_mask,
                                      scaling if scaling is not None else dim ** -0.5)
        if out is not None:
            return out, None
    if q_len > 1 and boolean and query.device.type == "cpu":
        # Several queries the kernel did not take (or no kernel): the flash kernel's mask.
        attention_mask = additive(attention_mask, query.dtype)
    key, value = _in_query_dtype(query, key, value)
    if (q_len > 1 and plain and groups > 1 and attention_mask is not None
            and attention_mask.shape[1] == 1 and query.device.type == "cpu"):
        # A prompt chunk with its mask: transformers repeats the KV heads (`repeat_kv`, a copy)
        # for masked GQA, since CUDA kernels fall back to the math kernel on `enable_gqa` with a
        # mask. The CPU's flash kernel takes both, with the same result bit for bit and 8-30%
        # less time on SmolLM2's chunks (docs/benchmarks/speed.md).
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    if (q_len != 1 or not plain
            or (attention_mask is not None and attention_mask.shape[1] != 1)):
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)
    if groups <= 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(
        query.reshape(rows, heads // groups, groups, dim), key, value, attn_mask=attention_mask,
        scale=scaling)
    return out.reshape(rows, 1, heads, value.shape[-1]), None


def use_decode_kernel(model: torch.nn.Module, kernel, kv_dtype: torch.dtype | None = None
                      ) -> int:
    """Have `model`'s attention layers run decode steps (one query per row, or a draft's few)
    through `kernel` (engine.kernels.native's operators; None: PyTorch's SDPA) where it can:
    the packed dispatcher runs SDPA (`install` on a model whose attention was transformers'
    SDPA) and the kernel is built for the model's dtype with the KV's (`kv_dtype`, default the
    model's), the layer's head size and query heads per KV head. Returns how many layers do."""
    layers = 0
    for module, fits in _kernel_fits(model, kernel, kv_dtype):
        setattr(module, DECODE_KERNEL_ATTR, kernel if fits else None)
        layers += fits
    setattr(model, _KERNEL_LAYERS_ATTR, layers)
    return layers


def decode_kernel_layers(model: torch.nn.Module) -> int:
    """How many of `model`'s attention layers `use_decode_kernel` gave the kernel."""
    return getattr(model, _KERNEL_LAYERS_ATTR, 0)


def decode_kernel_reads(model: torch.nn.Module, kernel, kv_dtype: torch.dtype) -> bool:
    """Whether `use_decode_kernel(model, kernel, kv_dtype)` would give some layer the kernel
    (nothing is changed)."""
    return any(fits for _, fits in _kernel_fits(model, kernel, kv_dtype))


def _kernel_fits(model: torch.nn.Module, kernel, kv_dtype: torch.dtype | None):
    """(attention layer, whether `kernel` takes its decode steps' calls), for each layer."""
    if getattr(model, _INNER_ATTR, None) is not _sdpa:
        kernel = None
    dtype = getattr(model, "dtype", None) or next(model.parameters()).dtype
    for module in model.modules():
        groups = getattr(module, "num_key_value_groups", None)
        if groups is None:
            continue
        dim = getattr(module, "head_dim", None)
        yield module, (kernel is not None and dim is not None
                       and kernel.instantiated(dtype, dim, groups, kv_dtype or dtype))


def _eager(model: torch.nn.Module):
    """transformers' eager attention of the family `model` (or one of its modules) is of."""
    module = __import__(type(model).__module__, fromlist=["eager_attention_forward"])
    return module.eager_attention_forward
