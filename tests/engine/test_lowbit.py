"""Linear layers over 4/8-bit blocks (engine/model/lowbit.py and csrc/lowbit_linear.cpp): the
kernel computes the layer of the weights the blocks hold, exact blocks are found where the
fp32 weights are Q4_1 or Q8_0 (the embedded model's) and nowhere else, the row count the
kernel serves up to is measured and cached, and greedy decoding with it equals transformers'
`generate` on the fp32 model, exact and rounded (`quantize=int4`)."""

from __future__ import annotations

import json

import pytest
import torch

from engine import EngineConfig, LoadedModel, SamplingParams
from engine.model import llama_layers, lowbit
from engine.model.blocks import (
    BLOCK,
    Blocks,
    blocks_of_bf16,
    exact_blocks,
    rounded_blocks,
    tile_q4,
    tile_q8,
    untile_q4,
    untile_q8,
)
from engine.model.host_timing import torch_threads
from engine.model.lowbit import BlockLinear
from engine.model.onednn import supported as onednn_bf16
from engine.model.prepare import original_model, prepare
from tests.engine.helpers import (
    assert_same_forwards,
    collect,
    forward_in_chunks,
    fresh_copy,
    python_forward_in_chunks,
    reference_greedy,
    varied_prompts,
)
from tests.engine.test_native import needs_kernel


