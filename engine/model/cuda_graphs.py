"""Piecewise CUDA graphs for the packed forward: the work between two attentions replayed as one
graph, the attention itself run as before.

On a GPU a step of a small model is host-bound: each layer launches dozens of small kernels,
and the device waits for Python (docs/gpu.md). A graph captures a fixed sequence of
kernels on fixed buffers and replays it with one launch. Attention cannot be captured as the
engine lays KV out: a sub-batch's slab moves when rows join or it grows, and its width changes
every step. Everything else in a Llama layer works token by token (norms, projections, rotary
embedding, MLP), so it only needs the step's token count fixed: the step's tokens are padded to
a bucket size, and per bucket the model is captured in `layers + 1` pieces, each from one
layer's attention output to the next layer's query, key and value. This is vLLM's piecewise
design. The padding rows compute on stale inputs, which no real row reads: nothing between two
attentions mixes tokens.

Each piece reads and writes static buffers (the token ids and positions, the residual stream,
the query, key and value, the attention output, the rotary tables, the final norm's output)
that the bucket's views share, so every bucket's graphs use the same addresses. A bucket is
captured the first time a step needs it; steps of more tokens than the largest bucket run the
model's own forward. The pieces are the lean layers' own halves (engine.model.llama_layers), so
only Llama layers that took the lean forward qualify, with rotary embeddings whose tables do not
depend on the step's longest position (the padding's stale positions would change them) and an
attention function that reads no position ids (transformers' SDPA or eager one).

Graph memory (the pool of the pieces' intermediates) is taken when a bucket is first captured,
beside the KV budget, which was measured before; a capture that runs out of memory leaves that
bucket eager for a while and is tried again later.

With `capture=False` the same pieces run eagerly, which is how the CPU tests exercise the
padding, the buffers and the hand-over between pieces and attention.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.model import llama_layers, packed_forward

log = logging.getLogger("seqgate.engine")

# Token counts a step is padded to (vLLM captures a similar ladder): fine steps among small
# batches, where one more padded row costs as much as a real one, coarser above.
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512, 640, 768,
           896, 1024, 1536, 2048)
# Beyond the ladder, buckets are multiples of this.
STRIDE = 512
# Rotary types whose tables are a fixed function of each position alone.
STATIC_ROPE = ("default", "linear", "llama3", "yarn")
# Forwards a bucket whose capture ran out of memory runs eagerly before it is tried again.
RETRY_AFTER = 256


@dataclass
class GraphStats:
    captured: int = 0  # buckets captured
    failed: int = 0  # captures that failed (their bucket runs eagerly since, or for a while)
    forwards: int = 0  # forwards that ran through the pieces (replayed where captured)
    eager: int = 0  # packed forwards they did not take (no bucket, or its capture failed)


def sizes(max_tokens: int) -> list[int]:
    """The buckets up to the first at or above `max_tokens`."""
    out = [b for b in BUCKETS if b < max_tokens]
    top = next((b for b in BUCKETS if b >= max_tokens), None)
    if top is None:
        out += range(BUCKETS[-1] + STRIDE, max_tokens, STRIDE)
        top = -(-max_tokens // STRIDE) * STRIDE
    return [*out, top]


def supported(model: torch.nn.Module) -> bool:
    """Whether every decoder layer of `model` runs the lean Llama forward with stacked
    projections, under a model whose embedding, rotary embedding, final norm and head are
    where a Llama puts them, with a static rotary type, behind the packed dispatcher over
    transformers' SDPA or eager attention."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or not all(hasattr(inner, a) for a in ("embed_tokens", "rotary_emb", "norm")):
        return False
    if type(getattr(model, "lm_head", None)) is not torch.nn.Linear:
        return False
    if getattr(inner.rotary_emb, "rope_type", None) not in STATIC_ROPE:
        return False
    if not packed_forward.plain_attention(model):
        return False
    return len(layers) > 0 and all(vars(layer).get("_lean_stacked") is not None
                                   and vars(layer).get("_lean_native") is None for layer in layers)


