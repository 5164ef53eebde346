"""The hf engine's two ways to hold a group's prompt in decode: copied into every row's cache, or once (split attention).

    .venv/bin/python bench/bench_prompt_sharing.py [--threads 1] [--repeats 3]

Times `HFEngine.generate` (fixed-length rollouts, temperature 1) with `llama_decode.SHARED_PROMPT_MIN_BYTES` forced
off and on, alternating, best of `--repeats`, on bench_trl's small and large models, for prompts of several lengths
and group shapes; prints each side's seconds, the ratio shared / per-row, the bytes of repeated prompt keys and
values per layer that the threshold looks at, and which way the threshold picks. The constant's comment quotes this.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import bench_trl  # noqa: E402

from tandem.rollout import Sampling, llama_decode  # noqa: E402
from tandem.rollout.hf import HFEngine  # noqa: E402

# (model, prompts, completions per prompt, prompt tokens, new tokens)
CASES = [("small", 4, 4, 6, 32), ("small", 4, 4, 32, 32), ("small", 4, 4, 64, 32), ("small", 2, 8, 6, 32),
         ("small", 2, 32, 256, 32), ("large", 16, 8, 6, 32)]


def best_time(engine: HFEngine, prompts: list[list[int]], sampling: Sampling, threshold: int) -> float:
    llama_decode.SHARED_PROMPT_MIN_BYTES = threshold
    start = time.perf_counter()
    engine.generate(prompts, sampling)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    chosen = llama_decode.SHARED_PROMPT_MIN_BYTES
    print(f"torch {torch.__version__}, threads={args.threads}, "
          f"matmul {bench_trl.matmul_gflops(args.threads):.1f} GFLOP/s; threshold {chosen >> 10} KiB")
    head = f"{'model':6s} {'prompts':>7s} {'n':>3s} {'P':>4s} {'repeated KB':>11s} {'per-row s':>9s} " \
           f"{'shared s':>8s} {'shared/per-row':>14s} {'picked':>8s}"
    rows = []
    with tempfile.TemporaryDirectory(prefix="tandem-sharing-") as tmp:
        engines = {}
        for model, U, n, P, new in CASES:
            if model not in engines:
                w = bench_trl.WORKLOADS[model]
                bench_trl.build_model(Path(tmp) / model, w)
                engines[model] = (HFEngine(str(Path(tmp) / model)), w)
            engine, w = engines[model]
            prompts = [[(7 * i + 3 * j) % 250 + 3 for j in range(P)] for i in range(U)]
            s = Sampling(n=n, max_new_tokens=new, temperature=1.0, ignore_eos=True, seed=0)
            best_time(engine, prompts, s, chosen)  # warm-up
            per_row, shared = [], []
            for _ in range(args.repeats):
                per_row.append(best_time(engine, prompts, s, 1 << 62))
                shared.append(best_time(engine, prompts, s, 1))
            kv_bytes = (n - 1) * U * P * w.kv_heads * (w.hidden // w.heads) * 2 * 4
            rows.append((model, U, n, P, kv_bytes, min(per_row), min(shared)))
            print(f"  {model} {U}x{n} P={P} done", flush=True)
    llama_decode.SHARED_PROMPT_MIN_BYTES = chosen
    print(head)
    print("-" * len(head))
    for model, U, n, P, kv_bytes, a, b in rows:
        picked = "shared" if n > 1 and kv_bytes >= chosen else "per-row"
        print(f"{model:6s} {U:7d} {n:3d} {P:4d} {kv_bytes / 1000:11.0f} {a:9.3f} {b:8.3f} {b / a:14.2f} {picked:>8s}")


if __name__ == "__main__":
    main()
