"""int8 weights × int8 activations for forwards of many rows (`quantize=w8a8`,
engine/model/w8a8.py): the product approximates the fp32 layer with per-row activation scales
(a row keeps its resolution beside a much larger one), forwards below the measured row count
take the exact path unchanged, the lean layers stack the int8 layers, and the engine installs
it only where asked. Its end-to-end quality against fp32 is in test_default_path_quality."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch

from engine import EngineConfig, LoadedModel, load_model
from engine.config import ConfigError
from engine.model import w8a8
from engine.model.prepare import original_model, prepare
from engine.model.w8a8 import NEVER, W8A8Linear
from tests.engine.helpers import forward_in_chunks, python_forward_in_chunks

pytestmark = pytest.mark.skipif(not w8a8.available(), reason="no FBGEMM in this PyTorch build")


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Per row: |got - want| / |want| (L2)."""
    return (got - want).norm(dim=-1) / want.norm(dim=-1)


def _linear(rows_out: int = 96, cols: int = 128, bias: bool = True) -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(cols, rows_out, bias=bias)


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_int8_product_approximates_the_layer(rows):
    layer = _linear()
    x = torch.randn(rows, layer.in_features)
    got = W8A8Linear(layer, 0).int8_forward(x)
    err = _relative_error(got, layer(x).detach())
    # 8-bit activations and 7-bit weights: about 1% per row on Gaussian data.
    assert err.max() < 0.03, err


def test_each_row_keeps_its_own_scale_beside_a_much_larger_row():
    layer = _linear(bias=False)
    small = torch.randn(1, layer.in_features)
    big = 1e4 * torch.randn(1, layer.in_features)
    int8 = W8A8Linear(layer, 0)
    alone = int8.int8_forward(small)
    beside = int8.int8_forward(torch.cat([big, small]))[1:]
    want = layer(small).detach()
    assert _relative_error(beside, want).item() < 0.03
    assert _relative_error(beside, alone).item() < 0.03
    # Control: FBGEMM's own per-tensor scale gives the small row the big one's resolution.
    plain = torch.ops.quantized.linear_dynamic(torch.cat([big, small]), int8.packed, False)[1:]
    assert _relative_error(plain, want).item() > 0.5


def test_forwards_below_min_rows_take_the_exact_path_unchanged():
    layer = _linear()
    int8 = W8A8Linear(layer, min_rows=8)
    for rows in (1, 7):
        x = torch.randn(2, rows, layer.in_features)[:1]  # rows counted over the leading dims
        assert torch.equal(int8(x), layer(x))
    x = torch.randn(1, 8, layer.in_features)
    out = int8(x)
    assert not torch.equal(out, layer(x))
    assert torch.equal(out, int8.int8_forward(x.reshape(8, -1)).view(1, 8, -1))


def test_choose_min_rows_picks_a_row_count_from_which_int8_always_wins(monkeypatch):
    layers = [W8A8Linear(_linear(), 0)]
    rows = (2, 4, 8, 16)
    # Timed int8/exact pairs, in the order choose_min_rows measures them: int8 loses at 2,
    # wins at 4, loses at 8 (noise), wins at 16: only from 16 on does it always win.
    seconds = iter([3, 2, 1, 2, 3, 2, 1, 2])
    monkeypatch.setattr(w8a8, "best_of", lambda times, work: next(seconds))
    min_rows, timings = w8a8.choose_min_rows(layers, rows)
    assert min_rows == 16 and list(timings) == ["2", "4", "8", "16"]
    seconds = iter([2, 1] * len(rows))
    monkeypatch.setattr(w8a8, "best_of", lambda times, work: next(seconds))
    assert w8a8.choose_min_rows(layers, rows)[0] == NEVER