def _q4_weight(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """fp32 weights as a Q4_1 de-quantiser makes them: q * d + m, d and m float16."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (rows, cols // BLOCK, BLOCK), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15
    d = (torch.rand(rows, cols // BLOCK, 1, generator=g) * 0.02 + 1e-3).half().float()
    m = (torch.randn(rows, cols // BLOCK, 1, generator=g) * 0.1).half().float()
    return (q * d + m).flatten(1)


def _q8_weight(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (rows, cols // BLOCK, BLOCK), generator=g).float()
    q[..., 0] = 127
    d = (torch.rand(rows, cols // BLOCK, 1, generator=g) * 0.01 + 1e-4).half().float()
    return (q * d).flatten(1)


def _h16_weight(dtype: torch.dtype):
    """fp32 weights that are `dtype` values, as a bf16 or fp16 model loaded in fp32 holds."""
    def make(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return (torch.randn(rows, cols, generator=g) * 0.05).to(dtype).float()
    return make


WEIGHTS = {"q4": _q4_weight, "q8": _q8_weight, "bf16": _h16_weight(torch.bfloat16),
           "f16": _h16_weight(torch.float16)}


def test_exact_blocks_are_found_only_where_the_weights_are_blocks():
    for kind, make in WEIGHTS.items():  # fp16 values are bf16 ones only by chance
        weight = make(48, 4 * BLOCK)
        blocks = exact_blocks(weight)
        assert blocks is not None and blocks.kind == kind
        assert torch.equal(blocks.dense(), weight)  # bit for bit
    assert exact_blocks(_h16_weight(torch.bfloat16)(48, 4 * BLOCK)).q.dtype == torch.bfloat16
    assert exact_blocks(_h16_weight(torch.float16)(48, 4 * BLOCK)).q.dtype == torch.float16
    noisy = _q4_weight(48, 4 * BLOCK)
    noisy[3, 5] += 1e-4  # one weight off the grid: the layer has no exact blocks
    assert exact_blocks(noisy) is None
    late = _q4_weight(48, 4 * BLOCK)
    late[40, 5] += 1e-4  # past the first rows, which each kind is tried on first
    assert exact_blocks(late) is None
    assert exact_blocks(torch.randn(48, 4 * BLOCK)) is None
    assert exact_blocks(_q4_weight(48, 4 * BLOCK).bfloat16()) is None  # fp32 only
    assert exact_blocks(torch.zeros(8, BLOCK)) is not None  # d = 0: every weight is m


def test_rounded_blocks_stay_close_and_refuse_what_they_cannot_hold():
    torch.manual_seed(0)
    weight = torch.randn(64, 4 * BLOCK)
    for kind, bound in (("q4", 0.07), ("q8", 0.005)):
        blocks = rounded_blocks(weight, kind)
        err = (blocks.dense() - weight).abs().max() / weight.abs().max()
        assert blocks.kind == kind and 0 < err < bound
    assert rounded_blocks(torch.randn(8, BLOCK + 1), "q4") is None
    assert rounded_blocks(torch.full((8, BLOCK), 1e7), "q8") is None  # scale beyond float16


@needs_kernel
@pytest.mark.parametrize("kind", list(WEIGHTS))
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 7, 8, 9, 15, 16, 17, 33])
def test_the_kernel_computes_the_layer_of_the_blocks_weights(ops, kind, rows):
    weight = WEIGHTS[kind](40, 3 * BLOCK, seed=rows)
    linear = torch.nn.Linear(3 * BLOCK, 40, bias=True)
    linear.weight = torch.nn.Parameter(weight, requires_grad=False)
    layer = BlockLinear(linear, exact_blocks(weight), ops, max_rows=64)
    x = torch.randn(rows, 3 * BLOCK)
    want = torch.nn.functional.linear(x, weight, linear.bias)
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)
    # a [batch, tokens, features] layout, rows not contiguous, as models call it
    wide = torch.randn(1, rows, 5 * BLOCK)[..., :3 * BLOCK]
    torch.testing.assert_close(layer(wide), torch.nn.functional.linear(wide, weight, linear.bias),
                               rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("kind", ["q4", "q8", "bf16"])
@pytest.mark.parametrize("outputs", [101, 150])  # a thread's second block of 48; a part tile
def test_many_rows_write_every_output_of_every_row(ops, kind, outputs):
    """From 16 rows on, each thread's sums go through blocks of outputs into y: every row and
    output lands in place (against the product of the dense weights), and each output is one
    running sum of its own, so a row's result is the same bit for bit whatever rows and
    threads share its call."""
    weight = WEIGHTS[kind](outputs, 3 * BLOCK, seed=outputs)
    blocks = exact_blocks(weight)
    layer = BlockLinear(torch.nn.Linear(3 * BLOCK, outputs, bias=False), blocks, ops,
                        max_rows=4096)
    x = torch.randn(1024, 3 * BLOCK)
    alone = {}
    for rows in (16, 17, 23, 33, 40, 1024):  # 1,024 rows: 4 KiB a row of the block
        got = layer.kernel_product(x[:rows])
        torch.testing.assert_close(got, x[:rows] @ weight.t(), rtol=1e-5, atol=1e-4)
        alone[rows] = got
    for rows in (16, 17, 23, 33, 40):
        assert torch.equal(alone[rows], alone[1024][:rows])
    with torch_threads(1):
        assert torch.equal(layer.kernel_product(x[:40]), alone[40])


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 20])  # a pass per row group, and the tiled product
def test_bf16_rows_give_the_fp32_product_rounded(ops, rows):
    """A bf16 model's rows go to the kernel as they are: the result is, bit for bit, the fp32
    product of the widened rows rounded to bf16 (the two conversions it saves the caller)."""
    blocks = exact_blocks(_q4_weight(48, 4 * BLOCK))
    x = torch.randn(rows, 4 * BLOCK).bfloat16()
    got = ops.q4_linear(x, blocks.q, blocks.d, blocks.m)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, ops.q4_linear(x.float(), blocks.q, blocks.d, blocks.m).bfloat16())


@needs_kernel
def test_the_kernel_refuses_what_it_does_not_take(ops):
    blocks = exact_blocks(_q4_weight(16, 2 * BLOCK))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.q4_linear(torch.randn(2, 2 * BLOCK).half(), blocks.q, blocks.d, blocks.m)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.q4_linear(torch.randn(2, 2 * BLOCK - 1), blocks.q, blocks.d, blocks.m)
    with pytest.raises(RuntimeError, match="weights"):
        ops.q4_linear(torch.randn(2, 4 * BLOCK), blocks.q, blocks.d, blocks.m)
    with pytest.raises(RuntimeError, match="bfloat16 or float16"):
        ops.h16_linear(torch.randn(2, 2 * BLOCK), torch.randn(16, 2 * BLOCK))
    with pytest.raises(RuntimeError, match="weights"):
        ops.h16_linear(torch.randn(2, 4 * BLOCK), torch.randn(16, 2 * BLOCK).bfloat16())


def _rows_rounded_reference(x: torch.Tensor, blocks) -> torch.Tensor:
    """llama.cpp's arithmetic for Q4_1 / Q8_0 blocks times rows rounded to Q8_1, in float64
    from the blocks' integers: each row rounded per block of 32 columns (d = max|x| / 127,
    q = round(x * (1 / d))), the integer dot products scaled by both scales, plus Q4_1's mins
    times d * sum(q)."""
    rows, cols = x.shape
    xb = x.view(rows, cols // BLOCK, BLOCK)
    dx = xb.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(dx != 0, 1 / dx, torch.zeros_like(dx))
    qx = torch.round(xb * inv).double()  # half to even, as the kernel's conversion
    out = blocks.q.shape[0]
    if blocks.kind == "q4":
        packed = blocks.q.view(out, cols // BLOCK, BLOCK // 2)
        qw = torch.cat([packed & 0x0F, packed >> 4], -1).double()
    else:
        qw = blocks.q.view(out, cols // BLOCK, BLOCK).double()
    dots = torch.einsum("rbj,obj->rob", qx, qw)
    y = (dots * blocks.d.double()[None] * dx.double().squeeze(-1)[:, None]).sum(-1)
    if blocks.kind == "q4":
        sums = dx.double().squeeze(-1) * qx.sum(-1)  # [rows, blocks]
        y = y + sums @ blocks.m.double().T
    return y


def _rows_rounded(ops, x: torch.Tensor, blocks, tiled: bool = True) -> torch.Tensor:
    """The 8-bit rows kernel's product: Q4_1 in tiles, Q8_0 in tiles or (`tiled` False) in
    rows, the layout a layer whose rows do not make whole tiles keeps."""
    if blocks.kind == "q4":
        tiles = tile_q4(blocks)
        return ops.q4x8_q8_linear(x, tiles.q, tiles.d, tiles.m)
    if tiled:
        tiles = tile_q8(blocks)
        return ops.q8x8_q8_linear(x, tiles.q, tiles.d)
    return ops.q8_q8_linear(x, blocks.q, blocks.d)


@needs_kernel
@pytest.mark.parametrize("kind,tiled", [("q4", True), ("q8", True), ("q8", False)])
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 9, 70])
def test_rows_rounded_to_8_bits_give_llama_cpp_arithmetic(ops, kind, tiled, rows):
    """The int4 / int8 kernel (csrc/q8_rows.cpp) computes llama.cpp's Q4_1 x Q8_1 and Q8_0 x
    Q8_0 dot products, Q8_0 in tiles of 8 output rows or in rows: equal to the float64
    reference from the same integers up to fp32 sums, and no closer to the layer's exact
    product than rounding the rows allows. 70 rows take two groups of the tiles' rows; the
    weights reach both ends of the bytes (-127 and 127, the nibbles' 0 and 15)."""
    weight = WEIGHTS[kind](40, 6 * BLOCK, seed=rows)
    blocks = exact_blocks(weight)
    if kind == "q8":
        assert int(blocks.q.min()) <= -120 and int(blocks.q.max()) >= 120
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 6 * BLOCK, generator=g)
    x[:, :BLOCK] = 0  # an all-zero block: scale 0, nothing divided by it
    got = _rows_rounded(ops, x, blocks, tiled)
    want = _rows_rounded_reference(x, blocks)
    assert got.dtype == torch.float32 and got.shape == (rows, 40)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
    if rows:
        exact = x @ weight.T
        err = ((got - exact).norm() / exact.norm()).item()
        assert 1e-5 < err < 2e-2  # the rows' rounding shows, and stays small


