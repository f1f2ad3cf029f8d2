"""Lean decoder layers: a Llama decoder layer's forward as one function, without transformers'
per-module dispatch.

At one row a decode step's arithmetic is small and its time goes to dispatch: each of
SmolLM2's 30 layers makes 13 module calls (the layer, its attention, two norms, seven linear
layers, the MLP and its activation), through decorators that rewrite keyword arguments, and
about 40 tensor operations. This forward runs the same arithmetic on the same weights, so its
results are identical bit for bit (tests/engine/test_lean.py checks it against the original
layer), with fewer operations: the query, key and value projections are one matrix product on
their stacked weights, the gate and up projections another, and the rotary embedding turns
query and key heads in one pass (each output element is still the same dot product or the same
elementwise expression). The original linear layers keep working on views of the stacked
weights (no second copy). The cache update and the attention function are the model's own
(`config._attn_implementation`), so the packed step (engine.model.packed_forward) runs through
it unchanged.

It is installed per layer only where the layer is exactly transformers' Llama layer (SmolLM2's
architecture) with SiLU and no hooks on any of its modules (tensor parallelism and offloading
work through hooks, and would be bypassed); any other layer keeps its own forward.
"""

from __future__ import annotations

import functools
import json
import types
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from engine.model.host_timing import best_of, cached, largest_win, torch_threads
from engine.model.lowbit import CANDIDATE_ROWS, BlockLinear, beyond_timed, timings_path
from engine.model.prepack import PrepackedLinear
from engine.model.quantize import PackedLinear
from engine.model.w8a8 import W8A8Linear

try:  # the architecture ships with every transformers 5.x; guarded for the import alone
    from transformers.activations import SiLUActivation
    from transformers.models.llama import modeling_llama as _llama
except ImportError:  # pragma: no cover
    _llama, SiLUActivation = None, torch.nn.SiLU

_SILU = (torch.nn.SiLU, SiLUActivation)  # both compute F.silu


def _linear(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    if type(module) is torch.nn.Linear:
        return F.linear(x, module.weight, module.bias)
    return module.forward(x)  # Packed/Prepacked/BlockLinear: no hooks (checked when installed)


def _rms_norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """LlamaRMSNorm's forward, operation for operation."""
    dtype = x.dtype
    x = x.to(torch.float32)
    variance = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + norm.variance_epsilon)
    return norm.weight * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


# The rotary tables of the forward in progress, as `_rotate` uses them: every layer of a
# forward gets the same position embeddings, so they are reshaped (and sin's sign turned) once
# per forward, not once per layer. Keyed by the model's own sin tensor.
_tables: tuple[torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None] = (None, None)


