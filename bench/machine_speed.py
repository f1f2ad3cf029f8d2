"""How fast this machine runs a fixed piece of work right now.

On a shared host the same kernels run at different speeds from one minute to the next, with no
steal time and no other process of ours to show for it (another guest on the cores' sibling
threads or on the memory bus, or the clock). On the 2-core AVX512 machine of
docs/benchmarks/speed.md, a fixed int8 product took 0.90 ms for a while and then 1.45-1.6 ms for
minutes, while the memory pass below ran twice as fast (the guest moved to other cores, it
seems). So each benchmark run records this probe just before and just after it: a cell whose
probes are slow ran on a slow machine, whatever the code did.

The probe times, on the benchmark's own threads (`threads`), the median of repeated calls of:
- `int8_us`: an int8 product (192 × 576 by 576 × 3072, one of SmolLM2's MLP shapes at 192 rows);
- `bf16_us`: a bf16 product (64 × 576 by 576 × 6144);
- `stream_gbps`: adding 1 to 64 MiB of fp32 in place (bytes read and written per second).
"""

from __future__ import annotations

import statistics
import time

import torch

INT8_SHAPE = ((192, 576), (576, 3072))
BF16_SHAPE = ((64, 576), (576, 6144))
STREAM_FLOATS = 16 * 2**20  # 64 MiB


def _median_us(fn, seconds: float) -> float:
    fn()  # first call: allocations, oneDNN's primitive
    times = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(times) < 5:
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def probe(threads: int = 2, seconds: float = 0.2) -> dict:
    """The probe's three figures (about 3 × `seconds` of work); torch's thread count is put
    back afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(0)
        a = torch.randint(-127, 128, INT8_SHAPE[0], dtype=torch.int8, generator=gen)
        b = torch.randint(-127, 128, INT8_SHAPE[1], dtype=torch.int8, generator=gen)
        x = torch.randn(BF16_SHAPE[0], generator=gen).to(torch.bfloat16)
        w = torch.randn(BF16_SHAPE[1], generator=gen).to(torch.bfloat16)
        stream = torch.zeros(STREAM_FLOATS)
        out = {
            "int8_us": _median_us(lambda: torch._int_mm(a, b), seconds),
            "bf16_us": _median_us(lambda: torch.matmul(x, w), seconds),
        }
        stream_us = _median_us(lambda: stream.add_(1.0), seconds)
        out["stream_gbps"] = 2 * stream.numel() * 4 / stream_us / 1e3
        return {k: round(v, 2) for k, v in out.items()}
    finally:
        torch.set_num_threads(before)


if __name__ == "__main__":
    print(probe())