@needs_kernel
def test_a_row_rounded_to_8_bits_gets_the_same_result_alone_or_beside_others(ops):
    """Each row is rounded with its own scales and summed in one order whatever the rows beside
    it, so a sequence's products do not depend on its batch or on the drafts verified with it:
    bit for bit, also for bf16 rows (the fp32 result rounded)."""
    for kind, tiled in (("q4", True), ("q8", True), ("q8", False)):
        blocks = exact_blocks(WEIGHTS[kind](72, 4 * BLOCK))
        x = torch.randn(11, 4 * BLOCK) * torch.logspace(-2, 2, 11)[:, None]
        together = _rows_rounded(ops, x, blocks, tiled)
        for i in range(len(x)):
            assert torch.equal(_rows_rounded(ops, x[i:i + 1], blocks, tiled)[0], together[i])
        half = x.bfloat16()
        assert torch.equal(_rows_rounded(ops, half, blocks, tiled),
                           _rows_rounded(ops, half.float(), blocks, tiled).bfloat16())
    tiles = tile_q4(exact_blocks(WEIGHTS["q4"](72, 4 * BLOCK)))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.q4x8_q8_linear(x.half(), tiles.q, tiles.d, tiles.m)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        ops.q4x8_q8_linear(x, tiles.q[:-1], tiles.d[:-1], tiles.m[:-1])
    tiles8 = tile_q8(blocks)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        ops.q8x8_q8_linear(x, tiles8.q[:-1], tiles8.d[:-1])
    with pytest.raises(RuntimeError, match="uint8"):
        ops.q8x8_q8_linear(x, blocks.q, tiles8.d)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.q8_q8_linear(torch.randn(2, 4 * BLOCK - 1), blocks.q, blocks.d)
    with pytest.raises(RuntimeError, match="weights"):
        ops.q8_q8_linear(torch.randn(2, 4 * BLOCK), blocks.q[:, :-1].contiguous(), blocks.d)


def test_q4_tiles_hold_the_same_blocks_and_stack_by_rows():
    """int4's layout for the 8-bit rows kernel: Q4_1 blocks of 8 output rows interleaved, the
    same bytes reordered (back in rows unchanged, the same weights), whole tiles in whole rows
    of the tensors (two layers' tiles stacked are the stacked layers' tiles); none for rows
    that do not make whole tiles, which keep the exact kernel."""
    a, b = (rounded_blocks(torch.randn(rows, 3 * BLOCK), "q4") for rows in (16, 24))
    ta, tb = tile_q4(a), tile_q4(b)
    assert ta.kind == "q4x8" and ta.q.shape == a.q.shape and ta.d.shape == a.d.shape
    back = untile_q4(ta)
    assert all(torch.equal(x, y) for x, y in zip((back.q, back.d, back.m), (a.q, a.d, a.m)))
    assert torch.equal(ta.dense(), a.dense())
    both = tile_q4(Blocks("q4", torch.cat([a.q, b.q]), torch.cat([a.d, b.d]),
                          torch.cat([a.m, b.m])))
    assert torch.equal(both.q, torch.cat([ta.q, tb.q])) and torch.equal(both.m,
                                                                         torch.cat([ta.m, tb.m]))
    # byte 4k + c of vector h in tile 1, block 2: row 8 + k's columns 4h + c (low nibble) and
    # 16 + 4h + c (high)
    k, c, h = 5, 2, 3
    byte = int(tb.q.view(3, 3, 4, 32)[1, 2, h, 4 * k + c])
    row = b.dense()[8 + k, 2 * BLOCK:3 * BLOCK]
    d, m = float(b.d[8 + k, 2]), float(b.m[8 + k, 2])
    assert (byte & 0x0F) * d + m == pytest.approx(float(row[4 * h + c]), rel=1e-6)
    assert (byte >> 4) * d + m == pytest.approx(float(row[16 + 4 * h + c]), rel=1e-6)
    assert tile_q4(rounded_blocks(torch.randn(12, BLOCK), "q4")) is None
    assert tile_q4(rounded_blocks(torch.randn(16, BLOCK), "q8")) is None


