"""The compiled decode-attention kernel (engine/kernels/decode_attention.py and its csrc/): it
builds where a compiler and AVX512 are at hand, computes what PyTorch's SDPA computes (no
further from an fp32 reference than SDPA itself, in bf16), and the engine routes one-query
attention through it only where it applies."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engine import EngineConfig, LoadedModel, SamplingParams
from engine.kernels import decode_attention as native
from engine.model import packed_forward as fused
from engine.model.loader import default_cache_dir


def _avx512() -> bool:
    """The kernel's vector path: AVX512 F, BW and VL."""
    flags = set(native._cpu_flags().split())
    return {"avx512f", "avx512bw", "avx512vl"} <= flags


needs_kernel = pytest.mark.skipif(
    shutil.which("c++") is None or not _avx512(),
    reason="the kernel is built only with a C++ compiler, and used only with AVX512")


@pytest.fixture(scope="module")
def kernel():
    if shutil.which("c++") is None or not _avx512():
        pytest.skip("no C++ compiler or no AVX512 here")
    module = native.decode_attention_kernel(default_cache_dir())
    assert module is not None, "a compiler and AVX512 are here, yet the kernel did not build"
    return module


@needs_kernel
def test_the_kernel_builds_once_and_says_which_shapes_it_vectorises(kernel):
    assert kernel.instruction_set() in ("avx512", "avx512-bf16")
    assert native.decode_attention_kernel(default_cache_dir()) is kernel  # built once
    assert kernel.vectorised(64, 3) and kernel.vectorised(64, 1)
    assert not kernel.vectorised(128, 3) and not kernel.vectorised(64, 5)


def test_a_new_source_or_new_flags_make_a_new_build(tmp_path, monkeypatch):
    key = native.build_key()
    assert len(key) == 16 and key == native.build_key()
    copy = tmp_path / "decode_attention.cpp"
    copy.write_text(native.SOURCE.read_text() + "\n// changed\n")
    monkeypatch.setattr(native, "SOURCE", copy)
    assert native.build_key() != key
    monkeypatch.undo()
    monkeypatch.setattr(native, "FLAGS", (*native.FLAGS, "-DSEQGATE_TEST"))
    assert native.build_key() != key
    monkeypatch.undo()  # another virtual environment: its headers' paths are in the command
    monkeypatch.setattr(native, "_installation", lambda: ("/other/venv/torch", "/other/include"))
    assert native.build_key() != key


@needs_kernel
@pytest.mark.timeout(300)
def test_a_lock_left_by_a_killed_build_does_not_hang_the_next_start(kernel, monkeypatch):
    """torch's builder waits forever on a `lock` file that a process killed mid-build left."""
    where = default_cache_dir() / "kernels" / f"seqgate_decode_attention_{native.build_key()}"
    (where / "lock").write_text("")
    monkeypatch.setattr(native, "_built", {})
    again = native.decode_attention_kernel(default_cache_dir())
    assert again is not None and not (where / "lock").exists()


@needs_kernel
@pytest.mark.timeout(300)
def test_the_same_source_elsewhere_reuses_the_build(kernel, tmp_path):
    """Another checkout (or install) of the same source, in another process, shares the build
    instead of making ninja recompile it (its command names the copy in the build directory).
    torch's builder skips the build step for a source it loaded before in the same process, so
    the other start is a process of its own."""
    where = default_cache_dir() / "kernels" / f"seqgate_decode_attention_{native.build_key()}"
    built = (where / "decode_attention.o").stat().st_mtime_ns
    elsewhere = tmp_path / "csrc" / "decode_attention.cpp"
    elsewhere.parent.mkdir()
    elsewhere.write_bytes(native.SOURCE.read_bytes())
    start = ("import sys, pathlib; from engine.kernels import decode_attention as native; "
             "from engine.model.loader import default_cache_dir; "
             " native.SOURCE = pathlib.Path(sys.argv[1]); "
             "sys.exit(native.decode_attention_kernel(default_cache_dir()) is None)")
    subprocess.run([sys.executable, "-c", start, str(elsewhere)], check=True, timeout=290,
                   cwd=Path(native.__file__).parents[2])
    assert (where / "decode_attention.o").stat().st_mtime_ns == built
    assert str(tmp_path) not in (where / "build.ninja").read_text()


def _slab_view(rows, kv_heads, columns, dim, spare=24, gen=None, scale=1.0):
    """KV as the engine holds it: a window of a slab with spare columns."""
    full = torch.randn(rows, kv_heads, columns + spare, dim, generator=gen) * scale
    return full.to(torch.bfloat16)[:, :, :columns]


