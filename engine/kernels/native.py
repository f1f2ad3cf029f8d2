"""Kernels of our own, compiled for the host CPU the first time they are needed.

Four, built into one library. Attention of one query token per row over a rolling
batch's KV slab (`csrc/decode_attention.cpp`), bf16 or fp32, on the CPU: PyTorch's CPU
flash-attention kernel is built for long query blocks; with one query per row it read the KV at
about 8 GB/s and took 29-40% of a decode step's CPU time at 32 rows (torch.profiler,
docs/benchmarks/speed.md). No well-kept library ships a CPU decode-attention kernel for this
torch (IPEX stopped at 2.8, vLLM's and llama.cpp's are inside their own servers), so this is a
small one of ours. And linear layers over weights in 4- and 8-bit blocks for forwards of few
rows (`csrc/lowbit_linear.cpp`, engine.model.lowbit): PyTorch's own weight-only kernels are fast
on AVX512 only. And a Llama layer's work before and after its attention, over those linear
layers or over int8 ones (`csrc/int8_linear.cpp`, engine.model.w8a8), as two calls
(`csrc/lean_layer.cpp`, engine.model.llama_layers): the same arithmetic as the Python forward,
without the interpreter's and dispatcher's cost per operator.

They are written over ATen's `Vectorized<float>`, as PyTorch's own CPU kernels are, and built for
the best vector instruction set the CPU has: AVX512 (F, BW, VL, DQ), else AVX2 (with FMA and
F16C), else NEON on ARM; a CPU with none of them runs PyTorch's SDPA. `SEQGATE_KERNEL_ISA=avx2`
builds the AVX2 kernel on an AVX512 CPU (to test that path there); naming one the CPU lacks
leaves attention to SDPA and linear layers to PyTorch. The library registers
`torch.ops.seqgate.decode_attention`, `q4_linear`, `q8_linear`, `h16_linear`, `q4x8_q8_linear`
and `q8_q8_linear` (the blocks, Q4_1's in tiles of 8 output rows, times rows rounded to 8 bits,
`csrc/q8_rows.cpp`),
`lean_attention_inputs`, `lean_attention_output`, `int8_linear` (and `instantiated`,
`instruction_set`, `int8_product_kind`, `int8_sums_exact`); one build of it can be loaded per
process.

It is built with torch's own extension builder (`torch.utils.cpp_extension`, ninja and the
system's C++ compiler) into the cache directory under a name keyed by its source, the flags,
the compiler, Python and torch (versions and places) and the CPU's instruction-set flags: a
cache shared by machines of different CPUs never hands one the other's binary. The first build
takes about a minute on 2 cores (an AVX2 EPYC); later starts load it in well under a second.
Where it cannot be built (no compiler, no ninja), the engine logs why once and runs PyTorch's
SDPA as before.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import platform
import re
import subprocess
import sysconfig
import threading
import time
from pathlib import Path

import torch

log = logging.getLogger("seqgate.native")

SOURCES = tuple(Path(__file__).with_name("csrc") / name
                for name in ("decode_attention.cpp", "lowbit_linear.cpp", "lean_layer.cpp",
                             "int8_linear.cpp", "q8_rows.cpp"))
# Included by the sources: copied beside them and part of the build key.
HEADERS = tuple(Path(__file__).with_name("csrc") / name
                for name in ("vec.h", "lowbit_linear.h"))
# OpenMP: without it `at::parallel_for` runs on one thread (it links to torch's own libgomp).
# No fused multiply-adds but those written out: a product and a sum rounded once would differ
# from ATen's two operators, which the layer passes of lean_layer.cpp match bit for bit.
FLAGS = ("-O3", "-fopenmp", "-ffp-contract=off")
ISA_ENV = "SEQGATE_KERNEL_ISA"

# What each instruction set needs of the CPU, and its flags: ATen's vector headers pick their
# implementation by the CPU_CAPABILITY_* macro, and the -m flags (PyTorch's own for these
# builds, plus F16C on AVX512 too: the block kernels convert fp16 scales eight at a time with
# it, and GCC's -mavx512f does not imply it) let the compiler emit its instructions. On ARM,
# NEON is ATen's default.
_ISAS = {
    "avx512": ({"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "f16c"},
               ("-DCPU_CAPABILITY_AVX512", "-mavx512f", "-mavx512bw", "-mavx512vl",
                "-mavx512dq", "-mfma", "-mf16c")),
    "avx2": ({"avx2", "fma", "f16c"}, ("-DCPU_CAPABILITY_AVX2", "-mavx2", "-mfma", "-mf16c")),
    "neon": ({"asimd"}, ()),
}

_lock = threading.Lock()
_built: dict[Path, Native | None] = {}
_library: Path | None = None  # the build loaded in this process


class Native:
    """The loaded library's operators: `decode_attention(query, key, value, mask, scale)` (the
    attention, or None for a call it does not take: then SDPA), `q4_linear(x, q, d, m)`,
    `q8_linear(x, q, d)`, `h16_linear(x, w)`, `q4x8_q8_linear(x, q, d, m)`, `q8_q8_linear(x, q,
    d)`, `q8x8_q8_linear(x, q, d)` (engine.model.lowbit), `lean_attention_inputs`
    and `lean_attention_output` (engine.model.llama_layers), `int8_linear(x, weight, scales,
    bias)`, `int8_product_kind()` (which product it multiplies by: engine.model.w8a8) and
    `int8_sums_exact()` (whether ATen's int8 product sums exactly here, which that choice rests on),
    `instantiated(dtype, head_dim, groups)` and `instruction_set()`."""

    def __init__(self, library: Path):
        ops = torch.ops.seqgate
        self.library = library
        self.decode_attention = ops.decode_attention.default
        self.q4_linear = ops.q4_linear.default
        self.q8_linear = ops.q8_linear.default
        self.h16_linear = ops.h16_linear.default
        self.q4x8_q8_linear = ops.q4x8_q8_linear.default
        self.q8_q8_linear = ops.q8_q8_linear.default
        self.q8x8_q8_linear = ops.q8x8_q8_linear.default
        self.lean_attention_inputs = ops.lean_attention_inputs.default
        self.lean_attention_output = ops.lean_attention_output.default
        self.int8_linear = ops.int8_linear.default
        self.int8_product_kind = ops.int8_product_kind.default
        self.int8_sums_exact = ops.int8_sums_exact.default
        self.instantiated = ops.instantiated.default
        self.instruction_set = ops.instruction_set.default


# The CPU features the build is keyed on (not the mitigation flags, which change with
# microcode and kernel updates and would only cost rebuilds).
_ISA = re.compile(r"^(sse|ssse|avx|fma|f16c|bmi|amx|vnni|vaes|vpclmul|gfni|movbe|popcnt|lzcnt|"
                  r"abm|adx|sha|asimd|sve|neon|fp|fphp)")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@functools.cache
def _compiler() -> str:
    """The C++ compiler's version line (torch's builder runs `$CXX`, else `c++`)."""
    cxx = os.environ.get("CXX", "c++")
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=10)
        return out.stdout.splitlines()[0] if out.stdout else cxx
    except (OSError, subprocess.SubprocessError):
        return cxx


def _installation() -> tuple[str, str]:
    """Where torch and Python live: their headers' paths are in the compile command, and ninja
    rebuilds when the command changes, so each installation keeps a build of its own (two
    virtual environments sharing a cache would otherwise rebuild each other's at every start)."""
    return str(Path(torch.__file__).parent), sysconfig.get_paths()["include"]


def instruction_set() -> str | None:
    """The vector instruction set to build for: `SEQGATE_KERNEL_ISA`'s where set (ValueError if
    this CPU lacks it), else the best this CPU has; None where it has none."""
    flags = set(_cpu_flags().split())
    forced = os.environ.get(ISA_ENV, "").strip().lower()
    if forced:
        if forced not in _ISAS:
            raise ValueError(f"{ISA_ENV}={forced}: not one of {', '.join(_ISAS)}")
        if not _ISAS[forced][0] <= flags:
            raise ValueError(f"{ISA_ENV}={forced}: this CPU lacks "
                             f"{', '.join(sorted(_ISAS[forced][0] - flags))}")
        return forced
    return next((isa for isa, (needs, _) in _ISAS.items() if needs <= flags), None)


def _flags(isa: str) -> list[str]:
    return [*FLAGS, *_ISAS[isa][1]]


def code_key(isa: str | None = None) -> str:
    """What the library's machine code depends on: sources, flags (the instruction set's among
    them), compiler, Python and torch versions, the CPU's ISA. Choices timed with one build
    (engine.model.host_timing) hold for every build with this key, wherever it was installed."""
    return _key(isa, ())


def build_key(isa: str | None = None) -> str:
    """What a built library depends on: its code (`code_key`) and the installation's paths,
    which its compile command names (`_installation`)."""
    return _key(isa, _installation())


def _key(isa: str | None, installation: tuple[str, ...]) -> str:
    isa = isa or instruction_set() or "none"
    cpu = " ".join(sorted(f for f in _cpu_flags().split() if _ISA.match(f)))
    h = hashlib.sha256()
    for source in (*SOURCES, *HEADERS):
        h.update(source.read_bytes() + b"\0")
    for part in (*(_flags(isa) if isa in _ISAS else FLAGS), _compiler(),
                 platform.python_version(), torch.__version__, *installation, cpu):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:16]