def test_q8_tiles_hold_the_same_blocks_and_stack_by_rows():
    """int8's layout (and int4's head's) for the 8-bit rows kernel: Q8_0 blocks of 8 output rows
    interleaved, each weight stored plus 128; back in rows unchanged, whole tiles in whole rows
    of the tensors; none for rows that do not make whole tiles or for other kinds."""
    a, b = (rounded_blocks(torch.randn(rows, 3 * BLOCK), "q8") for rows in (16, 24))
    ta, tb = tile_q8(a), tile_q8(b)
    assert ta.kind == "q8x8" and ta.q.dtype == torch.uint8 and ta.q.shape == a.q.shape
    back = untile_q8(ta)
    assert torch.equal(back.q, a.q) and torch.equal(back.d, a.d)
    assert torch.equal(ta.dense(), a.dense())
    both = tile_q8(Blocks("q8", torch.cat([a.q, b.q]), torch.cat([a.d, b.d]), None))
    assert torch.equal(both.q, torch.cat([ta.q, tb.q])) and torch.equal(both.d,
                                                                         torch.cat([ta.d, tb.d]))
    # byte 4k + c of vector g in tile 1, block 2: row 8 + k's column 4g + c, plus 128
    k, c, g = 5, 2, 6
    byte = int(tb.q.view(3, 3, 8, 32)[1, 2, g, 4 * k + c])
    assert byte - 128 == int(b.q[8 + k, 2 * BLOCK + 4 * g + c])
    assert float(tb.d.view(3, 3, 8)[1, 2, k]) == float(b.d[8 + k, 2])
    assert tile_q8(rounded_blocks(torch.randn(12, BLOCK), "q8")) is None
    assert tile_q8(rounded_blocks(torch.randn(16, BLOCK), "q4")) is None


@needs_kernel
@pytest.mark.parametrize("kind", ["q4", "bf16"])
def test_stacked_layers_compute_their_parts_side_by_side(ops, kind):
    parts = []
    for i, rows in enumerate((24, 8, 8)):
        w = WEIGHTS[kind](rows, 2 * BLOCK, seed=i)
        lin = torch.nn.Linear(2 * BLOCK, rows, bias=False)
        lin.weight = torch.nn.Parameter(w, requires_grad=False)
        parts.append(BlockLinear(lin, exact_blocks(w), ops, max_rows=8))
    x = torch.randn(3, 2 * BLOCK)
    want = torch.cat([p(x) for p in parts], dim=-1)
    stacked = BlockLinear.stacked(parts)
    assert torch.equal(stacked(x), want)
    assert all(torch.equal(p(x), w) for p, w in zip(parts, want.split([24, 8, 8], dim=-1)))
    row = stacked.q.stride(0) * stacked.q.element_size()
    assert parts[1].q.data_ptr() == stacked.q.data_ptr() + 24 * row  # views


def test_the_row_choice_is_measured_once_and_cached(tmp_path, monkeypatch):
    weight = _q4_weight(64, 2 * BLOCK)
    lin = torch.nn.Linear(2 * BLOCK, 64, bias=False)
    lin.weight = torch.nn.Parameter(weight, requires_grad=False)
    layer = BlockLinear(lin, exact_blocks(weight), None, 0)
    calls = []

    def measured(layers, rows=lowbit.CANDIDATE_ROWS):
        calls.append(len(layers))
        return 24, {"24": [1.0, 2.0]}

    monkeypatch.setattr(lowbit, "choose_max_rows", measured)
    assert lowbit._max_rows([layer], tmp_path, "build-a") == (24, {"24": [1.0, 2.0]})
    assert lowbit._max_rows([layer], tmp_path, "build-a")[0] == 24 and calls == [1]
    assert lowbit._max_rows([layer], tmp_path, "build-b")[0] == 24 and calls == [1, 1]
    layer.int8_rows = True  # another kernel over the same blocks: timed for itself
    assert lowbit._max_rows([layer], tmp_path, "build-b")[0] == 24 and calls == [1, 1, 1]
    cached = json.loads((tmp_path / "kernels" / "lowbit-rows.json").read_text())
    assert len(cached) == 3