def _reference(q, k, v, mask, scale):
    """fp32 attention of bf16 inputs, grouped-query heads repeated."""
    rows, heads, dim = q.shape
    groups = heads // k.shape[1]
    kf = k.float().repeat_interleave(groups, 1)
    vf = v.float().repeat_interleave(groups, 1)
    s = torch.einsum("rhd,rhcd->rhc", q.float(), kf) * scale
    if mask is not None:
        s = s.masked_fill(~mask[:, None, :], float("-inf"))
    return torch.einsum("rhc,rhcd->rhd", torch.softmax(s, -1), vf)


@needs_kernel
@pytest.mark.parametrize("rows,kv_heads,groups,dim", [
    (1, 3, 3, 64), (5, 3, 3, 64), (4, 2, 1, 64), (3, 1, 4, 64), (2, 2, 2, 64),
    (3, 2, 5, 64),  # five query heads per KV head: the generic path
    (2, 2, 3, 16),  # head dim 16: the generic path
])
@pytest.mark.parametrize("columns", [1, 15, 16, 17, 47, 200])
@pytest.mark.parametrize("masking", ["none", "left padding", "scattered"])
def test_the_kernel_is_as_close_to_fp32_as_sdpa(kernel, rows, kv_heads, groups, dim, columns,
                                               masking):
    gen = torch.Generator().manual_seed(rows * 1000 + columns * 10 + groups)
    heads = kv_heads * groups
    # the query as the packed forward hands it over: a strided view
    packed = (torch.randn(1, heads, rows + 2, dim, generator=gen) * 2).to(torch.bfloat16)
    q = packed[:, :, 1:rows + 1].transpose(0, 2)[:, :, 0]  # [rows, heads, dim], not contiguous
    k = _slab_view(rows, kv_heads, columns, dim, gen=gen, scale=3.0)
    v = _slab_view(rows, kv_heads, columns, dim, gen=gen)
    mask = None
    if masking == "left padding":
        starts = torch.randint(0, columns, (rows,), generator=gen)
        mask = torch.arange(columns)[None, :] >= starts[:, None]
    elif masking == "scattered":
        mask = torch.rand(rows, columns, generator=gen) > 0.4
        mask[:, -1] = True
    scale = dim ** -0.5
    got = kernel.decode_attention(q, k, v, mask, scale)
    assert got.shape == (rows, heads, dim) and got.dtype == torch.bfloat16
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q.reshape(rows, kv_heads, groups, dim), k, v,
        attn_mask=None if mask is None else mask[:, None, None, :], scale=scale,
    ).reshape(rows, heads, dim)
    want = _reference(q, k, v, mask, scale)
    err = (got.float() - want).abs().max().item()
    sdpa_err = (sdpa.float() - want).abs().max().item()
    assert err <= max(2 * sdpa_err, 2e-3), (err, sdpa_err)


@needs_kernel
def test_a_nan_among_shown_keys_comes_out_as_nan_as_with_sdpa(kernel):
    gen = torch.Generator().manual_seed(3)
    k = _slab_view(2, 3, 40, 64, gen=gen)
    v = _slab_view(2, 3, 40, 64, gen=gen)
    k[1, 0, 7, 5] = float("nan")
    q = torch.randn(2, 9, 64, generator=gen).to(torch.bfloat16)
    mask = torch.ones(2, 40, dtype=torch.bool)
    out = kernel.decode_attention(q, k, v, mask, 0.125)
    assert out[1, :3].isnan().all() and not out[0].isnan().any() and not out[1, 3:].isnan().any()
    mask[1, 7] = False  # hidden, it is left out
    assert not kernel.decode_attention(q, k, v, mask, 0.125).isnan().any()


