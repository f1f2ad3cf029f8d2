"""Long-lived KV blocks in their own memory mappings, outside the allocator's heap.

glibc serves a request below its mmap threshold from its heap, and raises that threshold to the
size of every mapped block freed (up to 32 MiB), so after a while blocks of a few MiB come from
the heap too. KV blocks live for seconds to minutes among short-lived tensors of every size;
freed, they leave holes that the heap keeps and rarely fills, and resident memory creeps up
under load (docs/reliability.md). A block in its own anonymous mapping goes back to the kernel
whole when its tensor is freed. Mapping costs a page fault per 4 KiB on first write: about a
millisecond per 10 MiB, against the prefill that fills the block.
"""

from __future__ import annotations

import math
import mmap

import torch

MAPPED_MIN_BYTES = 1 << 20  # smaller blocks stay in the heap: a mapping per block would cost more


def mapped_empty(shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """An uninitialised tensor of `shape` with `like`'s dtype and device; on the CPU and from
    MAPPED_MIN_BYTES up, in an anonymous mapping of its own, unmapped when the tensor's storage
    is freed (the tensor holds the only reference to the mapping)."""
    nbytes = math.prod(shape) * like.element_size()
    if like.device.type != "cpu" or nbytes < MAPPED_MIN_BYTES:
        return like.new_empty(shape)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=like.dtype).view(shape)