@needs_kernel
def test_choose_max_rows_times_both_paths(ops):
    layers = []
    for i in range(4):
        w = _q4_weight(256, 8 * BLOCK, seed=i)
        lin = torch.nn.Linear(8 * BLOCK, 256, bias=False)
        lin.weight = torch.nn.Parameter(w, requires_grad=False)
        layers.append(BlockLinear(lin, exact_blocks(w), ops, 0))
    best, timings = lowbit.choose_max_rows(layers, rows=(1, 4))
    assert best in (0, 1, 4) and set(timings) <= {"1", "4"}
    assert all(len(t) == 2 and min(t) > 0 for t in timings.values())




@needs_kernel
def test_the_embedded_model_is_q4_1_with_a_q8_0_head(smollm2):
    if smollm2.dtype != torch.float32:
        pytest.skip("the blocks serve fp32 models")
    loaded = fresh_copy(smollm2)
    prepared = prepare(loaded, EngineConfig())
    report = prepared.lowbit
    blocks = [m for m in loaded.model.modules() if isinstance(m, BlockLinear)]
    assert report.mode == "exact" and report.q4_layers == 210 and report.q8_layers == 1
    head = loaded.model.get_output_embeddings()
    assert isinstance(head, BlockLinear) and head.kind == "q8"
    assert head.weight is loaded.model.get_input_embeddings().weight  # still tied
    assert not any(type(m) is torch.nn.Linear for m in loaded.model.modules())
    # The largest candidate won means no limit (`beyond_timed`).
    assert report.max_rows in (0, *lowbit.CANDIDATE_ROWS[:-1], lowbit.UNBOUNDED)
    assert len(blocks) >= 211
    with original_model(loaded.model):
        assert all(m.max_rows == 0 for m in blocks)
    # The native layers' linear layers take the limit timed over their whole work around the
    # attention (which can differ from the products' own on a host); the rest keep the products'.
    native = {id(b) for m in loaded.model.modules()
              if (n := vars(m).get("_lean_native")) is not None for b in n.linears}
    for m in blocks:
        want = prepared.native.max_rows if id(m) in native else report.max_rows
        assert m.max_rows == want, (m, prepared.native)
    again = prepare(loaded, EngineConfig()).lowbit  # a second engine over the same model
    assert (again.mode, again.q4_layers, again.q8_layers) == ("exact", 210, 1)
    off = fresh_copy(smollm2)
    assert prepare(off, EngineConfig(linear_kernel="torch")).lowbit.mode == "off"
    assert not any(isinstance(m, BlockLinear) for m in off.model.modules())


@needs_kernel
@pytest.mark.parametrize("timed", [lowbit.CANDIDATE_ROWS[-1], 256])
def test_a_kernel_that_wins_at_the_largest_count_timed_serves_every_forward(
        smollm2, ops, monkeypatch, tmp_path, timed):
    """Past a few dozen rows both products cost the same per row, so a kernel that won at the
    largest count timed also takes forwards beyond it (a long prompt in one step); one that
    lost there keeps its limit, and larger forwards go to the dense product."""
    model = fresh_copy(smollm2).model
    monkeypatch.setattr(lowbit, "choose_max_rows", lambda layers: (timed, {}))
    report = lowbit.install(model, ops, "int4", tmp_path, "key")
    want = lowbit.UNBOUNDED if timed == lowbit.CANDIDATE_ROWS[-1] else timed
    layer = model.model.layers[0].mlp.down_proj
    assert report.max_rows == layer.max_rows == want
    x = torch.randn(600, layer.in_features, dtype=layer.weight.dtype)
    with torch.inference_mode():
        through = layer.kernel_product(x) if want == lowbit.UNBOUNDED else layer.dense_product(x)
        assert torch.equal(layer(x), through)
        assert not torch.equal(layer.kernel_product(x), layer.dense_product(x))


def test_a_gguf_model_loaded_in_bf16_gets_its_blocks_back(smollm2):
    """Every layer of the embedded Q4_1 model, rounded to bf16, yields blocks that hold its
    fp32 weights exactly; bf16 weights that are no blocks' yield none."""
    model = fresh_copy(smollm2).model
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    assert len(linears) == 211
    for layer in linears:
        blocks = blocks_of_bf16(layer.weight.detach().bfloat16())
        assert blocks is not None and torch.equal(blocks.dense(), layer.weight.float())
    noise = (torch.randn(64, 128, generator=torch.Generator().manual_seed(0)) * 0.05)
    assert blocks_of_bf16(noise.bfloat16()) is None
    assert blocks_of_bf16(_q4_weight(64, 128)) is None  # fp32: exact_blocks' case