def _rotary_tables(position_embeddings) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin with the first half of each row negated), both [rows, 1, tokens, dim]."""
    global _tables
    cos, sin = position_embeddings
    seen, tables = _tables
    if seen is not sin:
        half = sin.shape[-1] // 2
        tables = (cos.unsqueeze(1),
                  torch.cat((-sin[..., :half], sin[..., half:]), dim=-1).unsqueeze(1))
        _tables = (sin, tables)
    return tables


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """`x * cos + _rotate_half(x) * sin` in fewer operations, equal bit for bit: the halves
    swapped by one `roll`, the sign moved from x onto sin ((-a) * b == a * (-b) exactly)."""
    return (x * cos) + (x.roll(x.shape[-1] // 2, dims=-1) * signed_sin)


class _Stacked(NamedTuple):
    """A layer's query, key and value projections as one linear layer, and its gate and up
    projections as another (their weights stacked; the original layers read views of them)."""

    qkv: torch.nn.Module
    q_heads: int
    kv_heads: int
    gate_up: torch.nn.Module


_KINDS = {"q4": 0, "q8": 1, "bf16": 2, "f16": 2}  # csrc/lowbit_linear.h
# blocks times rows rounded to 8 bits (csrc/q8_rows.cpp)
_INT8_ROWS = {"q4x8": 6, "q8": 7, "q8x8": 8}
_INT8, _DENSE, _ONEDNN = 3, 4, 5  # csrc/lowbit_linear.h: int8, dense and prepacked weights


class _Native:
    """A layer whose four linear layers (stacked) the native library multiplies, without
    biases: a forward it takes runs its work around the attention in two calls of the library
    (`csrc/lean_layer.cpp`), the same arithmetic as the Python halves (in blocks, passes over
    the rows that round as their operators do), so the results are equal bit for bit and the
    interpreter's and dispatcher's cost per operator is gone. In int8 the work between the
    products runs in fused passes instead, close to the Python halves' results but not equal
    to them (w8a8 is judged by its distance from fp32).

    Three sets of weights, each where the Python forward would use it:
    - `linears`, the layers in blocks (BlockLinear), for forwards of up to their `max_rows`
      rows (timed at start, `time_native`; 0 where dense products are asked for);
    - their dense weights (`dense`: oneDNN's prepacked copy where they have one, else the
      weight as F.linear takes it) for larger forwards;
    - `int8`, the w8a8 layers whose product is the library's (`W8A8Linear.ops`), for forwards
      from their int8 row count on. Their exact paths are `linears` where those are in blocks.
    Forwards that none takes run in Python: int8 rows on FBGEMM's product, and forwards for
    which the four layers' row limits disagree (each layer then decides for itself)."""

    def __init__(self, ops, linears: tuple[BlockLinear, ...], int8: tuple[W8A8Linear, ...] = ()):
        self.ops = ops  # engine.kernels.native.Native
        self.linears = linears  # qkv, o, gate_up, down; () where they are not in blocks
        self.int8 = int8
        # Each one's (kind, q, d, m) as the library takes them, built once, not every forward.
        self.blocks = [((_INT8_ROWS if b.int8_rows else _KINDS)[b.kind], b.q, b.d, b.m)
                       for b in linears]
        self.dense = [(_DENSE, b.weight, None, None) if b.dense_packed is None
                      else (_ONEDNN, b.dense_packed, None, None) for b in linears]
        native_int8 = int8 and all(w.ops is not None and w.packed is not None and w.bias is None
                                   and w.dtype == int8[0].dtype for w in int8)
        self.int8_blocks = ([(_INT8, w.packed.weight, w.packed.scales, None) for w in int8]
                            if native_int8 else None)
        self.dtype = (linears or int8)[0].weight.dtype

    def blocks_for(self, hidden: torch.Tensor) -> list | None:
        """The weights a forward of `hidden` multiplies natively; None: it runs in Python."""
        if hidden.device.type != "cpu" or hidden.dtype != self.dtype:
            return None
        rows = hidden.numel() // hidden.shape[-1]
        if self.int8:
            if rows >= max(w.min_rows for w in self.int8):
                return self.int8_blocks
            if rows >= min(w.min_rows for w in self.int8):
                return None
        if not self.linears:
            return None
        if rows <= min(b.max_rows for b in self.linears):
            return self.blocks
        return self.dense if rows > max(b.max_rows for b in self.linears) else None

    def attention_inputs(self, layer: torch.nn.Module, hidden_states: torch.Tensor,
                         position_embeddings, blocks: list | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        stacked, norm = vars(layer)["_lean_stacked"], layer.input_layernorm
        return self.ops.lean_attention_inputs(
            hidden_states, norm.weight, norm.variance_epsilon, *(blocks or self.blocks)[0],
            stacked.q_heads, stacked.kv_heads, layer.self_attn.head_dim,
            *_rotary_tables(position_embeddings))

    def attention_output(self, layer: torch.nn.Module, out: torch.Tensor,
                         residual: torch.Tensor, blocks: list | None = None) -> torch.Tensor:
        _, o, gate_up, down = blocks or self.blocks
        norm = layer.post_attention_layernorm
        return self.ops.lean_attention_output(out, residual, *o, norm.weight,
                                              norm.variance_epsilon, *gate_up, *down)

    @classmethod
    def of(cls, layer: torch.nn.Module, stacked: _Stacked | None) -> _Native | None:
        if stacked is None:
            return None
        linears = (stacked.qkv, layer.self_attn.o_proj, stacked.gate_up, layer.mlp.down_proj)
        int8 = tuple(b for b in linears if type(b) is W8A8Linear)
        if int8 and len(int8) != len(linears):
            return None
        exact = tuple(b.exact for b in int8) or linears
        in_blocks = all(type(b) is BlockLinear and b.bias is None and b.ops is not None
                        and b.weight.dtype == exact[0].weight.dtype for b in exact)
        ops = exact[0].ops if in_blocks else (int8[0].ops if int8 else None)
        if ops is None:  # neither in blocks nor on the library's int8 product (FBGEMM's)
            return None
        native = cls(ops, exact if in_blocks else (), int8)
        return native if native.linears or native.int8_blocks else None


def _stack(parts: list[torch.nn.Module]) -> torch.nn.Module | None:
    if type(parts[0]) is W8A8Linear:
        exact = _stack([p.exact for p in parts]) if _stackable([p.exact for p in parts]) else None
        if exact is None:
            return None
        for p in parts:  # the stack's int8 copy serves; theirs would idle
            p.drop_packed()
        return W8A8Linear.around(exact, parts[0])
    if type(parts[0]) is PackedLinear:
        return PackedLinear.stacked(parts)
    if type(parts[0]) is BlockLinear:
        return BlockLinear.stacked(parts)
    biases = [p.bias for p in parts]
    linear = torch.nn.Linear(parts[0].in_features, sum(p.out_features for p in parts),
                             bias=biases[0] is not None, device="meta")
    linear.weight = torch.nn.Parameter(torch.cat([p.weight for p in parts]), requires_grad=False)
    if linear.bias is not None:
        linear.bias = torch.nn.Parameter(torch.cat(biases), requires_grad=False)
    for p, rows in zip(parts, linear.weight.split([p.out_features for p in parts])):
        p.weight = torch.nn.Parameter(rows, requires_grad=False)
    if type(parts[0]) is PrepackedLinear:  # the stacked layer's copy serves; theirs would idle
        linear = PrepackedLinear(linear)
        for p in parts:
            p.packed = None
    return linear


def _stackable(parts: list[torch.nn.Module]) -> bool:
    first = parts[0]
    return (all(type(p) is type(first) for p in parts)
            and len({p.weight.dtype for p in parts}) == 1
            and len({p.weight.device for p in parts}) == 1
            and len({p.bias is None for p in parts}) == 1)


def _stacked(layer: torch.nn.Module) -> _Stacked | None:
    """The layer's projections stacked anew (from its current weights: an earlier install's
    stack may hold another dtype or an older kind of layer); None where its linear layers
    differ in kind (one packed in int8 where the rest are int4, say)."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv, gate_up = [attn.q_proj, attn.k_proj, attn.v_proj], [mlp.gate_proj, mlp.up_proj]
    stacked = None
    if _stackable(qkv) and _stackable(gate_up):
        qkv_layer, gate_up_layer = _stack(qkv), _stack(gate_up)
        if qkv_layer is not None and gate_up_layer is not None:
            stacked = _Stacked(qkv_layer, attn.q_proj.out_features // attn.head_dim,
                               attn.k_proj.out_features // attn.head_dim, gate_up_layer)
    return stacked


def lean_forward(layer: torch.nn.Module, hidden_states: torch.Tensor, attention_mask=None,
                 position_embeddings=None, **kwargs) -> torch.Tensor:
    """LlamaDecoderLayer.forward (transformers 5.x), the same arithmetic, called directly.

    Two changes of form, not of arithmetic: the query, key and value projections run as one
    matrix product (and the gate and up projections as another), whose output columns are
    each a dot product over the same inputs as before; and the rotary embedding turns the
    query and key heads in one pass, element by element as before. Where the native library
    multiplies the layer's linear layers (in blocks, or in int8), the work before and after
    the attention runs there (`_Native`), with the same arithmetic."""
    attn = layer.self_attn
    # The cache's keyword: `cache` in newer 5.x releases, `past_key_values` in earlier ones.
    cache = kwargs.pop("cache", None)
    if cache is None:
        cache = kwargs.pop("past_key_values", None)
    kwargs.pop("use_cache", None)
    native = vars(layer)["_lean_native"]
    blocks = None if native is None else native.blocks_for(hidden_states)
    if blocks is None:
        query, key, value = _attention_inputs(layer, hidden_states, position_embeddings)
    else:
        query, key, value = native.attention_inputs(layer, hidden_states, position_embeddings,
                                                    blocks)
    if cache is not None:
        key, value = cache.update(key, value, attn.layer_idx)
    attention = ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation,
                                                      _llama.eager_attention_forward)
    out, _ = attention(attn, query, key, value, attention_mask, dropout=0.0,
                       scaling=attn.scaling, **kwargs)
    if blocks is None:
        return _attention_output(layer, out, hidden_states)
    return native.attention_output(layer, out, hidden_states, blocks)


def _attention_inputs(layer: torch.nn.Module, hidden_states: torch.Tensor, position_embeddings,
                      tables: tuple[torch.Tensor, torch.Tensor] | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The layer's query, key and value: its input norm, projections and rotary embedding.
    `tables`: `_rotary_tables` of the position embeddings, where the caller keeps them."""
    attn, stacked = layer.self_attn, vars(layer)["_lean_stacked"]
    x = _rms_norm(layer.input_layernorm, hidden_states)
    input_shape = x.shape[:-1]
    if stacked is None:
        cos, sin = position_embeddings
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        shape = (*input_shape, -1, attn.head_dim)
        query = _linear(attn.q_proj, x).view(shape).transpose(1, 2)
        key = _linear(attn.k_proj, x).view(shape).transpose(1, 2)
        value = _linear(attn.v_proj, x).view(shape).transpose(1, 2)
        return ((query * cos) + (_rotate_half(query) * sin),
                (key * cos) + (_rotate_half(key) * sin), value)
    heads = stacked.q_heads + stacked.kv_heads
    qkv = _linear(stacked.qkv, x).view(*input_shape, -1, attn.head_dim).transpose(1, 2)
    turned = _rotate(qkv[:, :heads], *(tables or _rotary_tables(position_embeddings)))
    return turned[:, :stacked.q_heads], turned[:, stacked.q_heads:], qkv[:, heads:]


def _attention_output(layer: torch.nn.Module, out: torch.Tensor,
                      residual: torch.Tensor) -> torch.Tensor:
    """The layer's output from its attention's `out` and its input `residual`: the output
    projection, the residual, the post-attention norm, the MLP and its residual."""
    attn, mlp, stacked = layer.self_attn, layer.mlp, vars(layer)["_lean_stacked"]
    out = out.reshape(*residual.shape[:-1], -1).contiguous()
    hidden_states = residual + _linear(attn.o_proj, out)
    x = _rms_norm(layer.post_attention_layernorm, hidden_states)
    if stacked is None:
        x = _linear(mlp.down_proj, F.silu(_linear(mlp.gate_proj, x)) * _linear(mlp.up_proj, x))
    else:
        gate, up = _linear(stacked.gate_up, x).chunk(2, dim=-1)
        x = _linear(mlp.down_proj, F.silu(gate) * up)
    return hidden_states + x


# transformers' own output capture (output_hidden_states / output_attentions) hooks the layer
# and its attention module on the first forward. The layer's hook still runs (the layer is
# called as before); the attention's captures attention weights, which no engine forward asks
# for (and SDPA does not compute).
_CAPTURE_HOOK = "output_capturing_hook"


def _hooked(layer: torch.nn.Module) -> bool:
    for m in layer.modules():
        hooks = [*m._forward_hooks.values(), *m._forward_pre_hooks.values(),
                 *m._backward_hooks.values()]
        inert = m is layer or m is layer.self_attn
        if any(not (inert and getattr(h, "__name__", "") == _CAPTURE_HOOK) for h in hooks):
            return True
    return False


def fits(layer: torch.nn.Module) -> bool:
    """Whether `lean_forward` computes exactly what this layer's own forward does."""
    if _llama is None or type(layer) is not _llama.LlamaDecoderLayer:
        return False
    attn, mlp = layer.self_attn, layer.mlp
    linears = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj,
               mlp.down_proj)
    return (type(attn) is _llama.LlamaAttention and type(mlp) is _llama.LlamaMLP
            and all(type(n) is _llama.LlamaRMSNorm
                    for n in (layer.input_layernorm, layer.post_attention_layernorm))
            and all(type(m) in (torch.nn.Linear, PackedLinear, PrepackedLinear, BlockLinear,
                                W8A8Linear) for m in linears)
            and type(mlp.act_fn) in _SILU
            and not attn.training and not _hooked(layer))


