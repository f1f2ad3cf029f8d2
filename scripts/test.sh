#!/usr/bin/env bash
# Run the whole test suite (real model, real servers). Creates ./.venv on first use;
# extra arguments go to pytest, e.g. `bash scripts/test.sh tests/app -x`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh dev
exec .venv/bin/python -m pytest -q "$@"