@needs_kernel
def test_a_bf16_engine_multiplies_few_rows_through_the_blocks(smollm2, make_engine):
    """bf16 layers holding a GGUF's blocks compute forwards of few rows from the blocks, in
    fp32 (the file's own weights), larger ones through oneDNN's bf16 product."""
    loaded = fresh_copy(smollm2)
    loaded = LoadedModel(loaded.model.to(torch.bfloat16), loaded.tokenizer, loaded.name,
                         loaded.source, loaded.device, torch.bfloat16, 0.0, False)
    eng = make_engine(loaded, prompt_cache_bytes=0)
    report = eng.linear_blocks
    assert (report.mode, report.q4_layers, report.q8_layers) == ("exact", 210, 1)
    layer = loaded.model.model.layers[3].mlp.down_proj
    assert isinstance(layer, BlockLinear) and layer.weight.dtype == torch.bfloat16
    x = torch.randn(1, layer.in_features, generator=torch.Generator().manual_seed(2)).bfloat16()
    exact = x.float() @ blocks_dense(layer).T  # the file's fp32 weights
    layer.max_rows = 8
    few = layer(x)
    assert few.dtype == torch.bfloat16
    assert torch.allclose(few.float(), exact, rtol=1e-2, atol=1e-3)
    layer.max_rows = 0
    assert (layer.dense_packed is not None) == onednn_bf16(layer.weight)
    many = layer(x)
    assert torch.allclose(many.float(), exact, rtol=5e-2, atol=5e-2)
    assert (few.float() - exact).abs().mean() < (many.float() - exact).abs().mean()
    ids = loaded.tokenizer.encode("The capital of France is")
    handle = eng.submit(ids, SamplingParams(strategy="greedy", max_new_tokens=8))
    eng.run_until_idle()
    assert "Paris" in collect(handle)[0]["text"]


@needs_kernel
@pytest.mark.parametrize("quantize,kinds", [("int4", {"q4x8", "q8x8"}), ("int8", {"q8x8"})])
def test_int4_and_int8_on_a_bf16_model_round_into_blocks_too(smollm2, make_engine, monkeypatch,
                                                              quantize, kinds):
    """`quantize=int4` (and int8) on a bf16 model (the default dtype where the CPU has bf16)
    takes the 8-bit rows kernel for few rows and the rounded weights in bf16 (oneDNN's product
    where it packs them) for many, as on an fp32 model; before, it fell to PyTorch's int4
    products and ran slower than the bf16 default on AVX512-BF16."""
    loaded = fresh_copy(smollm2)
    loaded = LoadedModel(loaded.model.to(torch.bfloat16), loaded.tokenizer, loaded.name,
                         loaded.source, loaded.device, torch.bfloat16, 0.0, False)
    monkeypatch.setattr(lowbit, "_max_rows", lambda layers, cache, key: (8, None))
    eng = make_engine(loaded, quantize=quantize, prompt_cache_bytes=0, num_speculative_tokens=0)
    assert (eng.linear_blocks.mode, eng.linear_blocks.int8_rows) == (quantize, True)
    model = loaded.model
    layers = [m for m in model.modules() if isinstance(m, BlockLinear)]
    assert layers and all(m.rounded and m.int8_rows for m in layers)
    assert {m.kind for m in layers} == kinds
    # the native layers multiply few rows through the 8-bit rows kernel too
    assert vars(model.model.layers[0])["_lean_native"].blocks[0][0] == (
        6 if quantize == "int4" else 8)
    assert all(m.weight.dtype == torch.bfloat16 for m in layers)
    stacks = [vars(layer)["_lean_stacked"] for layer in model.model.layers]
    stacked = [*(s.qkv for s in stacks), *(s.gate_up for s in stacks)]
    assert all(m.weight.dtype == torch.bfloat16 and m.int8_rows for m in stacked)
    assert all((m.dense_packed is not None) == onednn_bf16(m.weight) for m in stacked)
    ids = loaded.tokenizer.encode("The capital of France is Paris. The capital of Italy is")
    _kernel_rows(model, 64)
    with torch.inference_mode():
        rows = model(input_ids=torch.tensor([ids])).logits[0].float().log_softmax(-1)
        _kernel_rows(model, 0)
        dense = model(input_ids=torch.tensor([ids])).logits[0].float().log_softmax(-1)
    kl = (dense.exp() * (dense - rows)).sum(-1)
    assert 0 < kl.mean() < 0.02 and (rows.argmax(-1) == dense.argmax(-1)).float().mean() >= 0.85
    _kernel_rows(model, 8)
    handle = eng.submit(loaded.tokenizer.encode("The capital of France is"),
                        SamplingParams(strategy="greedy", max_new_tokens=8))
    eng.run_until_idle()
    assert "Paris" in collect(handle)[0]["text"]


def blocks_dense(layer: BlockLinear) -> torch.Tensor:
    from engine.model.blocks import Blocks

    return Blocks(layer.kind, layer.q, layer.d, layer.m).dense()


