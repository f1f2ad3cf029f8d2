#!/usr/bin/env bash
# The GPU check (bench/gpu_check.py) in one command.
#   bash scripts/gpu_check.sh --prepare              here, with a package index: fills .gpu/
#   bash scripts/gpu_check.sh [--out DIR]            on a GPU machine without any index: installs
#                                                    .gpu/wheels into a temporary folder, runs
#   bash scripts/gpu_check.sh --device cpu --quick   the same check on the CPU, in the environment
#                                                    it is started in, touching no index
# Results: DIR/check.json (default bench/results/gpu, or $OUT/gpu where OUT is set).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
case " $* " in
*" --prepare "*)
    [ -x .venv/bin/python ] || bash scripts/install.sh dev
    exec "${PYTHON:-.venv/bin/python}" -m bench.gpu_check --prepare ;;
*" --device "*)
    # the suite's own environment (.venv where the README's set-up made it)
    PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
    exec "$PY" -m bench.gpu_check "$@" ;;
esac
# On the GPU machine: its python3 holds CUDA torch; .gpu/ holds what it lacks.
[ -d .gpu/wheels ] || { echo "no .gpu/wheels: run 'bash scripts/gpu_check.sh --prepare' first" >&2; exit 2; }
SITE=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .gpu/wheels/*.whl
export PYTHONPATH="$SITE:$PYTHONPATH" PYTHONUNBUFFERED=1
args=("$@")
case " $* " in *" --out "*) ;; *) [ -n "${OUT:-}" ] && args+=(--out "$OUT/gpu") ;; esac
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv || true
exec python3 -m bench.gpu_check "${args[@]}"
