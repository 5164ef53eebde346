"""How TRL's and tandem's GRPO step cost grows: group size at long prompts, completion length at fixed rows.

    bash scripts/setup.sh bench && .venv/bin/python bench/bench_scaling.py [--sweep group|length|both] [--steps N]
        [--threads 1]

Each point is one fresh child process per framework, run exactly as `bench/bench_trl.py` runs them (same configs:
KL 0.04 k3 with a reference model, token-mean loss, clip 0.2, fp32, temperature 1, fixed-length completions), on
`bench_trl`'s small model (Qwen2 hidden 256 / 4 layers / MLP 512). Two sweeps:
  group:  2 prompts of ~256 tokens (fixed context before the demo question), group size 4, 8, 16, 32, 32 new tokens.
          GRPO's completions of a prompt share it: a framework that computes the prompt once per group (tandem's
          prefill and training) grows more slowly in the group size than one that runs every row's full sequence.
  length: 4 prompts x 4 completions of the bare demo question (6 tokens), 32, 128, 512 new tokens.
Printed per point: seconds per step (median of the measured steps), each phase's seconds, peak RSS; per sweep, each
framework's growth exponent: the least-squares slope of log(cost) on log(group size or length), 1.0 = linear.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_trl  # noqa: E402  (the children, the model builder and the rate measurement)

SMALL = bench_trl.WORKLOADS["small"]
SWEEPS = {
    "group": ("group size", [replace(SMALL, name="group", prompts=2, generations=g, new_tokens=32, ignore_eos=True,
                                     micro_rows=8, context=250) for g in (4, 8, 16, 32)]),
    "length": ("completion length", [replace(SMALL, name="length", prompts=4, generations=4, new_tokens=n,
                                             ignore_eos=True, micro_rows=8) for n in (32, 128, 512)]),
}


def exponent(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of log y on log x: cost ~ x^slope."""
    lx, ly = [math.log(x) for x in xs], [math.log(max(y, 1e-9)) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", choices=["group", "length", "both"], default="both")
    ap.add_argument("--steps", type=int, default=2, help="measured steps per point")
    ap.add_argument("--warmup", type=int, default=1, help="steps run before measuring")
    ap.add_argument("--threads", type=int, default=1, help="torch threads in every process")
    ap.add_argument("--frameworks", nargs="+", default=["trl", "tandem"], choices=["trl", "tandem"])
    args = ap.parse_args()

    import torch

    print(f"torch {torch.__version__}, threads={args.threads}, cores={os.cpu_count()}, "
          f"load average at start={os.getloadavg()}")
    print(f"fp32 matmul rate at {args.threads} thread(s): {bench_trl.matmul_gflops(args.threads):.1f} GFLOP/s")
    sweeps = ["group", "length"] if args.sweep == "both" else [args.sweep]
    results: dict[str, list[tuple[int, int, dict]]] = {}
    with tempfile.TemporaryDirectory(prefix="tandem-scaling-") as tmp:
        work = Path(tmp)
        model = work / "model"
        params = bench_trl.build_model(model, SMALL)
        print(f"model: {params / 1e6:.2f} M parameters (bench_trl's small)")
        for sweep in sweeps:
            results[sweep] = []
            for w in SWEEPS[sweep][1]:
                x = w.generations if sweep == "group" else w.new_tokens
                plen = bench_trl.prompt_tokens(w, model)
                res = {}
                for fw in args.frameworks:
                    start = time.perf_counter()
                    raw = bench_trl.child(fw, w, model, work, args.warmup + args.steps, args.threads)
                    res[fw] = bench_trl.summarize(raw, args.warmup)
                    print(f"  {sweep} {x:4d} {fw:6s} done in {time.perf_counter() - start:.0f} s, steps: "
                          + ", ".join(f"{t:.3f}" for t in res[fw]["all"]) + f"; load {os.getloadavg()[0]:.2f}",
                          flush=True)
                results[sweep].append((x, plen, res))

    for sweep in sweeps:
        label, workloads = SWEEPS[sweep]
        w0 = workloads[0]
        fixed = (f"{w0.prompts} prompts, {w0.new_tokens} new tokens" if sweep == "group"
                 else f"{w0.prompts} prompts x {w0.generations} completions")
        print(f"\n{sweep} sweep: cost against {label} ({fixed}; prompts of {results[sweep][0][1]} tokens; "
              f"s = median of {args.steps} measured steps after {args.warmup} warm-up)")
        head = f"{label:>17s} {'framework':9s} {'s/step':>8s} {'rollout':>8s} {'logprobs':>8s} {'update':>8s} " \
               f"{'peak RSS MB':>11s}"
        print(head)
        print("-" * len(head))
        for x, _, res in results[sweep]:
            for fw, r in res.items():
                p = r["phases"]
                print(f"{x:17d} {fw:9s} {r['s_step']:8.3f} {p['rollout']:8.3f} {p['logprobs']:8.3f} "
                      f"{p['update']:8.3f} {r['rss_mb']:11.0f}")
        xs = [x for x, _, _ in results[sweep]]
        for fw in args.frameworks:
            rows = [res[fw] for _, _, res in results[sweep]]
            fits = [exponent(xs, [r["s_step"] for r in rows])]
            fits += [exponent(xs, [r["phases"][k] for r in rows]) for k in ("rollout", "logprobs", "update")]
            fits.append(exponent(xs, [r["rss_mb"] for r in rows]))
            print(f"{'growth exponent':>17s} {fw:9s} " + " ".join(f"{f:8.2f}" for f in fits[:4]) + f" {fits[4]:11.2f}")
    print(f"load average at end={os.getloadavg()}")


if __name__ == "__main__":
    main()