@needs_kernel
@pytest.mark.parametrize("quantize", ["none", "bf16-values"])
def test_greedy_with_blocks_equals_generate_alone_and_batched(smollm2, make_engine, quantize,
                                                              monkeypatch):
    """The anchor with the kernel serving every decode forward (max_rows forced above the
    batch): exact blocks against generate on the fp32 model, and 16-bit values (the model's
    weights rounded to bf16 beforehand, as a bf16 model loaded in fp32 holds them) against
    generate on that model; one job at a time and a rolling batch of 5. (Rounded blocks,
    `quantize=int4`, also round the rows: their own test below.)"""
    if smollm2.dtype != torch.float32:
        pytest.skip("the blocks serve fp32 models")
    loaded = fresh_copy(smollm2)
    if quantize == "bf16-values":
        with torch.no_grad():
            for p in loaded.model.parameters():
                p.copy_(p.bfloat16().float())
        # Its row limit is set below: timing one for these blocks (seconds) would be unused.
        monkeypatch.setattr(lowbit, "_max_rows", lambda layers, cache, key: (64, None))
    eng = make_engine(loaded, quantize="none" if quantize == "bf16-values" else quantize,
                      prompt_cache_bytes=0)
    layers = [m for m in loaded.model.modules() if isinstance(m, BlockLinear)]
    kinds = ("bf16", "bf16") if quantize == "bf16-values" else ("q4", "q8")
    assert layers and all(m.kind == (kinds[1] if m is layers[-1] else kinds[0])
                          for m in layers[-2:])
    stacks = [vars(layer)["_lean_stacked"] for layer in loaded.model.model.layers]
    assert all(isinstance(s.qkv, BlockLinear) for s in stacks)
    for m in [*layers, *(s.qkv for s in stacks), *(s.gate_up for s in stacks)]:
        m.max_rows = 64
    tok = loaded.tokenizer
    prompts = varied_prompts(tok, 5)
    budgets = [10 + 3 * i for i in range(len(prompts))]
    want = [reference_greedy(loaded.model, ids, n, n) for ids, n in zip(prompts, budgets)]
    h = eng.submit(prompts[0], SamplingParams(strategy="greedy", max_new_tokens=budgets[0],
                                              min_new_tokens=budgets[0]))
    eng.run_until_idle()
    assert collect(h)[0]["tokens"] == want[0]
    handles = [eng.submit(ids, SamplingParams(strategy="greedy", max_new_tokens=n,
                                              min_new_tokens=n))
               for ids, n in zip(prompts, budgets)]
    eng.run_until_idle()
    assert [collect(h)[0]["tokens"] for h in handles] == want


def _kernel_rows(model: torch.nn.Module, rows: int) -> None:
    """Every block layer of `model`, stacked ones included, takes forwards of up to `rows`."""
    stacks = [vars(layer)["_lean_stacked"] for layer in model.model.layers]
    natives = [vars(layer)["_lean_native"] for layer in model.model.layers]
    for m in [*model.modules(), *(s.qkv for s in stacks), *(s.gate_up for s in stacks),
              *(b for n in natives if n is not None for b in n.linears)]:
        if isinstance(m, BlockLinear):
            m.max_rows = rows


