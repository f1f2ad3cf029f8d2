"""ModelRunner: turns a step's sub-batches and prefill chunks into logits (and hidden states when
asked). No policy.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, DynamicCache

from engine.kv.batch import SubBatch
from engine.kv.radix_cache import PrefixEntry
from engine.kv.rolling_batch import RollingBatch
from engine.kv.slabs import SlabCache, SlabLayer, new_slabs, row_from_cache
from engine.model import cuda_graphs, packed_forward
from engine.model.decode_inputs import DecodeFeed
from engine.sched.plan import PrefillChunk, StepPlan
from engine.staging import to_device


@dataclass
class Chunk:
    """A prefill chunk to compute: prompt tokens `ids` at positions start.., into `cache`."""

    cache: Cache  # the prompt's KV so far (batch 1); the chunk's KV is appended to it
    ids: list[int]
    start: int
    logits: bool  # the prompt's last chunk: its last position's logits are wanted
    hidden: bool  # last-layer hidden states of its positions are wanted (contrastive search)
    # The prompt's tokens that follow its positions, when their log-probabilities are wanted (one
    # per position, one fewer in the prompt's last chunk); None: not wanted.
    targets: list[int] | None = None


# The rate of attention kernels relative to matrix products (`ModelRunner.attention_tokens`).
ATTENTION_RATE = 1 / 3

@dataclass
class GroupResult:
    """What a forward gives one group (or, in its place, the exception that failed it)."""

    logits: torch.Tensor | None  # decode: [fed tokens, vocab]; a chunk: [vocab], or None when
    # it does not end its prompt
    hidden: torch.Tensor | None  # last-layer hidden states of the fed tokens, when asked
    first: torch.Tensor | None = None  # decode: each row's first token in `logits`, `hidden`
    first_host: list[int] | None = None  # the same, on the host
    drafts: list[list[int]] | None = None  # decode: each row's draft fed after its token
    # A chunk with targets: the logits of the positions that predict them, [targets, vocab].
    prompt_logits: torch.Tensor | None = None


def cache_keyword(model: torch.nn.Module) -> str:
    """The keyword `model`'s forward takes its KV cache by: `cache` in transformers releases
    that renamed it, `past_key_values` before (deprecated since, to be removed in 5.40)."""
    params = inspect.signature(type(model).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


class ModelRunner:
    """Owns the model's forward calls: the step's packed forward, or one per group, in which
    contrastive rows feed their candidates (`engine.model.decode_inputs`)."""

    def __init__(self, model: torch.nn.Module, device: torch.device, tp_degree: int = 1):
        self.model = model
        self.device = device
        self._lm_head = model.get_output_embeddings().weight
        self.vocab_size = self._lm_head.shape[0]
        self.dtype = self._lm_head.dtype
        # What new KV buffers are made like (dtype, device): a plain tensor, also under tensor
        # parallelism, where the weights are DTensors but the layers' outputs are local. The
        # KV's dtype may be narrower than the model's (`keep_kv_in`).
        self.kv_like = torch.empty(0, dtype=self.dtype, device=device)
        cfg = model.config.get_text_config()
        self.n_layers = cfg.num_hidden_layers
        heads, hidden = getattr(cfg, "num_attention_heads", None), getattr(cfg, "hidden_size", None)
        self._head_dim = getattr(cfg, "head_dim", None) or (
            hidden // heads if heads and hidden else None)
        # (key-value heads, head dimension) of every layer, for prompt slabs; None: unknown.
        # Under tensor parallelism each rank holds its share of the heads.
        kv_heads = (getattr(cfg, "num_key_value_heads", None) or heads or 0) // tp_degree
        self._kv_shape = (kv_heads, self._head_dim) if kv_heads and self._head_dim else None
        self._no_mask = packed_forward.NO_MASK.to(device)
        self._cache_keyword = cache_keyword(model)
        # Piecewise CUDA graphs for packed forwards (`use_graphs`); None: every forward eager.
        self.graphs: cuda_graphs.LayerGraphs | None = None

    def keep_kv_in(self, dtype: torch.dtype) -> None:
        """New KV buffers in `dtype` (engine.model.prepare's choice for `kv_cache_dtype`)."""
        self.kv_like = torch.empty(0, dtype=dtype, device=self.device)

    def use_graphs(self, max_tokens: int, capture: bool = True) -> bool:
        """Run packed forwards of up to `max_tokens` tokens through piecewise graphs
        (engine.model.cuda_graphs) where the model's layers allow; `capture` False runs the
        same pieces eagerly (the CPU tests). Returns whether they will run."""
        if not cuda_graphs.supported(self.model):
            return False
        self.graphs = cuda_graphs.LayerGraphs(self.model, max_tokens, capture)
        return True

    def attention_tokens(self) -> int:
        """Context tokens whose attention costs about as much as one token's linear layers.

        FLOPs: a token's linear layers take 2 per weight (embeddings excepted); a query-key pair
        takes 4 per head dimension per layer (scores and weighted values). Attention kernels run
        at a lower rate than the big matrix products: about a third of it on a CPU.
        """
        heads = self.model.config.get_text_config().num_attention_heads
        linear = sum(p.numel() for name, p in self.model.named_parameters()
                     if "embed" not in name)
        pair = 4 * heads * self._head_dim * self.n_layers
        return max(1, round(2 * linear / pair * ATTENTION_RATE))

    def _forward(self, cache: Cache, **kwargs):
        kwargs[self._cache_keyword] = cache
        return self.model(use_cache=True, return_dict=True, **kwargs)

    def prompt_kv(self, prefix: PrefixEntry | None, length: int) -> Cache:
        """A batch-1 cache for a prompt of `length` tokens, holding a cached prefix's KV.

        One slab of the prompt's length, allocated once (its chunks are written in place): a
        cache grown by concatenation allocates a larger copy at every chunk, and those
        short-lived blocks of every size fragment the heap under load. Models whose config
        does not give the KV shape get transformers' DynamicCache.
        """
        if self._kv_shape is None:
            if prefix is None:
                return DynamicCache()
            return DynamicCache(
                ddp_cache_data=[(k[None], v[None]) for k, v in zip(prefix.keys, prefix.values)])
        heads, dim = self._kv_shape
        slabs = new_slabs(self.kv_like, [((1, heads, length, dim), (1, heads, length, dim))]
                          * self.n_layers)
        done = 0 if prefix is None else prefix.length
        layers = []
        for i, (k, v) in enumerate(slabs):
            if prefix is not None:
                k[0, :, :done] = prefix.keys[i]
                v[0, :, :done] = prefix.values[i]
            layers.append(SlabLayer(k, v, done))
        return SlabCache(layers)

    def prepare_inputs(self, plan: StepPlan, batch: RollingBatch) -> list[Chunk]:
        """Lay the step's KV out as planned and build its prompt chunks' inputs: aborted prompts
        drop their KV, the batch takes the plan's partition (jobs that joined bring their
        prompt's KV as new rows) and the columns its rows write this step, within the plan's
        KV limit, and a job's first chunk starts from its cached prefix."""
        for job in plan.aborted:
            job.release_prompt()
        if plan.groups is not None:
            new_rows = {}
            for job in plan.joined:
                row = row_from_cache(job.kv)
                new_rows.update((s, row) for s in job.seqs)
                job.release_prompt()
            batch.regroup(plan.groups, new_rows, plan.kv_limit)
        batch.make_room(plan.kv_limit, plan.compact)
        return [self._chunk_input(c) for c in plan.chunks]

    def _chunk_input(self, chunk: PrefillChunk) -> Chunk:
        job = chunk.job
        want_hidden = job.strategy == "contrastive"
        if job.kv is None:
            job.kv = self.prompt_kv(job.prefix, len(job.fill_ids))
            if want_hidden and job.prefix is not None:
                job.hidden = [job.prefix.hidden]
            job.prefix = None
        targets = job.fill_ids[chunk.start + 1 : chunk.stop + 1] if job.scores_prompt else None
        return Chunk(job.kv, job.fill_ids[chunk.start : chunk.stop], chunk.start, chunk.last,
                     want_hidden, targets)

    def prefill_chunk(self, chunk: Chunk) -> GroupResult:
        """Compute one chunk alone (models without the packed path, or a step with nothing
        else to run)."""
        start, stop = chunk.start, chunk.start + len(chunk.ids)
        out = self._forward(
            input_ids=to_device(chunk.ids, self.device)[None],
            attention_mask=torch.ones((1, stop), dtype=torch.long, device=self.device),
            position_ids=torch.arange(start, stop, device=self.device)[None],
            cache=chunk.cache,
            output_hidden_states=chunk.hidden,
            logits_to_keep=0 if chunk.targets else 1,  # 0: every position's
        )
        logits = out.logits[0, -1].float() if chunk.logits else None
        scored = out.logits[0, : len(chunk.targets)] if chunk.targets else None
        return GroupResult(logits, out.hidden_states[-1][0] if chunk.hidden else None,
                           prompt_logits=scored)

    def decode(self, sb: SubBatch, want_hidden: bool) -> GroupResult:
        """Feed every row's pending token, or its contrastive candidates (padded to [rows, slots]
        here: without the packed path the linear layers see the padding too)."""
        feed = DecodeFeed.of(sb)
        sb.reserve(sb.width + feed.slots)
        mask = feed.one_token_mask().long() if feed.slots == 1 else self._slots_mask(feed)
        out = self._forward(
            input_ids=feed.padded(feed.ids),
            position_ids=feed.padded(feed.positions),
            attention_mask=mask,
            cache=sb.cache,
            output_hidden_states=want_hidden,
        )
        sb.advance(feed.slots)
        hidden = feed.packed(out.hidden_states[-1]) if want_hidden else None
        return GroupResult(feed.packed(out.logits).float(), hidden, feed.first, feed.first_host,
                           feed.drafts)

    def _slots_mask(self, feed: DecodeFeed) -> torch.Tensor:
        """The mask of rows feeding several queries (a draft, contrastive candidates): boolean
        where the layers have the decode kernel, which takes each query's mask row as it is;
        else additive."""
        if packed_forward.decode_kernel_layers(self.model):
            return feed.allowed()
        return feed.mask(self.dtype)

    def _mask_buffer(self, shape: torch.Size) -> torch.Tensor:
        """An uninitialised additive mask of the model's dtype. On CUDA its rows start at
        multiples of 8 elements: PyTorch's memory-efficient attention copies a mask whose rows do
        not into aligned ones in every layer's call, and launches are what a GPU step waits on."""
        if self.device.type != "cuda":
            return torch.empty(shape, dtype=self.dtype, device=self.device)
        width = shape[-1]
        return torch.empty((*shape[:-1], -(-width // 8) * 8), dtype=self.dtype,
                           device=self.device)[..., :width]

    def _bias(self, mask: torch.Tensor) -> torch.Tensor:
        """A decode group's mask as every layer's attention takes it. On CUDA: additive and
        aligned (`_mask_buffer`), made once per step, where PyTorch would convert a bool mask
        (-inf where a row does not attend, as here) in every layer's call."""
        if self.device.type != "cuda":
            return mask
        bias = self._mask_buffer(mask.shape)
        if mask.dtype == torch.bool:
            return bias.zero_().masked_fill_(~mask, float("-inf"))
        return bias.copy_(mask)

    def graph_captures(self) -> int:
        """How many CUDA graph buckets have been captured (0 without graphs)."""
        return 0 if self.graphs is None else self.graphs.stats.captured

    def graphs_take(self, sub_batches: list[SubBatch], chunks: list[Chunk]) -> bool:
        """Whether the graphs would take a packed forward of these groups: a bucket holds its
        tokens (each row counted with everything it may feed) and its capture has not failed."""
        if self.graphs is None:
            return False
        tokens = sum(len(ch.ids) for ch in chunks) + sum(
            s.feeds for sb in sub_batches for s in sb.seqs)
        return self.graphs.bucket(tokens) is not None

    def packed(
        self, sub_batches: list[SubBatch], chunks: list[Chunk], want_hidden: list[bool]
    ) -> list[GroupResult]:
        """Every sub-batch's pending tokens and every chunk in one forward, attention per group
        (`engine.model.packed_forward`). Returns one result per sub-batch, then one per chunk;
        `want_hidden` says, per sub-batch, whether its rows' hidden states are wanted."""
        groups, ids, positions, keep = [], [], [], []
        offset = 0
        feeds = [DecodeFeed.of(sb) for sb in sub_batches]
        for sb, feed in zip(sub_batches, feeds):
            sb.reserve(sb.width + feed.slots)
            if feed.slots == 1:
                mask = self._bias(feed.one_token_mask()[:, None, None, :])
            else:
                mask = self._bias(self._slots_mask(feed))
            groups.append(packed_forward.Group(sb.cache, offset, feed.tokens, sb.size, mask, feed))
            ids.append(feed.ids)
            positions.append(feed.positions)
            keep.extend(range(offset, offset + feed.tokens))
            offset += feed.tokens
        for ch in chunks:
            n, stop = len(ch.ids), ch.start + len(ch.ids)
            pos = torch.arange(ch.start, stop, device=self.device)
            # An additive mask: the CPU attention kernel runs faster with it than with a bool one.
            hidden_future = torch.arange(stop, device=self.device)[None, :] > pos[:, None]
            mask = self._mask_buffer(hidden_future.shape).zero_()
            mask.masked_fill_(hidden_future, torch.finfo(self.dtype).min)
            groups.append(packed_forward.Group(ch.cache, offset, n, 1, mask[None, None]))
            ids.append(to_device(ch.ids, self.device))
            positions.append(pos)
            keep.extend(range(offset, offset + len(ch.targets or ())))
            if ch.logits:
                keep.append(offset + n - 1)
            offset += n
        hidden_wanted = any(want_hidden) or any(ch.hidden for ch in chunks)
        cache = packed_forward.PackedCache(groups, self.n_layers)
        kept = to_device(keep, self.device)
        all_ids, all_positions = torch.cat(ids), torch.cat(positions)
        logits = None
        if self.graphs is not None:
            try:
                logits, hidden = self.graphs.forward(all_ids, all_positions, cache, self._no_mask,
                                                     kept, hidden_wanted)
            except cuda_graphs.GraphsOff:
                pass
        if logits is None:
            out = self._forward(
                input_ids=all_ids[None],
                position_ids=all_positions[None],
                attention_mask=self._no_mask,
                cache=cache,
                output_hidden_states=hidden_wanted,
                logits_to_keep=kept,
            )
            logits = out.logits[0]
            hidden = out.hidden_states[-1][0] if hidden_wanted else None  # [tokens, hidden]
        logits = logits.float()  # [kept positions, vocab]
        results: list[GroupResult] = []
        row = 0
        for sb, feed, g, want in zip(sub_batches, feeds, groups, want_hidden):
            sb.advance(feed.slots)
            h = hidden[g.start : g.start + g.tokens] if want else None
            results.append(GroupResult(logits[row : row + g.tokens], h, feed.first,
                                       feed.first_host, feed.drafts))
            row += g.tokens
        for ch, g in zip(chunks, groups[len(sub_batches):]):
            lg = scored = None
            if ch.targets:
                scored = logits[row : row + len(ch.targets)]
                row += len(ch.targets)
            if ch.logits:
                lg = logits[row]
                row += 1
            h = hidden[g.start : g.start + g.tokens] if ch.hidden else None
            results.append(GroupResult(lg, h, prompt_logits=scored))
        return results
