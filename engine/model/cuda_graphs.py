"""Piecewise CUDA graphs for the packed forward: the work between two attentions replayed as one
graph, the attention itself run as before.

On a GPU a step of a small model is host-bound: each of SmolLM2's 30 layers launches about 40
kernels, and the device waits for Python (docs/gpu.md). A graph captures a fixed sequence of
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
only Llama layers that took the lean forward qualify.

With `capture=False` the same pieces run eagerly, which is how the CPU tests exercise the
padding, the buffers and the hand-over between pieces and attention.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.model import llama_layers

log = logging.getLogger("seqgate.engine")

# Token counts a step is padded to (vLLM captures a similar ladder): fine steps among small
# batches, where one more padded row costs as much as a real one, coarser above.
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512, 640, 768,
           896, 1024, 1536, 2048)


@dataclass
class GraphStats:
    captured: int = 0  # buckets captured
    failed: int = 0  # buckets whose capture failed (they run eagerly since)
    forwards: int = 0  # forwards that ran through the pieces (replayed where captured)
    eager: int = 0  # packed forwards they did not take (more tokens than the largest bucket)


def supported(model: torch.nn.Module) -> bool:
    """Whether every decoder layer of `model` runs the lean Llama forward with stacked
    projections, under a model whose embedding, rotary embedding, final norm and head are
    where a Llama puts them."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or not all(hasattr(inner, a) for a in ("embed_tokens", "rotary_emb", "norm")):
        return False
    if type(getattr(model, "lm_head", None)) is not torch.nn.Linear:
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
        self.sizes = [b for b in BUCKETS if b < max_tokens] + [
            next((b for b in BUCKETS if b >= max_tokens), BUCKETS[-1])]
        most = self.sizes[-1]
        weight = self.lm_head.weight
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
        self._pieces: dict[int, list[Callable[[], None]]] = {}
        self.stats = GraphStats()
        self._failed: set[int] = set()  # buckets whose capture failed

    def bucket(self, tokens: int) -> int | None:
        """The bucket a step of `tokens` tokens pads to; None: more than the largest, or its
        capture failed."""
        b = next((b for b in self.sizes if b >= tokens), None)
        return None if b in self._failed else b

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
        stream = torch.cuda.Stream(self.device)
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
        self.ids[:n].copy_(ids)
        self.positions[:n].copy_(positions)
        try:
            pieces = self._pieces_for(b)
        except Exception:
            # A failed capture (out of memory, or an operation a graph cannot hold) leaves its
            # bucket eager rather than failing steps; the caller runs the model's own forward.
            log.exception("CUDA graph capture of %d tokens failed: that size runs eagerly", b)
            self._failed.add(b)
            self.stats.failed += 1
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
            self.out[:, :n].view(out.shape).copy_(out)  # [1, n, heads, dim], maybe strided
            pieces[i + 1]()
        self.stats.forwards += 1
        normed = self.normed[0, :n]
        logits = self.lm_head(normed[keep])
        return logits, (normed.clone() if hidden else None)


class GraphsOff(Exception):
    """The graphs cannot take this forward (its bucket's capture failed): run the model's own.
    Raised before any layer has run, so nothing is half-written."""
