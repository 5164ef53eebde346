"""Reward throughput: samples scored per second for the GSM8K verifier, math-verify and the code sandbox."""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tandem.rewards import RewardScorer  # noqa: E402
from tandem.sandbox import isolation  # noqa: E402


def rate(specs, completions, rows, workers: int, repeat: int = 1) -> float:
    """Samples per second of `RewardScorer(specs).score`, after one warm-up call (workers started, imports done)."""
    with RewardScorer(specs, workers=workers, timeout_s=30) as s:
        s.score(completions[:4], [""] * 4, rows[:4])
        t = time.perf_counter()
        for _ in range(repeat):
            res = s.score(completions, [""] * len(completions), rows)
        took = time.perf_counter() - t
    assert not any(res.errors.values()), res.error_kinds
    return repeat * len(completions) / took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--workers", type=int, default=2, help="pool processes (and sandbox runs in parallel)")
    ap.add_argument("--n", type=int, default=256, help="samples per measured call")
    args = ap.parse_args()
    n, w = args.n, args.workers

    gsm_c = [f"Let me think... {i} + {i} = {2 * i}. The answer is ${2 * i:,}." for i in range(n)]
    gsm_r = [{"answer": f"step\n#### {2 * i}"} for i in range(n)]
    tex_c = [f"so the result is $\\boxed{{\\frac{{{i}}}{{{i + 1}}}}}$" for i in range(n)]
    tex_r = [{"answer": f"\\frac{{{2 * i}}}{{{2 * i + 2}}}"} for i in range(n)]
    m = max(8, n // 8)
    code_c = ["```python\nprint(sum(map(int, input().split())))\n```"] * m
    code_r = [{"tests": [{"stdin": f"{i} 1", "stdout": str(i + 1)}]} for i in range(m)]
    fn_c = ["```python\ndef add(a, b):\n    return a + b\n```"] * m
    fn_r = [{"tests": [f"assert add({i}, 1) == {i + 1}"]} for i in range(m)]

    rows = [
        ("gsm8k (numeric)", "inline", "-", rate([("gsm8k", 1.0, {})], gsm_c, gsm_r, 0, repeat=20)),
        ("gsm8k (numeric)", "pool", f"{w} processes",
         rate([("tandem.rewards.answers:gsm8k", 1.0, {})], gsm_c, gsm_r, w, repeat=5)),
        ("math (math-verify LaTeX)", "inline", "-", rate([("math", 1.0, {})], tex_c[: n // 2], tex_r[: n // 2], 0)),
        ("math (math-verify LaTeX)", "pool", f"{w} processes", rate([("math", 1.0, {})], tex_c, tex_r, w)),
        ("code (sandbox, 1 test each)", "inline", f"{w} sandboxes at a time",
         rate([("code", 1.0, {"parallel": w})], code_c, code_r, 0)),
        ("code (sandbox, 1 assert each)", "inline", f"{w} sandboxes at a time",
         rate([("code", 1.0, {"parallel": w})], fn_c, fn_r, 0)),
    ]
    iso = isolation()
    print(f"cores: {os.cpu_count()}, samples per call: {n} (code: {m}), sandbox isolation: "
          + ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in iso.items()))
    print(f"{'reward':<30} {'where':<7} {'workers':<24} {'samples/s':>10}")
    for name, where, workers, r in rows:
        print(f"{name:<30} {where:<7} {workers:<24} {r:>10.1f}")


if __name__ == "__main__":
    main()
