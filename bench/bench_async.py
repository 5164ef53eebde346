"""Split placement, sync vs async schedule: seconds per step and reward after the same steps, one core per side.

    .venv/bin/python bench/bench_async.py [--steps 24] [--warmup 4] [--workloads demo long even] [overrides]
    .venv/bin/python bench/bench_async.py --engine vllm [--samplers 1 2] [--workloads demo]   # vLLM samplers

`--engine vllm` samples with in-process vLLM engines in the sampler actors (weights over the weight channel) and
runs each workload with 1 and with 2 sampler instances; besides the async / sync ratio it reports the samplers'
completion tokens per second per instance (the step's completion tokens over the slowest sampler's generation
time, divided by the instances). The machine's fp32 matmul rate at one thread is printed first: figures from
machines with other processors compare only as ratios within one run.

The same GRPO run (the demo model, 1 trainer + 1 sampler as Ray actors, 1 CPU and 1 torch thread each) twice:
`schedule: sync` (the sampler waits while the trainer trains and the other way round) and `schedule: async`
with `max_staleness: 1` (the sampler works on the next batch while the trainer trains). Prints the median seconds
per step after warm-up, the mean trainer and sampler idle time per step, the reward over the last steps and
held-out greedy accuracy at the end; then the ratio async / sync (target <= 0.6 for the step time).

Async can at best hide the shorter side: its step is max(sample, train), against sample + train for sync, so
the best ratio is max / sum (0.5 when both sides take as long). Three workloads, from trainer-heavy to even:
  demo  the demo exactly (answers of ~3 tokens, 32 prompts x 8): training ~53% of the sync step, bound ~0.53;
  long  the demo model sampling 24 tokens at fixed length (EOS ignored), scored by `arithmetic_digits` (partial
        credit, diluted by the tokens after the answer): training ~60%, bound ~0.60;
  even  `long` with 8 prompts x 8 per step: a small batch decodes at low efficiency, as long reasoning
        rollouts do, so sampling takes about as long as training (the case async is for), bound ~0.55.
"Training" is the trainer's own work (`time/step` minus `time/trainer_idle` under sync); both sides also share
the machine's two cores with the controller and Ray's daemons, so each runs slower when they overlap.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


WORKLOADS = {
    "demo": [],
    "long": ["rollout.max_new_tokens=24", "rollout.ignore_eos=true", "rewards=[{name: arithmetic_digits}]"],
    "even": ["batch.prompts_per_step=8", "rollout.max_new_tokens=24", "rollout.ignore_eos=true",
             "rewards=[{name: arithmetic_digits}]"],
}


VLLM = ["rollout.engine=vllm", "rollout.vllm.kv_cache_mb=64", "rollout.vllm.max_model_len=128"]


def run(schedule: str, steps: int, out: Path, model: str, extra: list[str], samplers: int = 1) -> list[dict]:
    from tandem.demo import DEMO_DEFAULTS
    from tandem.config import load_config
    from tandem.trainer import train

    cfg = load_config(None, [
        f"model.path={model}", f"run.output_dir={out}", f"run.steps={steps}", "run.eval_every=0",
        f"run.save_every={steps}", "run.progress=false", "run.plots=false", "run.report_to=[]",
        "data.eval_size=200", "placement.mode=split", "placement.backend=ray", "placement.train_workers=1",
        f"placement.rollout_workers={samplers}", "placement.cpus_per_worker=1", f"placement.schedule={schedule}",
        "placement.max_staleness=1", "reward_pool.workers=0", *extra], DEMO_DEFAULTS)
    train(cfg)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--warmup", type=int, default=4, help="steps left out of the timing (start-up, first syncs)")
    p.add_argument("--last", type=int, default=8, help="steps whose mean reward is reported")
    p.add_argument("--workloads", nargs="+", default=None, choices=list(WORKLOADS),
                   help="default: all three with hf, demo with vllm")
    p.add_argument("--engine", choices=["hf", "vllm"], default="hf", help="the samplers' rollout engine")
    p.add_argument("--samplers", type=int, nargs="+", default=None,
                   help="sampler instances to run each workload with (default: 1 with hf, 1 and 2 with vllm)")
    p.add_argument("overrides", nargs="*", help="extra config overrides for every run")
    args = p.parse_args()
    workloads = args.workloads or (list(WORKLOADS) if args.engine == "hf" else ["demo"])
    counts = args.samplers or ([1] if args.engine == "hf" else [1, 2])
    engine = VLLM if args.engine == "vllm" else []
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    from bench_trl import matmul_gflops

    from tandem.demo import demo_model

    print(f"fp32 matmul rate at 1 thread: {matmul_gflops(1):.1f} GFLOP/s; every actor runs 1 torch thread on 1 "
          f"reserved CPU, {os.cpu_count()} cores on this machine")
    model = str(demo_model())
    rows = {}
    with tempfile.TemporaryDirectory(prefix="tandem-bench-async-") as tmp:
        for workload, n, schedule in ((w, n, s) for w in workloads for n in counts for s in ("sync", "async")):
            t0 = time.perf_counter()
            hist = run(schedule, args.steps, Path(tmp) / f"{workload}-{n}-{schedule}", model,
                       WORKLOADS[workload] + engine + args.overrides, n)
            steps = [h for h in hist if h["step"] > args.warmup and "time/step" in h]
            last = [h for h in hist if h["step"] > args.steps - args.last and "reward/mean" in h]
            final = [h for h in hist if "eval/accuracy" in h][-1]
            rows[workload, n, schedule] = {
                "s/step": statistics.median(h["time/step"] for h in steps),
                "trainer idle": statistics.mean(h["time/trainer_idle"] for h in steps),
                "sampler idle": statistics.mean(h.get("time/sampler_idle", 0.0) for h in steps),
                "staleness": max(h.get("async/staleness", 0) for h in steps),
                "reward (last)": statistics.mean(h["reward/mean"] for h in last),
                "eval acc": final["eval/accuracy"],
                "tok/s/sampler": statistics.median(h["rollout/tokens_per_s"] for h in steps) / n,
                "wall s": time.perf_counter() - t0,
            }
    print(f"\nsplit placement, {args.engine} samplers, 1 trainer + {counts} sampler(s) (1 CPU, 1 torch thread "
          f"each), {args.steps} steps, timing steps > {args.warmup}, load {os.getloadavg()[0]:.2f}")
    cols = list(next(iter(rows.values())))
    print(f"{'workload':<10}{'samplers':>9} {'schedule':<10}" + "".join(f"{c:>15}" for c in cols))
    for (workload, n, schedule), r in rows.items():
        print(f"{workload:<10}{n:>9} {schedule:<10}" + "".join(f"{r[c]:>15.3f}" for c in cols))
    for workload, n in ((w, n) for w in workloads for n in counts):
        sync = rows[workload, n, "sync"]
        ratio = rows[workload, n, "async"]["s/step"] / sync["s/step"]
        # the most overlap can give: the longer side alone (under sync, the trainer's idle time is the sampling
        # and scoring; the rest of the step is its own work)
        sample, rest = sync["trainer idle"], sync["s/step"] - sync["trainer idle"]
        print(f"{workload} x{n}: async / sync step time {ratio:.2f} (target <= 0.60; perfect overlap of this "
              f"workload's {sample:.3f} s sampling and {rest:.3f} s training would give "
              f"{max(sample, rest) / sync['s/step']:.2f}); sampler tokens/s per instance: sync "
              f"{sync['tok/s/sampler']:.0f}, async {rows[workload, n, 'async']['tok/s/sampler']:.0f}")


if __name__ == "__main__":
    main()