class _WholeSlices(torch.nn.ModuleList):
    """A ModuleList whose slice over all of it is itself. transformers' models run
    `for layer in self.layers[: self.config.num_hidden_layers]`, and a ModuleList's slice is a
    new ModuleList, built with one `add_module` per layer on every forward (85 µs for SmolLM2's
    30 layers, timed alone)."""

    def __getitem__(self, idx):
        if isinstance(idx, slice) and idx.indices(len(self)) == (0, len(self), 1):
            return self
        return super().__getitem__(idx)


def install(model: torch.nn.Module) -> int:
    """Give every fitting decoder layer the lean forward; returns how many got it. The stacks
    of layers (ModuleLists named `layers`) hand themselves out for a whole slice."""
    for name, module in model.named_modules():
        if type(module) is torch.nn.ModuleList and name.rsplit(".", 1)[-1] == "layers":
            module.__class__ = _WholeSlices
    count = 0
    for module in model.modules():
        if fits(module):
            with torch.no_grad():
                stacked = vars(module)["_lean_stacked"] = _stacked(module)
            vars(module)["_lean_native"] = _Native.of(module, stacked)
            module.forward = types.MethodType(lean_forward, module)
            count += 1
    return count


@dataclass(frozen=True)
class NativeReport:
    """Layers whose work around the attention runs in the native library, the row count up to
    which it multiplies in blocks, and the timings (ms per pass over them, in blocks against
    dense) it was chosen by; max_rows None: the linear layers' own limit."""

    layers: int = 0
    max_rows: int | None = None
    timings: dict | None = None