@needs_kernel
def test_int4_rounds_rows_to_8_bits_and_a_sequence_decodes_as_it_would_alone(
        smollm2, make_engine, monkeypatch):
    """`quantize=int4` multiplies few rows as llama.cpp does (rows rounded to 8 bits, integer
    sums), an approximation judged by its distance from the model: teacher-forced next-token
    distributions stay close to those of the rounded weights' own fp32 products. Each row's
    products depend on that row alone, so where every forward takes the kernel a sequence's
    greedy tokens are the same alone and in a rolling batch; with drafts, the copied span."""
    if smollm2.dtype != torch.float32:
        pytest.skip("the blocks serve fp32 models")
    from engine.sample import speculative
    from tests.engine.test_speculative import COPYING

    loaded = fresh_copy(smollm2)
    # The row limits are set below (_kernel_rows): timing them (seconds) would be unused.
    monkeypatch.setattr(lowbit, "_max_rows", lambda layers, cache, key: (64, None))
    eng = make_engine(loaded, quantize="int4", prompt_cache_bytes=0, num_speculative_tokens=0)
    model = loaded.model
    layers = [m for m in model.modules() if isinstance(m, BlockLinear)]
    assert layers and all(m.rounded and m.int8_rows for m in layers)
    assert {m.kind for m in layers} == {"q4x8", "q8x8"}  # in tiles of 8 output rows
    # the rounded head has its own weights; the embeddings keep theirs
    assert model.get_output_embeddings().weight is not model.get_input_embeddings().weight
    assert vars(model.model.layers[0])["_lean_native"].blocks[0][0] == 6  # q4x8 x q8 rows

    tok = loaded.tokenizer
    ids = tok.encode("The capital of France is Paris. The capital of Italy is Rome, and the")
    _kernel_rows(model, 64)
    with torch.inference_mode():
        rounded_rows = model(input_ids=torch.tensor([ids])).logits[0].log_softmax(-1)
        _kernel_rows(model, 0)
        products = model(input_ids=torch.tensor([ids])).logits[0].log_softmax(-1)
    kl = (products.exp() * (products - rounded_rows)).sum(-1)
    assert 0 < kl.mean() < 0.02 and kl.max() < 0.2
    assert (rounded_rows.argmax(-1) == products.argmax(-1)).float().mean() >= 0.85

    # Every forward through the kernel: a decode row that shares a forward with a long prompt
    # chunk takes the fp32 product of the weights instead (past the row limit), like any
    # other row of that forward.
    _kernel_rows(model, 1 << 20)
    prompts = [tok.encode(t) for t in COPYING[:3]] + varied_prompts(tok, 2)

    def greedy(n: int = 16) -> SamplingParams:  # no min_new_tokens: it keeps drafts off
        return SamplingParams(strategy="greedy", max_new_tokens=n)

    alone = []
    for p in prompts:
        h = eng.submit(p, greedy())
        eng.run_until_idle()
        alone.append(collect(h)[0]["tokens"])
    handles = [eng.submit(p, greedy()) for p in prompts]
    eng.run_until_idle()
    assert [collect(h)[0]["tokens"] for h in handles] == alone
    monkeypatch.setattr(speculative.Payoff, "length", lambda self, rows: self.k)
    drafting = make_engine(loaded, quantize="int4", prompt_cache_bytes=0,
                           num_speculative_tokens=4)
    _kernel_rows(model, 1 << 20)
    # A draft's verification attends over several query tokens of the row at once, summing in
    # another order than one-token steps; rows rounded to 8 bits can carry that last-bit
    # difference across a rounding step, so a near-tie may resolve the other way. The copied
    # list (the first 12 tokens of each copying prompt) must come out the same.
    for p, want in zip(prompts[:3], alone):
        h = drafting.submit(p, greedy())
        drafting.run_until_idle()
        assert collect(h)[0]["tokens"][:12] == want[:12]
    assert drafting.stats().spec_accepted_tokens >= 10


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_layers_equal_the_python_forward_bit_for_bit(smollm2, dtype, monkeypatch):
    """A layer whose linear layers are in blocks runs its work around the attention in the
    native library, multiplying in blocks up to their row limit and densely above it (oneDNN's
    prepacked copy on bf16): every step's logits and the KV cache equal those of the layer's
    Python forward bit for bit (the same arithmetic: ATen's operators called from C++, or for
    layers in blocks passes over the rows that round as those operators do)."""
    fresh = fresh_copy(smollm2)
    model = fresh.model.to(dtype)
    loaded = LoadedModel(model, fresh.tokenizer, fresh.name, fresh.source, fresh.device, dtype,
                         0.0, False)
    prepare(loaded, EngineConfig())
    layers = list(model.model.layers)
    natives = [vars(layer)["_lean_native"] for layer in layers]
    assert all(n is not None for n in natives)
    for m in [*model.modules(), *(b for n in natives for b in n.linears)]:
        if isinstance(m, BlockLinear):
            m.max_rows = 3  # whatever this host's timing chose (the stacked ones are no modules)
    calls = []
    native_output = llama_layers._Native.attention_output
    monkeypatch.setattr(llama_layers._Native, "attention_output",
                        lambda *a: calls.append(a[-1][0][0]) or native_output(*a))
    ids = torch.tensor([loaded.tokenizer.encode("The capital of France is Paris, and the")])
    cuts = [ids.shape[1] - 5, ids.shape[1] - 2, ids.shape[1] - 1]  # 4 rows (dense), 3, 1, 1
    native = forward_in_chunks(model, ids, cuts)
    dense = 5 if natives[0].linears[0].dense_packed is not None else 4  # oneDNN's, or F.linear's
    assert dtype == torch.float32 or not onednn_bf16(natives[0].linears[0].weight) \
        or dense == 5
    kind = natives[0].blocks[0][0]
    assert calls == [dense] * len(layers) + [kind] * (3 * len(layers))
    python = python_forward_in_chunks(model, ids, cuts)
    assert len(calls) == 4 * len(layers)
    assert_same_forwards(native, python)


@needs_kernel
def test_the_native_row_limit_is_timed_beyond_the_linear_layers_and_dense_turns_it_off(
        smollm2, monkeypatch):
    fresh = fresh_copy(smollm2)
    prepare(fresh, EngineConfig())
    natives = [vars(layer)["_lean_native"] for layer in fresh.model.model.layers]
    for b in (b for n in natives for b in n.linears):
        b.max_rows = 2
    monkeypatch.setattr(llama_layers, "CANDIDATE_ROWS", (1, 2, 4, 8))
    report = llama_layers.time_native(fresh.model, None, "test", None)
    assert report.layers == len(natives) and report.max_rows in (2, 4, 8)
    assert set(report.timings) <= {"4", "8"} and "4" in report.timings  # only beyond 2
    # one limit for the native and the Python forwards: the stacked layers' own
    assert all(b.max_rows == report.max_rows for n in natives for b in n.linears)
    rows = torch.zeros(report.max_rows, 1, fresh.model.config.hidden_size,
                       dtype=natives[0].dtype)  # the shared model's dtype: this host's default
    first = natives[0]
    assert first.blocks_for(rows) is first.blocks
    assert first.blocks_for(rows.new_zeros(16, 1, rows.shape[-1])) is first.dense
    for b in first.linears:
        b.max_rows = 0  # dense products asked for (engine.model.prepare.original_model)
    assert first.blocks_for(rows[:1]) is first.dense
    first.linears[0].max_rows = report.max_rows
    assert first.blocks_for(rows[:1]) is None  # the layers' limits disagree: Python decides
    assert first.blocks_for(rows.float() if rows.dtype != torch.float32 else rows.bfloat16()) \
        is None  # rows of another dtype: the Python forward's own conversions