def test_install_wraps_the_decoder_not_the_head_and_caches_the_choice(smollm2: LoadedModel,
                                                                       tmp_path, monkeypatch):
    # Two candidate row counts: what is cached matters here, not which count wins.
    choose = w8a8.choose_min_rows
    monkeypatch.setattr(w8a8, "choose_min_rows", lambda layers: choose(layers, (8, 64)))
    model = load_model(EngineConfig(dtype="fp32")).model
    report = w8a8.install(model, tmp_path, "test")
    config = model.config
    assert report.layers == 7 * config.num_hidden_layers
    assert type(model.get_output_embeddings()) is not W8A8Linear
    assert (tmp_path / "kernels" / "w8a8-rows.json").is_file()
    again = w8a8.install(load_model(EngineConfig(dtype="fp32")).model, tmp_path, "test")
    assert (again.min_rows, again.timings) == (report.min_rows, report.timings)


def test_prepare_installs_w8a8_under_the_lean_layers(smollm2: LoadedModel):
    loaded = copy.copy(smollm2)
    loaded.model = load_model(EngineConfig(dtype="fp32")).model
    prepared = prepare(loaded, EngineConfig(dtype="fp32", quantize="w8a8"))
    assert prepared.w8a8.layers == 7 * loaded.model.config.num_hidden_layers
    assert prepared.lean_layers == loaded.model.config.num_hidden_layers
    stacked = vars(loaded.model.model.layers[0])["_lean_stacked"]
    assert type(stacked.qkv) is W8A8Linear and type(stacked.gate_up) is W8A8Linear
    assert stacked.qkv.min_rows == prepared.w8a8.min_rows
    # The stack's int8 product is its parts' side by side (per-channel scales stack exactly).
    attn = loaded.model.model.layers[0].self_attn
    x = torch.randn(16, attn.q_proj.in_features)
    qkv = (attn.q_proj, attn.k_proj, attn.v_proj)
    parts = torch.cat([W8A8Linear(p.exact, 0, stacked.qkv.ops).int8_forward(x) for p in qkv],
                      -1)
    torch.testing.assert_close(stacked.qkv.int8_forward(x), parts)
    # Only the stack keeps int8 weights; a part called alone computes exactly.
    assert all(p.packed is None for p in qkv) and stacked.qkv.packed is not None
    assert torch.equal(attn.q_proj(x), attn.q_proj.exact(x))
    with original_model(loaded.model):  # references compute on the exact weights
        assert attn.q_proj.min_rows == NEVER
        assert torch.equal(attn.q_proj(x), attn.q_proj.exact(x))
    assert attn.q_proj.min_rows == prepared.w8a8.min_rows


def test_w8a8_is_a_quantize_mode_and_nothing_else_installs_it(smollm2: LoadedModel):
    assert EngineConfig(quantize="w8a8").quantize == "w8a8"
    with pytest.raises(ConfigError, match="quantize"):
        EngineConfig(quantize="w4a4")
    loaded = copy.copy(smollm2)
    loaded.model = load_model(EngineConfig(dtype="fp32")).model
    assert prepare(loaded, EngineConfig(dtype="fp32")).w8a8.layers == 0
    assert not any(isinstance(m, W8A8Linear) for m in loaded.model.modules())



# -- the native product (csrc/int8_linear.cpp): oneDNN's int8 sums, 8-bit weights, bf16 rows ----

def _reference(x: torch.Tensor, weights: w8a8.Int8Weights, bias) -> torch.Tensor:
    """What the native product computes, in float64: each row rounded to -127..127 with its
    own scale, integer sums, scaled back per row and per channel."""
    x = x.double()
    amax = x.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax.float().double() / 127, torch.ones_like(amax))
    q = torch.round(x * (127 / torch.where(amax > 0, amax, torch.full_like(amax, 127))))
    out = (q @ weights.weight.double()) * scale * weights.scales.double()
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_the_native_int8_product_is_the_quantised_arithmetic(ops, dtype, rows):
    layer = _linear().to(dtype)
    int8 = W8A8Linear(layer, 0, ops)
    x = torch.randn(rows, layer.in_features).to(dtype)
    x[0] = 0  # an all-zero row stays zero
    got = int8.int8_forward(x)
    assert got.dtype == dtype and got.shape == (rows, layer.out_features)
    want = _reference(x, int8.packed, layer.bias.detach())
    # Exact integer sums; the scaling is fp32 and the result rounded to the rows' dtype.
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    assert torch.equal(got[0], layer.bias.detach())
    if rows > 1:  # and it approximates the layer as FBGEMM's does
        err = _relative_error(got[1:].float(), layer(x[1:]).detach().float())
        assert err.max() < 0.03, err


