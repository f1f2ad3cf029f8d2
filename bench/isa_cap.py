"""Capping every engine in a benchmark to a lower vector ISA than the CPU's (`--cap-isa avx2`).

An AVX2-only CPU is approximated on an AVX512 one by the variables each library reads for its
own kernel choice. They are set in the bench's environment, which its servers and the OpenVINO
driver inherit. What is not capped: llama.cpp's server (xllamacpp's build picks no AVX512 code
at run time), and the microarchitecture itself (caches, clocks, 256-bit units), so a capped
figure approximates an AVX2 machine and is compared only with figures from the same run.
"""

from __future__ import annotations

import os

CAPS: dict[str, dict[str, str]] = {
    "avx2": {
        "ATEN_CPU_CAPABILITY": "avx2",  # PyTorch's own vectorised kernels
        "ONEDNN_MAX_CPU_ISA": "AVX2",  # oneDNN inside PyTorch (products, bf16 among them)
        "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2",  # FBGEMM (the int8 product on AVX2)
        "SEQGATE_KERNEL_ISA": "avx2",  # seqgate's native library
        "OV_CPU_MAX_ISA": "AVX2",  # OpenVINO's CPU plugin (its oneDNN fork and own kernels)
    },
}


def apply(isa: str | None) -> dict[str, str]:
    """Set `isa`'s variables in this process's environment (children inherit them); returns
    them, {} for None. ValueError for an ISA without a cap."""
    if not isa:
        return {}
    if isa not in CAPS:
        raise ValueError(f"--cap-isa {isa!r}: choose from {', '.join(CAPS)}")
    os.environ.update(CAPS[isa])
    return dict(CAPS[isa])
