"""Kernels of our own, compiled for the host CPU the first time they are needed.

One so far: attention of one query token per row over a rolling batch's KV slab
(`csrc/decode_attention.cpp`), for bf16 on the CPU. PyTorch's CPU flash-attention kernel is
built for long query blocks; with one query per row it read the KV at about 8 GB/s and took
29-40% of a decode step's CPU time at 32 rows (torch.profiler, docs/benchmarks/speed.md). No
well-kept library ships a CPU decode-attention kernel for this torch (IPEX stopped at 2.8,
vLLM's and llama.cpp's are inside their own servers), so this is a small one of ours.

It is built with torch's own extension builder (`torch.utils.cpp_extension`, ninja and the
system's C++ compiler) with `-march=native`, into the cache directory under a name keyed by its
source, the flags, the compiler, Python and torch (versions and places) and the CPU's
instruction-set flags: a cache shared by machines of different CPUs never hands one the other's
binary. The first build takes about 25 s on 2 cores; later starts load it in well under a
second. Where it cannot be built (no compiler, no ninja), the engine logs why once and runs
PyTorch's SDPA as before.
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
from types import ModuleType

import torch

log = logging.getLogger("seqgate.native")

SOURCE = Path(__file__).with_name("csrc") / "decode_attention.cpp"
FLAGS = ("-O3", "-march=native")

_lock = threading.Lock()
_built: dict[Path, ModuleType | None] = {}


# The CPU features `-march=native` compiles for (not the mitigation flags, which change with
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


def build_key() -> str:
    """What a built kernel depends on: source, flags, compiler, Python, torch (version and
    place), the CPU's ISA."""
    isa = " ".join(sorted(f for f in _cpu_flags().split() if _ISA.match(f)))
    h = hashlib.sha256(SOURCE.read_bytes())
    for part in (*FLAGS, _compiler(), platform.python_version(), torch.__version__,
                 *_installation(), isa):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:16]


def _failure(exc: Exception) -> str:
    """The line of a failed build that says why (a compiler's first `error:`), else its last."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error:" in ln]
    return (errors[0] if errors else lines[-1] if lines else type(exc).__name__)[:300]


def decode_attention_kernel(cache_dir: Path) -> ModuleType | None:
    """The decode-attention extension module (its `decode_attention(query, key, value, mask,
    scale)`), built under `cache_dir/kernels` on first use; None where it cannot be built."""
    name = f"seqgate_decode_attention_{build_key()}"
    where = Path(cache_dir) / "kernels" / name
    with _lock:
        if where in _built:
            return _built[where]
        start = time.perf_counter()
        try:
            module = _build(name, where)
        except Exception as exc:  # no compiler, no ninja, a failed build: SDPA instead
            log.warning("decode attention kernel unavailable, using PyTorch's SDPA (%s)",
                        _failure(exc))
            log.debug("decode attention kernel build failed", exc_info=True)
            module = None
        else:
            isa = module.instruction_set()
            if isa == "scalar":  # no vector path for this CPU: SDPA is faster
                log.info("decode attention kernel: no AVX512 on this CPU, using PyTorch's SDPA")
                module = None
            else:
                log.info("decode attention kernel (%s) ready in %.1f s (%s)",
                         isa, time.perf_counter() - start, where)
        _built[where] = module
        return module


def _build(name: str, where: Path) -> ModuleType:
    """Build (or load) the extension in `where`, one process at a time.

    torch's builder waits, without a deadline, for a `lock` file that a process killed while
    building (a container stopped during the first start) leaves behind. Builds here are
    serialised by an flock instead, which the kernel releases when its holder dies; under it,
    any `lock` file left in the build directory is stale and is removed.

    It compiles a copy of the source kept in the build directory: ninja rebuilds whenever the
    compile command changes, and the command names the source's path, so two checkouts sharing
    a cache and an installation would otherwise rebuild (25-30 s) each time the other had
    started. The directory's name is keyed by the source's content, so the copy is always the
    same (and by the installation, whose paths the command names too: `_installation`)."""
    from torch.utils import cpp_extension

    where.mkdir(parents=True, exist_ok=True)
    with open(where.parent / f"{name}.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        try:
            (where / "lock").unlink(missing_ok=True)
            source = where / SOURCE.name
            text = SOURCE.read_bytes()
            if not source.is_file() or source.read_bytes() != text:
                source.write_bytes(text)
            return cpp_extension.load(name, [str(source)], extra_cflags=list(FLAGS),
                                      build_directory=str(where), verbose=False)
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)