def _failure(exc: Exception) -> str:
    """The line of a failed build that says why (a compiler's first `error:`), else its last."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error:" in ln]
    return (errors[0] if errors else lines[-1] if lines else type(exc).__name__)[:300]


def kernels(cache_dir: Path) -> Native | None:
    """The native library's operators, built under `cache_dir/kernels` on first use; None where
    it cannot be built or this CPU has no vector instruction set it is built for."""
    try:
        isa = instruction_set()
    except ValueError as exc:
        log.warning("native kernels unavailable, using PyTorch's SDPA and linear layers (%s)",
                    exc)
        return None
    if isa is None:
        log.info("native kernels: no AVX2, AVX512 or NEON on this CPU, "
                 "using PyTorch's SDPA and linear layers")
        return None
    name = f"seqgate_native_{build_key(isa)}"
    where = Path(cache_dir) / "kernels" / name
    with _lock:
        if where in _built:
            return _built[where]
        start = time.perf_counter()
        try:
            kernel = _build(name, where, isa)
        except Exception as exc:  # no compiler, no ninja, a failed build: PyTorch's own
            log.warning("native kernels unavailable, using PyTorch's SDPA and linear layers "
                        "(%s)", _failure(exc))
            log.debug("native kernel build failed", exc_info=True)
            kernel = None
        else:
            log.info("native kernels (%s) ready in %.1f s (%s)",
                     kernel.instruction_set(), time.perf_counter() - start, where)
        _built[where] = kernel
        return kernel


def _build(name: str, where: Path, isa: str) -> Native:
    """Build (or load) the library in `where`, one process at a time, and load it.

    torch's builder waits, without a deadline, for a `lock` file that a process killed while
    building (a container stopped during the first start) leaves behind. Builds here are
    serialised by an flock instead, which the kernel releases when its holder dies; under it,
    any `lock` file left in the build directory is stale and is removed.

    It compiles copies of the sources kept in the build directory: ninja rebuilds whenever the
    compile command changes, and the command names the sources' paths, so two checkouts sharing
    a cache and an installation would otherwise rebuild (25-30 s) each time the other had
    started. The directory's name is keyed by the source's content, so the copy is always the
    same (and by the installation, whose paths the command names too: `_installation`).

    The library registers the `seqgate` operators when it is loaded, which a second, different
    build would do again: torch aborts the process then, so a process loads one build only."""
    from torch.utils import cpp_extension

    global _library
    library = where / f"{name}.so"
    if _library is not None and _library != library:
        raise RuntimeError(f"another build of the kernel is loaded in this process ({_library})")
    where.mkdir(parents=True, exist_ok=True)
    with open(where.parent / f"{name}.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        try:
            (where / "lock").unlink(missing_ok=True)
            for source in (*SOURCES, *HEADERS):
                copy, text = where / source.name, source.read_bytes()
                if not copy.is_file() or copy.read_bytes() != text:
                    copy.write_bytes(text)
            copies = [str(where / source.name) for source in SOURCES]
            cpp_extension.load(name, copies, extra_cflags=_flags(isa),
                               extra_ldflags=["-fopenmp"], build_directory=str(where),
                               is_python_module=False, verbose=False)
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)
    _library = library
    return Native(library)
