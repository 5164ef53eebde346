"""Compare the GRPO-family presets in examples/ on the demo task: same warm start, seed and step count.

    .venv/bin/python bench/bench_presets.py [--steps 60] [--presets grpo dapo ...] [--threads 1]

Prints, per preset: held-out greedy accuracy before and after, reward, mean step time and wall time.
"""
from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--presets", nargs="*", default=["grpo", "dapo", "dr_grpo", "gspo", "rloo"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)

    from tandem.cli import DEMO_DEFAULTS
    from tandem.config import load_config
    from tandem.demo import demo_model
    from tandem.trainer import train

    model = demo_model()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.presets:
            out = Path(tmp) / name
            cfg = load_config(ROOT / "examples" / f"{name}.yaml", [
                f"model.path={model}", f"run.output_dir={out}", f"run.steps={args.steps}", f"run.seed={args.seed}",
                f"run.threads={args.threads}", "run.eval_every=0", "run.save_every=0", "run.progress=false",
                "run.report_to=[]", "run.plots=false",
            ], DEMO_DEFAULTS)
            start = time.perf_counter()
            summary = train(cfg)
            wall = time.perf_counter() - start
            hist = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
            steps = [h for h in hist if h["step"] > 0]
            rows.append({
                "preset": name, "acc_before": summary["initial_eval/accuracy"], "acc_after": summary["eval/accuracy"],
                "reward_last10": sum(h["reward/mean"] for h in steps[-10:]) / len(steps[-10:]),
                "s_per_step": sum(h["time/step"] for h in steps) / len(steps), "wall_s": wall,
            })
    print(f"\nGRPO presets on the demo task: {args.steps} steps, seed {args.seed}, torch threads "
          f"{torch.get_num_threads()}, same warm-started model ({model.name})")
    print(f"{'preset':<10}{'acc before':>12}{'acc after':>12}{'reward (last 10)':>18}{'s/step':>10}{'wall s':>10}")
    for r in rows:
        print(f"{r['preset']:<10}{r['acc_before']:>12.3f}{r['acc_after']:>12.3f}{r['reward_last10']:>18.3f}"
              f"{r['s_per_step']:>10.3f}{r['wall_s']:>10.1f}")


if __name__ == "__main__":
    main()
