"""Long-lived KV blocks in their own memory mappings, outside the allocator's heap.

glibc serves a request below its mmap threshold from its heap, and raises that threshold to the
size of every mapped block freed (up to 32 MiB), so after a while blocks of a few MiB come from
the heap too. KV blocks live for seconds to minutes among short-lived tensors of every size;
freed, they leave holes that the heap keeps and rarely fills, and resident memory creeps up
under load (docs/reliability.md). A block in its own anonymous mapping goes back to the kernel
whole when its tensor is freed. Mapping costs a page fault per 4 KiB on first write; keeping
freed mappings for reuse saved too little to be worth it (docs/benchmarks/speed.md). The kernel
supplies a page when it is first written, so the part of a block never written costs address
space only (`engine.kv.batch` reserves room for decode steps this way).

The process's garbage-collector setting lives here too (`freeze_startup_objects`).
"""

from __future__ import annotations

import gc
import math
import mmap
import platform
import sys

import torch

MAPPED_MIN_BYTES = 1 << 20  # smaller blocks stay in the heap: a mapping per block would cost more
# Private anonymous memory, as malloc maps it (Python's default, MAP_SHARED, is shared memory,
# whose first writes cost more). No swap space
# is set aside for it (MAP_NORESERVE; Python names it from 3.13, its value is 0x4000 on these
# Linux machines), so under the default overcommit heuristic room reserved and never written
# is not charged; under strict accounting (vm.overcommit_memory=2) it is, and a reservation
# that does not fit fails with OSError (engine.kv.batch then reserves less).
_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform == "linux" and
                     platform.machine() in ("x86_64", "aarch64", "riscv64") else 0)
_FLAGS = (mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _NORESERVE
          if hasattr(mmap, "MAP_PRIVATE") else None)
# Whether a mapped block's pages come only when first written (POSIX anonymous mappings; on
# Windows a mapping is charged to the page file whole). Transparent huge pages are refused for
# these blocks: a 2 MiB page would make a reservation resident around every column written
# (writing 500 of 4,500 columns of a 256 MiB block grew the resident set by 254 MiB with huge
# pages, 32 MiB without).
LAZY_PAGES = _FLAGS is not None


def pages_on_write(device: torch.device) -> bool:
    """Whether large blocks made for `device` take memory only where written (the CPU's
    mapped blocks), so that room reserved ahead costs address space alone."""
    return device.type == "cpu" and LAZY_PAGES


def mapped_empty(shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """An uninitialised tensor of `shape` with `like`'s dtype and device; on the CPU and from
    MAPPED_MIN_BYTES up, in an anonymous mapping of its own, unmapped when the tensor's storage
    is freed (the tensor holds the only reference to the mapping)."""
    nbytes = math.prod(shape) * like.element_size()
    if like.device.type != "cpu" or nbytes < MAPPED_MIN_BYTES:
        return like.new_empty(shape)
    if _FLAGS is None:
        block = mmap.mmap(-1, nbytes)
    else:
        block = mmap.mmap(-1, nbytes, flags=_FLAGS)
        if hasattr(mmap, "MADV_NOHUGEPAGE"):
            block.madvise(mmap.MADV_NOHUGEPAGE)
    return torch.frombuffer(block, dtype=like.dtype).view(shape)


def freeze_startup_objects() -> None:
    """Move every object alive now out of the garbage collector's sight (`gc.freeze`).

    A served model leaves hundreds of thousands of tracked objects behind (modules, parameters,
    tokenizer tables), and each full collection walks them all holding the GIL while the
    engine's step waits: under load it was the longest stall a running stream saw
    (docs/benchmarks/scheduler.md). These objects live as long as the server,
    so there is nothing to collect among them; what is created later is collected as before.
    """
    gc.collect()
    gc.freeze()
