"""Kernels of our own, compiled for the host CPU the first time they are needed.

One so far: attention of one query token per row over a rolling batch's KV slab
(`csrc/decode_attention.cpp`), for bf16 on the CPU. PyTorch's CPU flash-attention kernel is
built for long query blocks; with one query per row it read the KV at about 8 GB/s and took
29-40% of a decode step's CPU time at 32 rows (torch.profiler, docs/benchmarks/speed.md). No
well-kept library ships a CPU decode-attention kernel for this torch (IPEX stopped at 2.8,
vLLM's and llama.cpp's are inside their own servers), so this is a small one of ours.

It is built with torch's own extension builder (`torch.utils.cpp_extension`, ninja and the
system's C++ compiler) with `-march=native`, into the cache directory under a name keyed by its
source, the flags, the torch version and the CPU's feature flags: a cache shared by machines
of different CPUs never hands one the other's binary. The first build takes about 25 s on 2
cores; later starts load it in well under a second. Where it cannot be built (no compiler, no
ninja), the engine logs why once and runs PyTorch's SDPA as before.
"""

from __future__ import annotations

import hashlib
import logging
import platform
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


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def build_key() -> str:
    """What a built kernel depends on: source, flags, torch, the CPU's features."""
    h = hashlib.sha256(SOURCE.read_bytes())
    for part in (*FLAGS, torch.__version__, _cpu_flags()):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:16]


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
            from torch.utils import cpp_extension

            where.mkdir(parents=True, exist_ok=True)
            module = cpp_extension.load(name, [str(SOURCE)], extra_cflags=list(FLAGS),
                                        build_directory=str(where), verbose=False)
        except Exception as exc:  # no compiler, no ninja, a failed build: SDPA instead
            detail = str(exc).strip().splitlines()
            log.warning("decode attention kernel unavailable, using PyTorch's SDPA (%s)",
                        detail[-1] if detail else type(exc).__name__)
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
