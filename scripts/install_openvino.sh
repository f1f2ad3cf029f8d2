#!/usr/bin/env bash
# Create ./.venv-openvino for the benchmark's OpenVINO GenAI peer (bench/openvino_peer.py): its own
# environment, since optimum-intel and OpenVINO pin their own transformers. torch is pinned to the
# CPU build seqgate uses (optimum-intel otherwise pulls a CUDA torch, gigabytes), and torchvision,
# which PyPI builds against CUDA torch, is removed (transformers works without it; with it, its
# missing operators break every import). Safe to run again.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ ! -x .venv-openvino/bin/python ]; then
    python3 -m venv .venv-openvino
fi
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
echo "torch==2.13.0" > "$constraints"
.venv-openvino/bin/python -m pip install --quiet --disable-pip-version-check -c "$constraints" \
    "openvino-genai==2026.4.1.0" "optimum-intel[openvino]==2.2.0"
.venv-openvino/bin/python -m pip uninstall --quiet -y torchvision 2>/dev/null || true