def time_native(model: torch.nn.Module, cache: Path | None, code_key: str,
                threads: int | None) -> NativeReport:
    """Time the row count up to which the native layers multiply in blocks, above it dense
    (cached per host, model shape and limit of the linear layers), and set it as the stacked
    linear layers' limit, which the Python forward reads too. Their own limit compared their
    products alone; this one times the layers' whole work around the attention, as the
    forwards run it."""
    natives = [(m, n) for m in model.modules()
               if (n := vars(m).get("_lean_native")) is not None and n.linears]
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    if not natives or rotary is None:
        return NativeReport(len(natives))
    own = min(b.max_rows for _, n in natives for b in n.linears)
    if not own:  # dense products asked for
        return NativeReport(len(natives), 0)
    first = natives[0][1]
    with torch_threads(threads):
        signature = json.dumps(["native-dense", code_key, torch.get_num_threads(), len(natives),
                                str(first.dtype), own,
                                [list(b.q.shape) + [b.kind, b.int8_rows]
                                 for b in first.linears],
                                CANDIDATE_ROWS])
        entry = cached(timings_path(cache), signature,
                       lambda: _measure_native(natives, rotary, own))
    max_rows = beyond_timed(entry["max_rows"])
    for _, native in natives:  # one limit for the native and the Python forwards
        for b in native.linears:
            b.max_rows = max_rows
    return NativeReport(len(natives), max_rows, entry["timings"])


