#!/usr/bin/env bash
# Quick start 1: install, then GRPO the built-in arithmetic task on a tiny model built here (no downloads).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/tandem demo "$@"