def test_a_row_of_the_native_product_does_not_depend_on_its_batch(ops):
    layer = _linear(bias=False).to(torch.bfloat16)
    int8 = W8A8Linear(layer, 0, ops)
    small = torch.randn(1, layer.in_features).bfloat16()
    big = (1e4 * torch.randn(7, layer.in_features)).bfloat16()
    alone = int8.int8_forward(small)
    assert torch.equal(int8.int8_forward(torch.cat([big[:3], small, big[3:]]))[3:4], alone)


def test_bf16_rows_below_min_rows_take_the_exact_path(ops):
    layer = _linear().to(torch.bfloat16)
    int8 = W8A8Linear(layer, min_rows=8, ops=ops)
    x = torch.randn(7, layer.in_features).bfloat16()
    assert torch.equal(int8(x), layer(x))
    x = torch.randn(8, layer.in_features).bfloat16()
    assert torch.equal(int8(x), int8.int8_forward(x))


def aten_int8_sums_exact() -> bool:
    """Whether `torch._int_mm` sums 8-bit products exactly here: with every value at ±127 a
    kernel that sums u8 × s8 pairs in int16 saturates (255 × 127 × 2 > 32767). The library
    decides by the same test (`int_mm_exact` in csrc/int8_linear.cpp); this one checks it."""
    a = torch.full((8, 64), 127, dtype=torch.int8)
    a[1::2] = -127
    b = torch.full((64, 16), 127, dtype=torch.int8)
    b[:, 1::2] = -127
    want = (a.double() @ b.double()).to(torch.int32)  # at most 64 × 127²: exact in a double
    try:
        return torch.equal(torch._int_mm(a, b), want)
    except RuntimeError:  # no int8 product for the CPU in this build (as the library says)
        return False


def test_int_mm_sums_are_exact_where_the_library_multiplies_through_onednn(ops):
    """The library's own probe answers as this one does, on every host (which product it then
    takes where the sums are exact is decided by timing the two at start, so a check of that
    choice alone would run or pass trivially by chance on a noisy machine); and it takes
    oneDNN's product only where they are exact."""
    exact = aten_int8_sums_exact()
    assert ops.int8_sums_exact() == exact
    assert ops.int8_product_kind() != "onednn" or exact


_WIDENED = """
import json, sys, torch
from pathlib import Path
from engine.kernels import native
from engine.model import w8a8
from tests.engine.test_w8a8 import _reference, aten_int8_sums_exact
ops = native.kernels(Path(sys.argv[1]))
torch.manual_seed(0)
out = {"isa": ops.instruction_set(), "product": ops.int8_product_kind(),
       "aten_exact": aten_int8_sums_exact(), "cases": []}
# Odd inputs (a last pair of one), columns past whole panels of 16, rows past blocks of 6, and
# one case at +-127 everywhere, each row and each output channel of one sign (so every sum's
# products too), where u8 x s8 pairs summed in int16 saturate (255 x 127 x 2 > 32767).
for rows, cols_in, cols_out, extreme in ((1, 7, 5, False), (7, 33, 40, False),
                                         (13, 64, 48, True), (64, 576, 200, False)):
    if extreme:
        x = torch.ones(rows, cols_in); x[1::2] = -1
        w = torch.ones(cols_out, cols_in); w[1::2] = -1
    else:
        x, w = torch.randn(rows, cols_in), torch.randn(cols_out, cols_in)
    weights = w8a8.Int8Weights.of(w)
    got = ops.int8_linear(x, weights.weight, weights.scales, None).double()
    want = _reference(x, weights, None)
    out["cases"].append(float((got - want).abs().max() / want.abs().max().clamp(min=1)))
print(json.dumps(out))
"""