class LayerGraphs:
    """The packed forward's work between attentions, as graphs per token-count bucket."""

    def __init__(self, model: torch.nn.Module, max_tokens: int, capture: bool = True):
        self.model = model
        inner = model.model
        self.layers = list(inner.layers)
        self.embed, self.rotary, self.norm = inner.embed_tokens, inner.rotary_emb, inner.norm
        self.lm_head = model.lm_head
        self.sizes = sizes(max_tokens)
        most = self.sizes[-1]
        weight = self.embed.weight  # the residual stream's dtype, as the model's forward has it
        self.device, dtype = weight.device, weight.dtype
        attn = self.layers[0].self_attn
        stacked = vars(self.layers[0])["_lean_stacked"]
        dim = attn.head_dim
        hidden = self.embed.weight.shape[1]

        def buf(*shape: int, kind: torch.dtype = dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=kind, device=self.device)

        self.ids, self.positions = buf(most, kind=torch.long), buf(most, kind=torch.long)
        self.h = buf(1, most, hidden)  # the residual stream
        self.q = buf(1, stacked.q_heads, most, dim)
        self.k, self.v = buf(1, stacked.kv_heads, most, dim), buf(1, stacked.kv_heads, most, dim)
        self.out = buf(1, most, stacked.q_heads * dim)  # attention's output, heads joined
        self.cos, self.sin = buf(1, 1, most, dim), buf(1, 1, most, dim)
        self.normed = buf(1, most, hidden)
        self.capture = capture and self.device.type == "cuda"
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        # One side stream for every capture: blocks a warm-up caches on a stream serve only it.
        self._stream = torch.cuda.Stream(self.device) if self.capture else None
        self._pieces: dict[int, list[Callable[[], None]]] = {}
        self.stats = GraphStats()
        # Buckets whose capture failed: the forward count from which each is tried again
        # (None: never, the failure was not one of memory).
        self._failed: dict[int, int | None] = {}

    def bucket(self, tokens: int) -> int | None:
        """The bucket a step of `tokens` tokens pads to; None: more than the largest, or its
        capture failed."""
        b = next((b for b in self.sizes if b >= tokens), None)
        if b in self._failed:
            again = self._failed[b]
            if again is None or self.stats.forwards + self.stats.eager < again:
                return None
            del self._failed[b]
        return b

    # -- the pieces ----------------------------------------------------------------------------
    def _inputs(self, i: int, b: int) -> None:
        q, k, v = llama_layers._attention_inputs(
            self.layers[i], self.h[:, :b], None, (self.cos[:, :, :b], self.sin[:, :, :b]))
        self.q[:, :, :b].copy_(q)
        self.k[:, :, :b].copy_(k)
        self.v[:, :, :b].copy_(v)

    def _first(self, b: int) -> None:
        x = self.embed(self.ids[None, :b])
        cos, sin = llama_layers._rotary_tables(self.rotary(x, self.positions[None, :b]))
        self.cos[:, :, :b].copy_(cos)
        self.sin[:, :, :b].copy_(sin)
        self.h[:, :b].copy_(x)
        self._inputs(0, b)

    def _after(self, i: int, b: int) -> None:
        """Layer i's work after its attention, then layer i + 1's before its own (or the final
        norm after the last layer)."""
        x = llama_layers._attention_output(self.layers[i], self.out[:, :b], self.h[:, :b])
        if i + 1 < len(self.layers):
            self.h[:, :b].copy_(x)
            self._inputs(i + 1, b)
        else:
            self.normed[:, :b].copy_(self.norm(x))

    def _pieces_for(self, b: int) -> list[Callable[[], None]]:
        pieces = self._pieces.get(b)
        if pieces is not None:
            return pieces
        pieces = [lambda: self._first(b)] + [
            (lambda i=i: self._after(i, b)) for i in range(len(self.layers))]
        if self.capture:
            pieces = self._captured(pieces)
            self.stats.captured += 1
        self._pieces[b] = pieces
        return pieces

    def _captured(self, pieces: list[Callable[[], None]]) -> list[Callable[[], None]]:
        """Each piece captured into its own graph (one memory pool for every bucket: the pieces
        run one after another on one stream, and all they keep lives in the static buffers).
        They run once first, outside capture, where libraries make their handles and
        workspaces; what that writes to the buffers is overwritten by the step's replay."""
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        graphs = []
        with torch.cuda.stream(stream):
            for piece in pieces:
                piece()
            for piece in pieces:
                g = torch.cuda.CUDAGraph()
                g.capture_begin(pool=self.pool, capture_error_mode="thread_local")
                try:
                    piece()
                finally:
                    g.capture_end()
                graphs.append(g.replay)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        return graphs

    # -- a forward -----------------------------------------------------------------------------
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, cache, mask: torch.Tensor,
                keep: torch.Tensor, hidden: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The packed forward over `ids` at `positions` ([tokens] each, on the device), with
        `cache` (a PackedCache) routing each layer's KV and the attention function splitting
        it per group. Returns the logits of the `keep` positions and, when `hidden`, the last
        hidden states (after the final norm, as transformers gives them) of every token."""
        n = len(ids)
        b = self.bucket(n)
        if b is None:
            self.stats.eager += 1
            raise GraphsOff
        self.ids[:n].copy_(ids)
        self.positions[:n].copy_(positions)
        try:
            pieces = self._pieces_for(b)
        except Exception as exc:
            # A failed capture leaves its bucket eager rather than failing steps (the caller
            # runs the model's own forward): for a while where memory ran out, which frees up,
            # for good where the forward holds an operation a graph cannot.
            memory = isinstance(exc, torch.OutOfMemoryError)
            log.warning("CUDA graph capture of %d tokens failed (%s: %s): that size runs "
                        "eagerly%s", b, type(exc).__name__, exc, " for a while" if memory else "")
            self._failed[b] = self.stats.forwards + self.stats.eager + RETRY_AFTER \
                if memory else None
            self.stats.failed += 1
            self.stats.eager += 1
            raise GraphsOff from None
        # Read once per forward: a config attribute costs a slow __getattribute__ per read.
        attention = llama_layers.ALL_ATTENTION_FUNCTIONS.get_interface(
            self.model.config._attn_implementation, None)
        pieces[0]()
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            key, value = cache.layers[i].update(self.k[:, :, :n], self.v[:, :, :n])
            out, _ = attention(attn, self.q[:, :, :n], key, value, mask, dropout=0.0,
                               scaling=attn.scaling)
            # The output as attention gives it ([1, n, heads, dim], strided where one group's
            # rows were transposed), written with one copy.
            self.out[:, :n].view(out.shape).copy_(out)
            pieces[i + 1]()
        self.stats.forwards += 1
        normed = self.normed[0, :n]
        logits = self.lm_head(normed[keep])
        return logits, (normed.clone() if hidden else None)


class GraphsOff(Exception):
    """The graphs cannot take this forward (no bucket holds it, or its bucket's capture failed):
    run the model's own. Raised before any layer has run, so nothing is half-written."""