@needs_kernel
def test_sdpa_dispatch_takes_the_kernel_only_where_it_applies(kernel):
    """`fused._sdpa` hands one-query bf16 steps with a bool row mask to the kernel, and
    everything else (fp32, several queries, additive masks) to SDPA, with the same result."""
    calls = []

    class Spy:
        def decode_attention(self, *args):
            calls.append(args[0].shape)
            return kernel.decode_attention(*args)

    module = SimpleNamespace(num_key_value_groups=3, is_causal=True)
    setattr(module, fused.DECODE_KERNEL_ATTR, Spy())
    gen = torch.Generator().manual_seed(0)
    k = _slab_view(4, 3, 40, 64, gen=gen)
    v = _slab_view(4, 3, 40, 64, gen=gen)
    mask = torch.ones(4, 1, 1, 40, dtype=torch.bool)
    mask[0, ..., :5] = False
    q = torch.randn(4, 9, 1, 64, generator=gen).to(torch.bfloat16)
    out, _ = fused._sdpa(module, q, k, v, mask, scaling=0.125)
    assert calls == [(4, 9, 64)] and out.shape == (4, 1, 9, 64)
    plain, _ = fused._sdpa(SimpleNamespace(num_key_value_groups=3, is_causal=True), q, k, v,
                           mask, scaling=0.125)
    torch.testing.assert_close(out, plain, atol=2e-2, rtol=2e-2)
    fused._sdpa(module, q, k, v, None, scaling=0.125)  # no mask: the kernel too
    assert len(calls) == 2
    additive = torch.zeros(4, 1, 1, 40, dtype=torch.bfloat16)
    fused._sdpa(module, q, k, v, additive, scaling=0.125)
    fused._sdpa(module, q.float(), k.float(), v.float(), mask, scaling=0.125)
    chunk_mask = torch.ones(1, 1, 3, 40, dtype=torch.bool)
    fused._sdpa(module, q[:1].expand(1, 9, 3, 64).contiguous(), k[:1], v[:1], chunk_mask,
                scaling=0.125)
    assert len(calls) == 2


def _tiny_llama(dtype: torch.dtype, smollm2: LoadedModel, heads: int = 6,
                head_dim: int = 64) -> LoadedModel:
    """A 2-layer random Llama with 2 KV heads; by default SmolLM2's head size (64) and 3 query
    heads per KV head."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=smollm2.model.config.vocab_size, hidden_size=heads * head_dim,
                      intermediate_size=256, num_hidden_layers=2, num_attention_heads=heads,
                      num_key_value_heads=2, max_position_embeddings=2048,
                      eos_token_id=smollm2.model.config.eos_token_id,
                      tie_word_embeddings=True, attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg).to(dtype).eval()
    return LoadedModel(model, smollm2.tokenizer, "tiny", "random", torch.device("cpu"), dtype,
                       0.0, False)


@needs_kernel
def test_a_bf16_cpu_engine_decodes_through_the_kernel(smollm2, make_engine, kernel):
    loaded = _tiny_llama(torch.bfloat16, smollm2)
    eng = make_engine(loaded)
    assert eng.decode_kernel_layers == 2
    attention = [m for m in loaded.model.modules() if hasattr(m, "num_key_value_groups")]
    calls = []

    class Spy:
        vectorised = kernel.vectorised

        def decode_attention(self, *args):
            calls.append(args[0].shape[0])
            return kernel.decode_attention(*args)

    fused.use_decode_kernel(loaded.model, Spy())
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12, 13, 14, 15]]
    handles = [eng.submit(p, SamplingParams(max_new_tokens=6, strategy="greedy",
                                            ignore_eos=True)) for p in prompts]
    eng.run_until_idle()
    for h in handles:
        tokens = [t for d in h.iter_sync(timeout=1) for t in d.token_ids]
        assert len(tokens) == 6
    # every decoded token after the first (which the prompt's chunk gives), in every layer
    assert sum(calls) == len(prompts) * 5 * len(attention)
    # turned off, or in fp32: SDPA, and no layer holds the kernel
    assert make_engine(loaded, decode_attention="sdpa").decode_kernel_layers == 0
    assert all(getattr(m, fused.DECODE_KERNEL_ATTR) is None for m in attention)
    assert make_engine(_tiny_llama(torch.float32, smollm2)).decode_kernel_layers == 0
    # shapes the kernel only runs on its scalar path: SDPA
    assert make_engine(_tiny_llama(torch.bfloat16, smollm2, heads=10)).decode_kernel_layers == 0
    assert make_engine(_tiny_llama(torch.bfloat16, smollm2, head_dim=128)) \
        .decode_kernel_layers == 0
    # without the packed forward nothing dispatches to it: not even built
    assert make_engine(_tiny_llama(torch.bfloat16, smollm2),
                       fuse_sub_batches=False).decode_kernel_layers == 0


def test_a_kernel_that_cannot_build_leaves_attention_to_sdpa(tmp_path, monkeypatch, caplog):
    """No compiler: the build fails, the engine is told None and says why once."""
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(native, "SOURCE", Path(tmp_path / "missing.cpp"))
    (tmp_path / "missing.cpp").write_text("#error this source does not compile\n")
    with caplog.at_level("WARNING", logger="seqgate.native"):
        assert native.decode_attention_kernel(tmp_path / "cache") is None
    assert "using PyTorch's SDPA" in caplog.text


def test_decode_attention_is_a_checked_setting():
    assert EngineConfig(decode_attention="sdpa").decode_attention == "sdpa"
    with pytest.raises(ValueError, match="decode_attention"):
        EngineConfig(decode_attention="flash")
