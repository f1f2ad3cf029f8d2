#!/usr/bin/env bash
# Serve the embedded SmolLM2-135M-Instruct on http://127.0.0.1:8000 (OpenAI API under /v1).
# Creates ./.venv on first use; extra arguments go to `seqgate serve` (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh dev
exec .venv/bin/seqgate serve "$@"
