#!/usr/bin/env bash
# Create .venv (if missing) and install tandem with the given extras; torch is pinned to the CPU build first.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
# torch first and pinned: an unpinned resolve would pull a multi-GB CUDA build onto a CPU machine.
# On a GPU machine, install the torch build for your CUDA version instead and skip this line.
.venv/bin/python -m pip install --quiet "torch==2.13.0"
.venv/bin/python -m pip install --quiet -e ".${extras:+[$extras]}"