def _measure_native(natives: list, rotary: torch.nn.Module, own: int) -> dict:
    """The largest candidate row count (at least `own`) at which one pass over the layers'
    work around their attention is faster with the products in blocks than with the dense
    ones (both natively); stops after two losses in a row."""
    layer, first = natives[0]
    hidden_size = layer.input_layernorm.weight.shape[0]
    width = first.linears[1].in_features  # the attention's output, the output projection's in

    def timed(n: int) -> tuple[float, float]:
        hidden = torch.randn(n, 1, hidden_size, dtype=first.dtype)
        tables = rotary(hidden, torch.zeros(n, 1, dtype=torch.long))
        out = torch.randn(n, 1, width, dtype=first.dtype)
        return tuple(best_of(2, functools.partial(_pass, natives, which, hidden, tables, out))
                     for which in ("blocks", "dense"))

    with torch.inference_mode():
        best, timings = largest_win([n for n in CANDIDATE_ROWS if n > own], timed, own)
    return {"max_rows": best, "timings": timings}


def _pass(natives: list, which: str, hidden: torch.Tensor, tables, out: torch.Tensor) -> None:
    """Every layer's work before and after its attention (`out` standing in for the
    attention's output), natively, with the products in blocks or dense (`which`)."""
    for layer, n in natives:
        blocks = getattr(n, which)
        n.attention_inputs(layer, hidden, tables, blocks)
        n.attention_output(layer, out, hidden, blocks)


@contextmanager
def original_layers(model: torch.nn.Module) -> Iterator[int]:
    """Within the block, every layer runs transformers' own forward (tests compare against it);
    yields how many lean layers were set aside."""
    saved = {m: f for m in model.modules()
             if getattr(f := vars(m).get("forward"), "__func__", None) is lean_forward}
    for m in saved:
        del m.forward
    try:
        yield len(saved)
    finally:
        for m, f in saved.items():
            m.forward = f
