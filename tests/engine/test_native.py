"""The compiled decode-attention kernel (engine/kernels/native.py and its csrc/): it
builds where a compiler and a vector instruction set (AVX512, AVX2, NEON) are at hand, computes
what PyTorch's SDPA computes (in bf16 no further from an fp32 reference than SDPA itself, in fp32
within 1e-5), takes only the calls it is built for, and the engine routes one-query attention
through it only where it applies."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from engine import EngineConfig, LoadedModel, SamplingParams
from engine.kernels import native
from engine.model import packed_forward as fused
from engine.model.loader import default_cache_dir


def _buildable() -> bool:
    try:
        return shutil.which("c++") is not None and native.instruction_set() is not None
    except ValueError:  # SEQGATE_KERNEL_ISA names an instruction set this CPU lacks
        return False


needs_kernel = pytest.mark.skipif(
    not _buildable(), reason="the kernel is built only with a C++ compiler and AVX2/AVX512/NEON")


@pytest.fixture(scope="module")
def kernel():
    if not _buildable():
        pytest.skip("no C++ compiler or no vector instruction set the kernel is built for here")
    built = native.kernels(default_cache_dir())
    assert built is not None, "a compiler and a vector instruction set are here, yet no kernel"
    return built


@needs_kernel
def test_the_kernel_builds_once_and_says_what_it_is_built_for(kernel):
    assert kernel.instruction_set() == native.instruction_set()
    assert native.kernels(default_cache_dir()) is kernel  # built once
    for dtype in (torch.bfloat16, torch.float32):
        for dim in (64, 128):
            assert all(kernel.instantiated(dtype, dim, groups) for groups in range(1, 9))
        assert not kernel.instantiated(dtype, 64, 9) and not kernel.instantiated(dtype, 96, 3)
    assert not kernel.instantiated(torch.float16, 64, 3)
    # an fp16 KV cache under an fp32 model (kv_cache_dtype), not under a bf16 one
    assert kernel.instantiated(torch.float32, 128, 8, torch.float16)
    assert not kernel.instantiated(torch.bfloat16, 64, 3, torch.float16)


def test_a_new_source_or_new_flags_make_a_new_build(tmp_path, monkeypatch):
    key, code = native.build_key(), native.code_key()
    assert len(key) == 16 and key == native.build_key() and code != key
    copy = tmp_path / "decode_attention.cpp"
    copy.write_text(native.SOURCES[0].read_text() + "\n// changed\n")
    monkeypatch.setattr(native, "SOURCES", (copy, *native.SOURCES[1:]))
    assert native.build_key() != key and native.code_key() != code
    monkeypatch.undo()
    monkeypatch.setattr(native, "FLAGS", (*native.FLAGS, "-DSEQGATE_TEST"))
    assert native.build_key() != key and native.code_key() != code
    monkeypatch.undo()  # another virtual environment: its headers' paths are in the command
    monkeypatch.setattr(native, "_installation", lambda: ("/other/venv/torch", "/other/include"))
    assert native.build_key() != key
    assert native.code_key() == code  # the same code: the host's timings of it still hold


AVX512_HOST = "fpu sse sse2 avx avx2 fma f16c avx512f avx512dq avx512bw avx512vl"
AVX2_HOST = "fpu sse sse2 avx avx2 fma f16c"


def test_the_build_is_for_the_best_instruction_set_the_cpu_has(monkeypatch):
    monkeypatch.delenv(native.ISA_ENV, raising=False)
    for flags, isa in [(AVX512_HOST, "avx512"), (AVX2_HOST, "avx2"), ("fp asimd", "neon"),
                       ("fpu sse sse2 avx", None)]:
        monkeypatch.setattr(native, "_cpu_flags", lambda flags=flags: flags)
        assert native.instruction_set() == isa
    assert "-DCPU_CAPABILITY_AVX512" in native._flags("avx512")
    assert "-DCPU_CAPABILITY_AVX2" in native._flags("avx2") and "-mfma" in native._flags("avx2")
    monkeypatch.setattr(native, "_cpu_flags", lambda: AVX512_HOST)
    avx512 = native.build_key()
    monkeypatch.setenv(native.ISA_ENV, "avx2")  # the AVX2 build on an AVX512 CPU
    assert native.instruction_set() == "avx2" and native.build_key() != avx512


def test_the_avx512_sources_compile_on_an_avx2_host(tmp_path):
    """An AVX2 host builds only the AVX2 library (an AVX512 host builds both: the widened int8
    product's test builds the AVX2 one), so a source that compiles for AVX2 but not with the
    AVX512 flags (an AVX2 intrinsic needing a flag -mavx512f does not imply) went unnoticed until
    an AVX512 host ran without kernels. Compiled, not run, at -O0: where an intrinsic lacks its
    target flag GCC refuses to inline it at any level."""
    cxx = os.environ.get("CXX", "c++")  # the compiler torch's builder runs
    if shutil.which(cxx) is None or native.instruction_set() != "avx2":
        pytest.skip("needs a C++ compiler on a host whose own build is the AVX2 one")
    from torch.utils import cpp_extension

    includes = [f"-I{p}" for p in (*cpp_extension.include_paths(),
                                   sysconfig.get_paths()["include"])]
    flags = [f for f in native._flags("avx512") if f != "-O3"]
    commands = [[cxx, "-std=c++20", "-O0", "-fPIC", *flags, *includes,
                 "-DTORCH_EXTENSION_NAME=compile_check", "-c", str(source),
                 "-o", str(tmp_path / f"{source.stem}.o")] for source in native.SOURCES]
    jobs = [subprocess.Popen(c, stderr=subprocess.PIPE, text=True) for c in commands]
    # Each job's messages are read to the end before its exit code (a full pipe would block).
    errors = [job.communicate()[1] for job in jobs]
    failed = {source.name: native._failure(RuntimeError(err))
              for source, job, err in zip(native.SOURCES, jobs, errors) if job.returncode}
    assert not failed, failed


def test_an_instruction_set_the_cpu_lacks_leaves_attention_to_sdpa(tmp_path, monkeypatch,
                                                                     caplog):
    monkeypatch.setattr(native, "_cpu_flags", lambda: AVX2_HOST)
    monkeypatch.setenv(native.ISA_ENV, "avx512")
    with caplog.at_level("WARNING", logger="seqgate.native"):
        assert native.kernels(tmp_path) is None
    assert "lacks avx512bw" in caplog.text and "using PyTorch's SDPA" in caplog.text
    assert not (tmp_path / "kernels").exists()  # nothing was built
    monkeypatch.setenv(native.ISA_ENV, "sse")
    with pytest.raises(ValueError, match="not one of"):
        native.instruction_set()


@needs_kernel
@pytest.mark.timeout(300)
def test_a_lock_left_by_a_killed_build_does_not_hang_the_next_start(kernel, monkeypatch):
    """torch's builder waits forever on a `lock` file that a process killed mid-build left."""
    where = default_cache_dir() / "kernels" / f"seqgate_native_{native.build_key()}"
    (where / "lock").write_text("")
    monkeypatch.setattr(native, "_built", {})
    again = native.kernels(default_cache_dir())
    assert again is not None and not (where / "lock").exists()


@needs_kernel
@pytest.mark.timeout(300)
def test_the_same_source_elsewhere_reuses_the_build(kernel, tmp_path):
    """Another checkout (or install) of the same source, in another process, shares the build
    instead of making ninja recompile it (its command names the copy in the build directory).
    torch's builder skips the build step for a source it loaded before in the same process, so
    the other start is a process of its own."""
    where = default_cache_dir() / "kernels" / f"seqgate_native_{native.build_key()}"
    built = (where / "decode_attention.o").stat().st_mtime_ns
    elsewhere = tmp_path / "csrc"
    elsewhere.mkdir()
    for source in native.SOURCES:
        (elsewhere / source.name).write_bytes(source.read_bytes())
    start = ("import sys, pathlib; from engine.kernels import native; "
             "from engine.model.loader import default_cache_dir; "
             "native.SOURCES = tuple(pathlib.Path(sys.argv[1]) / s.name for s in native.SOURCES); "
             "sys.exit(native.kernels(default_cache_dir()) is None)")
    subprocess.run([sys.executable, "-c", start, str(elsewhere)], check=True, timeout=290,
                   cwd=Path(native.__file__).parents[2])
    assert (where / "decode_attention.o").stat().st_mtime_ns == built
    assert str(tmp_path) not in (where / "build.ninja").read_text()


def _slab_view(rows, kv_heads, columns, dim, spare=24, gen=None, scale=1.0,
               dtype=torch.bfloat16):
    """KV as the engine holds it: a window of a slab with spare columns."""
    full = torch.randn(rows, kv_heads, columns + spare, dim, generator=gen) * scale
    return full.to(dtype)[:, :, :columns]


def _query(rows, heads, dim, gen, dtype=torch.bfloat16):
    """A query as the packed forward hands it over: [rows, heads, 1, dim], a strided view."""
    packed = (torch.randn(1, heads, rows + 2, dim, generator=gen) * 2).to(dtype)
    return packed[:, :, 1:rows + 1].transpose(0, 2)


def _mask(masking, rows, columns, gen):
    """None, left padding or scattered hidden columns, as [rows, 1, 1, columns] bool."""
    if masking == "none":
        return None
    if masking == "left padding":
        starts = torch.randint(0, columns, (rows,), generator=gen)
        mask = torch.arange(columns)[None, :] >= starts[:, None]
    else:
        mask = torch.rand(rows, columns, generator=gen) > 0.4
        mask[:, -1] = True
    return mask[:, None, None, :]


def _sdpa(q, k, v, mask, scale):
    rows, heads, _, dim = q.shape
    return torch.nn.functional.scaled_dot_product_attention(
        q.reshape(rows, k.shape[1], heads // k.shape[1], dim), k, v, attn_mask=mask,
        scale=scale).reshape(rows, 1, heads, dim)


SHAPES = [  # rows, KV heads, query heads per KV head, head dim
    (1, 3, 3, 64), (5, 3, 3, 64), (4, 2, 1, 64), (3, 1, 4, 64), (2, 2, 2, 64), (3, 2, 5, 64),
    (2, 4, 8, 64),  # TinyLlama's
    (3, 2, 3, 128), (2, 2, 8, 128), (2, 1, 1, 128), (2, 1, 6, 128),
]


@needs_kernel
@pytest.mark.parametrize("rows,kv_heads,groups,dim", SHAPES)
@pytest.mark.parametrize("columns", [1, 15, 16, 17, 47, 200])
@pytest.mark.parametrize("masking", ["none", "left padding", "scattered"])
@pytest.mark.parametrize("dtype,kv_dtype", [(torch.bfloat16, torch.bfloat16),
                                            (torch.float32, torch.float32),
                                            (torch.float32, torch.float16)])
def test_the_kernel_computes_what_sdpa_does(kernel, rows, kv_heads, groups, dim, columns,
                                           masking, dtype, kv_dtype):
    """In bf16 no further from fp32 attention of the same inputs than SDPA; in fp32, SDPA's
    result within 1e-5, also over an fp16 KV cache (SDPA given it widened to fp32)."""
    gen = torch.Generator().manual_seed(rows * 1000 + columns * 10 + groups)
    q = _query(rows, kv_heads * groups, dim, gen, dtype)
    k = _slab_view(rows, kv_heads, columns, dim, gen=gen, scale=3.0, dtype=kv_dtype)
    v = _slab_view(rows, kv_heads, columns, dim, gen=gen, dtype=kv_dtype)
    mask = _mask(masking, rows, columns, gen)
    scale = dim ** -0.5
    got = kernel.decode_attention(q, k, v, mask, scale)
    assert got.shape == (rows, 1, kv_heads * groups, dim) and got.dtype == dtype
    sdpa = _sdpa(q, k.to(dtype), v.to(dtype), mask, scale)
    if dtype == torch.float32:
        torch.testing.assert_close(got, sdpa, rtol=1e-5, atol=1e-5)
        return
    want = _sdpa(q.double(), k.double(), v.double(), mask, scale)
    err = (got.double() - want).abs().max().item()
    sdpa_err = (sdpa.double() - want).abs().max().item()
    assert err <= max(2 * sdpa_err, 2e-3), (err, sdpa_err)


@needs_kernel
@pytest.mark.parametrize("rows,kv_heads,groups,dim,columns,positions", [
    (1, 3, 3, 64, 300, 5), (4, 3, 3, 64, 47, 4), (2, 2, 1, 64, 17, 3), (3, 1, 8, 128, 40, 2),
    (2, 2, 2, 64, 9, 9), (1, 2, 1, 64, 40, 16)])  # the last: as many positions as it takes
@pytest.mark.parametrize("dtype,kv_dtype", [(torch.bfloat16, torch.bfloat16),
                                            (torch.float32, torch.float32),
                                            (torch.float32, torch.float16)])
def test_a_drafts_queries_each_get_what_they_alone_would(kernel, rows, kv_heads, groups, dim,
                                                        columns, positions, dtype, kv_dtype):
    """Several query positions per row, each with its own mask row (a draft's, causal over the
    newest columns, after left padding): each position's output is bit for bit what a call with
    that position alone gives, and SDPA's within 1e-5 in fp32."""
    gen = torch.Generator().manual_seed(rows * 100 + positions)
    q = (torch.randn(rows, kv_heads * groups, positions, dim, generator=gen) * 2).to(dtype)
    k = _slab_view(rows, kv_heads, columns, dim, gen=gen, scale=3.0, dtype=kv_dtype)
    v = _slab_view(rows, kv_heads, columns, dim, gen=gen, dtype=kv_dtype)
    starts = torch.randint(0, columns - positions + 1, (rows,), generator=gen)
    cols = torch.arange(columns)
    last = columns - positions + torch.arange(positions)  # each position's own column
    mask = (cols[None, None, :] >= starts[:, None, None]) & (cols[None, None, :]
                                                            <= last[None, :, None])
    mask = mask[:, None]  # [rows, 1, positions, columns]
    got = kernel.decode_attention(q, k, v, mask, dim ** -0.5)
    assert got.shape == (rows, positions, kv_heads * groups, dim) and got.dtype == dtype
    for j in range(positions):
        alone = kernel.decode_attention(q[:, :, j:j + 1], k, v, mask[:, :, j:j + 1],
                                        dim ** -0.5)
        assert torch.equal(got[:, j:j + 1], alone), j
    if dtype == torch.float32:
        want = torch.nn.functional.scaled_dot_product_attention(
            q, k.float(), v.float(), attn_mask=mask, scale=dim ** -0.5,
            enable_gqa=True).transpose(1, 2)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_calls_the_kernel_is_not_built_for_get_none(kernel):
    """The kernel alone checks what it takes; anything else gets None (and the caller SDPA)."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = _query(2, 6, 64, gen), _slab_view(2, 2, 30, 64, gen=gen), _slab_view(
        2, 2, 30, 64, gen=gen)
    mask = torch.ones(2, 1, 1, 30, dtype=torch.bool)
    assert kernel.decode_attention(q, k, v, mask, 0.125) is not None
    for call in [
        (q.half(), k.half(), v.half(), mask),  # fp16
        (q.float(), k, v, mask),  # an fp32 query over bf16 KV
        (q, k.half(), v.half(), mask),  # a bf16 query over fp16 KV
        (q.float(), k.half(), v.float(), mask),  # keys and values of different dtypes
        (_query(2, 6, 16, gen), k[..., :16], v[..., :16], mask),  # head dim 16
        (_query(2, 18, 64, gen), k, v, mask),  # 9 query heads per KV head
        (_query(2, 5, 64, gen), k, v, mask),  # not whole groups
        (q.expand(2, 6, 17, 64), k, v, mask),  # more query positions than a draft's
        (q.expand(2, 6, 2, 64), k, v, mask.expand(2, 1, 3, 30)),  # mask rows ≠ positions
        (q, k, v[:, :, :29], mask),  # keys and values differ
        (q, k, v, mask.to(torch.bfloat16)),  # an additive mask
        (q, k, v, mask[:1]),  # a mask broadcast over rows
        (q, k, v, torch.ones(2, 1, 1, 60, dtype=torch.bool)[..., ::2]),  # columns strided
        (q, k[..., ::2], v[..., ::2], mask),  # head dim strided (32 of 64)
        (q, k[:, :, :0], v[:, :, :0], mask[..., :0]),  # no keys
    ]:
        assert kernel.decode_attention(*call, 0.125) is None


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_nan_among_shown_keys_comes_out_as_nan_as_with_sdpa(kernel, dtype):
    gen = torch.Generator().manual_seed(3)
    k = _slab_view(2, 3, 40, 64, gen=gen, dtype=dtype)
    v = _slab_view(2, 3, 40, 64, gen=gen, dtype=dtype)
    k[1, 0, 7, 5] = float("nan")
    q = torch.randn(2, 9, 1, 64, generator=gen).to(dtype)
    mask = torch.ones(2, 1, 1, 40, dtype=torch.bool)
    out = kernel.decode_attention(q, k, v, mask, 0.125)[:, 0]
    assert out[1, :3].isnan().all() and not out[0].isnan().any() and not out[1, 3:].isnan().any()
    mask[1, ..., 7] = False  # hidden, it is left out
    assert not kernel.decode_attention(q, k, v, mask, 0.125).isnan().any()


@needs_kernel
def test_the_kernel_lets_other_python_threads_run(kernel):
    """Like PyTorch's own operators, it runs without the GIL (the server's threads go on)."""
    gen = torch.Generator().manual_seed(4)
    q = _query(8, 16, 128, gen)  # eight query heads per KV head
    k = _slab_view(8, 2, 24000, 128, gen=gen)
    calls = 5
    running = threading.Event()
    done = threading.Event()
    seconds: list[float] = []

    def call():
        running.set()
        for _ in range(calls):
            t0 = time.perf_counter()
            kernel.decode_attention(q, k, k, None, 0.1)
            seconds.append(time.perf_counter() - t0)
        done.set()

    worker = threading.Thread(target=call)
    worker.start()
    running.wait()
    turns = 0
    while not done.is_set():
        turns += 1
        done.wait(0.001)
    worker.join()
    # Holding the GIL, it would leave this thread a turn between calls only; released, this
    # thread takes a turn every millisecond or so while the calls run.
    assert turns > calls + sum(seconds) * 1000 / 4, (turns, seconds)


@needs_kernel
def test_sdpa_dispatch_takes_the_kernel_only_where_it_applies(kernel, monkeypatch):
    """`fused._sdpa` hands one-query steps and a draft's queries with their boolean mask to the
    kernel, and everything else (several queries without a mask or with an additive one, calls
    the kernel returns None for) to SDPA, with the same result."""
    calls = []

    class Spy:
        def decode_attention(self, *args):
            out = kernel.decode_attention(*args)
            calls.append(out is not None)
            return out

    module = SimpleNamespace(num_key_value_groups=3, is_causal=True)
    setattr(module, fused.DECODE_KERNEL_ATTR, Spy())
    plain = SimpleNamespace(num_key_value_groups=3, is_causal=True)
    gen = torch.Generator().manual_seed(0)
    k = _slab_view(4, 3, 40, 64, gen=gen)
    v = _slab_view(4, 3, 40, 64, gen=gen)
    mask = torch.ones(4, 1, 1, 40, dtype=torch.bool)
    mask[0, ..., :5] = False
    q = torch.randn(4, 9, 1, 64, generator=gen).to(torch.bfloat16)
    out, _ = fused._sdpa(module, q, k, v, mask, scaling=0.125)
    assert calls == [True] and out.shape == (4, 1, 9, 64)
    torch.testing.assert_close(out, fused._sdpa(plain, q, k, v, mask, scaling=0.125)[0],
                               atol=2e-2, rtol=2e-2)
    fused._sdpa(module, q, k, v, None, scaling=0.125)  # no mask: the kernel too
    out, _ = fused._sdpa(module, q.float(), k.float(), v.float(), mask, scaling=0.125)  # fp32
    torch.testing.assert_close(out, fused._sdpa(plain, q.float(), k.float(), v.float(), mask,
                                                scaling=0.125)[0], atol=1e-5, rtol=1e-5)
    assert calls == [True, True, True]
    additive = torch.zeros(4, 1, 1, 40, dtype=torch.bfloat16)
    out, _ = fused._sdpa(module, q, k, v, additive, scaling=0.125)  # the kernel declines
    assert calls[-1] is False and out.shape == (4, 1, 9, 64)
    queries = q[:1].expand(1, 9, 3, 64).contiguous()
    draft_mask = torch.ones(1, 1, 3, 40, dtype=torch.bool).tril_(37)  # causal over the last 3
    out, _ = fused._sdpa(module, queries, k[:1], v[:1], draft_mask, scaling=0.125)
    assert calls[-1] is True and len(calls) == 5 and out.shape == (1, 3, 9, 64)
    torch.testing.assert_close(out, fused._sdpa(plain, queries, k[:1], v[:1], draft_mask,
                                                scaling=0.125)[0], atol=2e-2, rtol=2e-2)
    # Several queries without a mask are causal in transformers' SDPA: not the kernel's.
    fused._sdpa(module, queries, k[:1], v[:1], None, scaling=0.125)
    assert len(calls) == 5
    # More positions than the kernel takes: its boolean mask goes to SDPA as an additive one.
    many = q[:1].expand(1, 9, 17, 64).contiguous()
    long_mask = torch.ones(1, 1, 17, 40, dtype=torch.bool).tril_(23)
    masks = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, attn_mask=None, **kwargs):
        masks.append(attn_mask.dtype)
        return sdpa(*args, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    out, _ = fused._sdpa(module, many, k[:1], v[:1], long_mask, scaling=0.125)
    monkeypatch.undo()
    assert calls[-1] is False and out.shape == (1, 17, 9, 64) and masks == [torch.bfloat16]
    want = torch.nn.functional.scaled_dot_product_attention(
        many.float(), k[:1].float(), v[:1].float(), attn_mask=long_mask, scale=0.125,
        enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)


def _random_llama(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=heads * head_dim, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, head_dim=head_dim,
                      max_position_embeddings=512, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).to(dtype).eval()


class _Spy:
    """The kernel, counting the calls it takes."""

    def __init__(self, kernel):
        self.kernel, self.instantiated, self.taken = kernel, kernel.instantiated, 0

    def decode_attention(self, *args):
        out = self.kernel.decode_attention(*args)
        self.taken += out is not None
        return out


def _decode_step_logits(model, ids: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
    """The logits of one decode step after left-padded prompts (all but the last token)."""
    with torch.inference_mode():
        cache = DynamicCache()
        model(input_ids=ids[:, :-1], attention_mask=attention[:, :-1], cache=cache)
        step = model(input_ids=ids[:, -1:], attention_mask=attention, cache=cache)
    return step.logits[:, -1].float()


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(16, 2, 64), (6, 2, 128)],
                         ids=["tinyllama-shaped", "head-128"])
def test_random_models_decode_through_the_kernel_as_through_sdpa(kernel, heads, kv_heads,
                                                                 head_dim):
    """A decode step of left-padded rows, every layer's attention through the kernel: in fp32
    SDPA's logits, in bf16 no further from the fp32 model's than SDPA's are."""
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 512, (4, 40), generator=gen)
    attention = torch.ones(4, 40, dtype=torch.long)
    for row, pad in enumerate([0, 7, 30, 2]):
        attention[row, :pad] = 0
    logits = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = _random_llama(dtype, heads, kv_heads, head_dim)
        assert fused.install(model)
        logits["sdpa", dtype] = _decode_step_logits(model, ids, attention)
        spy = _Spy(kernel)
        assert fused.use_decode_kernel(model, spy) == 2
        logits["kernel", dtype] = _decode_step_logits(model, ids, attention)
        assert spy.taken == 2  # the step, in both layers (the prompts went to SDPA)
    fp32 = logits["sdpa", torch.float32]
    torch.testing.assert_close(logits["kernel", torch.float32], fp32, rtol=1e-5, atol=1e-5)
    err = (logits["kernel", torch.bfloat16] - fp32).abs().max()
    assert err <= 1.5 * (logits["sdpa", torch.bfloat16] - fp32).abs().max() + 1e-3


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
    # No drafts: every decode step feeds one query per row, the calls the kernel takes.
    eng = make_engine(loaded, num_speculative_tokens=0)
    assert eng.decode_kernel_layers == 2
    attention = [m for m in loaded.model.modules() if hasattr(m, "num_key_value_groups")]
    calls = []

    class Spy:
        instantiated = kernel.instantiated

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
    # turned off: SDPA, and no layer holds the kernel; in fp32 (AVX2 CPUs' default) the kernel
    assert make_engine(loaded, decode_attention="sdpa").decode_kernel_layers == 0
    assert all(getattr(m, fused.DECODE_KERNEL_ATTR) is None for m in attention)
    assert make_engine(_tiny_llama(torch.float32, smollm2)).decode_kernel_layers == 2
    # five or eight (TinyLlama) query heads per KV head, heads of 128: the kernel too
    for shape in ({"heads": 10}, {"heads": 16}, {"head_dim": 128}):
        assert make_engine(_tiny_llama(torch.bfloat16, smollm2, **shape)) \
            .decode_kernel_layers == 2
    # a head size it is not built for: SDPA
    assert make_engine(_tiny_llama(torch.bfloat16, smollm2, head_dim=32)) \
        .decode_kernel_layers == 0
    # without the packed forward nothing dispatches to it: not even built
    assert make_engine(_tiny_llama(torch.bfloat16, smollm2),
                       fuse_sub_batches=False).decode_kernel_layers == 0


def test_a_kernel_that_cannot_build_leaves_attention_to_sdpa(tmp_path, monkeypatch, caplog):
    """No compiler: the build fails, the engine is told None and says why once."""
    monkeypatch.setattr(native, "instruction_set", lambda: "avx2")
    monkeypatch.setattr(native, "_library", None)  # as in a process that loaded no build yet
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(native, "SOURCES", (Path(tmp_path / "missing.cpp"),))
    (tmp_path / "missing.cpp").write_text("#error this source does not compile\n")
    with caplog.at_level("WARNING", logger="seqgate.native"):
        assert native.kernels(tmp_path / "cache") is None
    assert "using PyTorch's SDPA" in caplog.text


def test_decode_attention_is_a_checked_setting():
    assert EngineConfig(decode_attention="sdpa").decode_attention == "sdpa"
    with pytest.raises(ValueError, match="decode_attention"):
        EngineConfig(decode_attention="flash")
