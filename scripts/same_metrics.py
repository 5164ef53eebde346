"""Whether two runs logged the same metrics at every step, timings aside (a refactor's check that behaviour is
unchanged):

    .venv/bin/python scripts/same_metrics.py runs/a/metrics.jsonl runs/b/metrics.jsonl

Prints each metric that differs (up to 20), then the count; exits 1 if any does. Timings (`time/*`, `*tokens_per_s`,
`memory/*`) differ from run to run and are left out; everything else is compared exactly.
"""
from __future__ import annotations

import json
import sys

TIMING = ("time/", "tokens_per_s", "rollout/tokens_per_s", "memory/")


def rows(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def differences(a: list[dict], b: list[dict]) -> list[str]:
    if len(a) != len(b):
        return [f"{len(a)} rows against {len(b)}"]
    out = []
    for ra, rb in zip(a, b):
        keys = {k for k in ra.keys() | rb.keys() if not k.startswith(TIMING)}
        out += [f"step {ra.get('step')}: {k}: {ra.get(k)!r} != {rb.get(k)!r}" for k in sorted(keys)
                if ra.get(k) != rb.get(k)]
    return out


def main() -> int:
    a, b = rows(sys.argv[1]), rows(sys.argv[2])
    found = differences(a, b)
    for line in found[:20]:
        print(line)
    print(f"{len(a)} rows; {len(found)} differences in metrics other than timings")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