@pytest.mark.parametrize("isa", ["host", "avx2"])
def test_the_widened_int8_product_sums_exactly_where_onednn_would_saturate(ops, isa):
    """With oneDNN capped to AVX2 (as on an AVX2-only CPU) ATen's int8 product either saturates
    on values at +-127 (`aten_int8_sums_exact`; AMD Zen 4 capped) or sums exactly in a reference
    loop (a real AVX2-only AMD Zen 3: about 3 GOPS), so the library multiplies through its own
    int16 product, chosen for exactness or for speed: its sums are exact there and on odd
    shapes. Both the host's build and the AVX2 build are tried."""
    import json
    import os
    import subprocess
    import sys

    from engine.kernels import native
    from engine.model.loader import default_cache_dir

    if native.instruction_set() not in ("avx2", "avx512"):
        pytest.skip("the widened product is built for x86 (AVX2 and later)")
    if isa == "avx2" and native.instruction_set() == "avx2":
        pytest.skip("the host's build is the AVX2 one: the host case runs it")
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}
    if isa == "avx2":
        env["SEQGATE_KERNEL_ISA"] = "avx2"
    repo = Path(__file__).resolve().parents[2]  # where `tests` imports from
    run = subprocess.run([sys.executable, "-c", _WIDENED, str(default_cache_dir())], env=env,
                         cwd=repo, capture_output=True, text=True, timeout=900, check=True)
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["product"] == "int16", result
    assert isa == "host" or result["isa"] == "avx2"
    assert len(result["cases"]) == 4 and all(math.isfinite(c) for c in result["cases"])
    assert max(result["cases"]) < 1e-6, result


def test_prepare_puts_a_bf16_model_on_the_native_int8_product_under_native_layers(
        ops, smollm2: LoadedModel):
    if w8a8.native_product(ops) is None:
        pytest.skip("the native int8 product is chosen only where int8 sums are exact in int32")
    loaded = copy.copy(smollm2)
    loaded.model = load_model(EngineConfig(dtype="bf16")).model
    prepared = prepare(loaded, EngineConfig(dtype="bf16", quantize="w8a8"))
    layers = loaded.model.config.num_hidden_layers
    assert (prepared.w8a8.layers, prepared.w8a8.product) == (7 * layers, ops.int8_product_kind())
    assert prepared.lowbit.max_rows > 0  # rows below int8's stay on the exact blocks
    layer = loaded.model.model.layers[0]
    stacked, lean = vars(layer)["_lean_stacked"], vars(layer)["_lean_native"]
    assert type(stacked.qkv) is W8A8Linear and stacked.qkv.ops is ops
    assert lean is not None and len(lean.int8) == 4
    for layer_ in loaded.model.model.layers:
        for w in vars(layer_)["_lean_native"].int8:
            w.min_rows = 3  # whatever this host's timing chose
    rows = torch.zeros(3, 1, layer.input_layernorm.weight.shape[0], dtype=torch.bfloat16)
    assert lean.blocks_for(rows[:1]) is lean.blocks  # below int8's rows: the exact blocks
    assert [b[0] for b in lean.blocks_for(rows)] == [3] * 4  # from them on: int8, natively
    assert [b[1] for b in lean.blocks_for(rows)] == [w.packed.weight for w in lean.int8]
    lean.int8[0].min_rows = 4
    assert lean.blocks_for(rows) is None  # the layers disagree: each decides in Python


