"""The hf engine's two ways to hold a group's prompt in decode: the HF forward on a cache copied out to every row, or
the prompt held once (tandem.rollout.hf.shared_prompt: split attention).

    .venv/bin/python bench/bench_prompt_sharing.py [--threads 1] [--repeats 3]

Times `HFEngine.generate` (fixed-length rollouts, temperature 1) both ways, alternating, best of `--repeats`, on
bench_trl's small and large models, for prompts of several lengths and group shapes; prints each side's seconds, the
ratio shared / HF forward, and the bytes of prompt keys and values per layer that the HF forward holds again for
every row after a group's first. The engine holds the prompt once wherever `shared_prompt.shares` allows: this is
the measurement behind that choice.
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

from tandem.rollout import Sampling, hf  # noqa: E402
from tandem.rollout.hf import HFEngine  # noqa: E402
from tandem.rollout.hf.shared_prompt import shares  # noqa: E402

# (model, prompts, completions per prompt, prompt tokens, new tokens)
CASES = [("small", 4, 4, 6, 32), ("small", 4, 4, 32, 32), ("small", 4, 4, 64, 32), ("small", 2, 8, 6, 32),
         ("small", 2, 32, 256, 32), ("large", 16, 8, 6, 32)]


def timed(engine: HFEngine, prompts: list[list[int]], sampling: Sampling, shared: bool) -> float:
    hf.shares = shares if shared else (lambda model, n: False)
    start = time.perf_counter()
    engine.generate(prompts, sampling)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, threads={args.threads}, "
          f"matmul {bench_trl.matmul_gflops(args.threads):.1f} GFLOP/s")
    head = f"{'model':6s} {'prompts':>7s} {'n':>3s} {'P':>4s} {'repeated KB':>11s} {'HF forward s':>12s} " \
           f"{'shared s':>8s} {'shared/HF':>9s}"
    rows = []
    with tempfile.TemporaryDirectory(prefix="tandem-sharing-") as tmp:
        engines = {}
        for model, U, n, P, new in CASES:
            if model not in engines:
                w = bench_trl.WORKLOADS[model]
                bench_trl.build_model(Path(tmp) / model, w)
                engines[model] = (HFEngine(str(Path(tmp) / model)), w)
            engine, w = engines[model]
            assert shares(engine.profile, engine.model, n), "the shared path must be the one timed"
            prompts = [[(7 * i + 3 * j) % 250 + 3 for j in range(P)] for i in range(U)]
            s = Sampling(n=n, max_new_tokens=new, temperature=1.0, ignore_eos=True, seed=0)
            timed(engine, prompts, s, True)  # warm-up
            per_row, shared = [], []
            for _ in range(args.repeats):
                per_row.append(timed(engine, prompts, s, False))
                shared.append(timed(engine, prompts, s, True))
            kv_bytes = (n - 1) * U * P * w.kv_heads * (w.hidden // w.heads) * 2 * 4
            rows.append((model, U, n, P, kv_bytes, min(per_row), min(shared)))
            print(f"  {model} {U}x{n} P={P} done", flush=True)
    hf.shares = shares
    print(head)
    print("-" * len(head))
    for model, U, n, P, kv_bytes, a, b in rows:
        print(f"{model:6s} {U:7d} {n:3d} {P:4d} {kv_bytes / 1000:11.0f} {a:12.3f} {b:8.3f} {b / a:9.2f}")


if __name__ == "__main__":
    main()
