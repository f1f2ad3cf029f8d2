"""Host values onto the device without waiting for it.

A tensor built from a Python list on a CUDA device is copied from pageable memory, and that copy
waits for every kernel queued before it: one host-device synchronisation each. Built in pinned
memory and copied asynchronously, it is queued behind those kernels instead (the caching host
allocator keeps the pinned block until the copy is done). On the CPU it is the plain tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: Sequence, device: torch.device, dtype: torch.dtype = torch.long
              ) -> torch.Tensor:
    """`values` as a tensor on `device`, without a synchronisation."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def split_to_device(parts: Sequence[Sequence], device: torch.device,
                    dtype: torch.dtype = torch.long) -> list[torch.Tensor]:
    """Several host lists on `device` in one copy, as views of one tensor."""
    flat = [v for part in parts for v in part]
    return list(to_device(flat, device, dtype).split([len(p) for p in parts]))