def test_native_int8_layers_stay_as_close_to_the_exact_products_as_the_python_forward(
        ops, smollm2: LoadedModel, monkeypatch):
    """Forwards of int8's rows run each layer's work around the attention in the native
    library's fused int8 passes (`csrc/int8_linear.cpp`), which round where the model rounds but
    sum the norms' squares in another order (and on fp32 may fuse a product and a sum into one
    rounding): on fp32 and bf16 models their next-token
    distributions are as far from the exact products' as the Python forward's, with the same
    most likely tokens, and int8 ran (the exact products give other logits)."""
    from engine.model import llama_layers

    if w8a8.native_product(ops) is None:
        pytest.skip("the native int8 product is chosen only where int8 sums are exact in int32")
    calls = []
    native_output = llama_layers._Native.attention_output
    monkeypatch.setattr(llama_layers._Native, "attention_output",
                        lambda self, *a: calls.append(a[-1][0][0]) or native_output(self, *a))
    for dtype in ("fp32", "bf16"):
        loaded = copy.copy(smollm2)
        loaded.model = load_model(EngineConfig(dtype=dtype)).model
        prepare(loaded, EngineConfig(dtype=dtype, quantize="w8a8"))
        model, layers = loaded.model, list(loaded.model.model.layers)
        natives = [vars(layer)["_lean_native"] for layer in layers]
        assert all(n is not None and n.int8_blocks is not None for n in natives)
        for n in natives:
            for w in n.int8:
                w.min_rows = 3
        ids = torch.tensor([loaded.tokenizer.encode(
            "The capital of France is Paris, and the capital of Italy is")])
        cuts = [ids.shape[1] - 4]  # both forwards at least int8's 3 rows
        calls.clear()
        fused, _ = forward_in_chunks(model, ids, cuts)
        assert calls == [3] * (2 * len(layers))  # every layer, both forwards, in int8
        with w8a8.exact_products(model):
            exact, _ = forward_in_chunks(model, ids, cuts)
        python, _ = python_forward_in_chunks(model, ids, cuts)
        assert len(calls) == 2 * len(layers)
        for f, p, e in zip(fused, python, exact, strict=True):
            f, p, e = f[0].float(), p[0].float(), e[0].float()
            assert not torch.equal(f, e)
            assert _kl(e, f) <= 1.5 * _kl(e, p) + 0.01, (dtype, _kl(e, f), _kl(e, p))
            assert torch.equal(f.argmax(-1), p.argmax(-1))


def _kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """Mean KL(p || q) of the next-token distributions over the positions."""
    p, q = torch.log_softmax(p_logits, -1), torch.log_softmax(q_logits, -1)
    return float((p.exp() * (p - q)).sum(-1).mean())


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("per_row_tables", [True, False])
def test_fused_int8_halves_match_the_python_halves_over_rows_and_tokens(
        ops, smollm2: LoadedModel, dtype: str, per_row_tables: bool):
    """The fused passes over 3 rows of 5 tokens, with rotary tables of each row's own positions
    or one table broadcast over the rows: query, key, value and the layer's output within a
    small relative distance of the Python halves' over the same int8 weights, in the same
    shapes; and the query, key and value are views of one buffer, which only the fused
    path returns (the operator-by-operator path turns the query and key into a tensor of
    their own)."""
    from engine.model import llama_layers

    if w8a8.native_product(ops) is None:
        pytest.skip("the native int8 product is chosen only where int8 sums are exact in int32")
    loaded = copy.copy(smollm2)
    loaded.model = load_model(EngineConfig(dtype=dtype)).model
    prepare(loaded, EngineConfig(dtype=dtype, quantize="w8a8"))
    model = loaded.model
    layer = model.model.layers[2]
    lean = vars(layer)["_lean_native"]
    for w in lean.int8:
        w.min_rows = 0  # the Python halves in int8 too
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 5, model.config.hidden_size, generator=gen).to(model.dtype)
    starts = [[0], [7], [20]] if per_row_tables else [[3]]
    positions = torch.tensor(starts) + torch.arange(5)
    tables = model.model.rotary_emb(hidden, positions)

    def distance(a: torch.Tensor, b: torch.Tensor) -> float:
        assert a.shape == b.shape
        return float((a.float() - b.float()).norm() / b.float().norm())

    with torch.inference_mode():
        fused = lean.attention_inputs(layer, hidden, tables, lean.int8_blocks)
        python = llama_layers._attention_inputs(layer, hidden, tables)
        assert all(distance(f, p) < 2e-2 for f, p in zip(fused, python, strict=True))
        assert fused[0].untyped_storage().data_ptr() == fused[2].untyped_storage().data_ptr()
        assert python[0].untyped_storage().data_ptr() != python[2].untyped_storage().data_ptr()
        attention = torch.randn(3, 5, *fused[0].shape[1::2], generator=gen).to(model.dtype)
        out = lean.attention_output(layer, attention, hidden, lean.int8_blocks)
        assert distance(out, llama_layers._attention_output(layer, attention, hidden)) < 2e-2
