"""Split placement on a long-tailed workload: sync, async and streaming schedules, in trained tokens per second.

    .venv/bin/python bench/bench_stream.py [--engine hf|vllm] [--steps 16] [--warmup 3] [--modes sync async ...]

One GRPO run per mode, each in this process, the same everything but `placement.schedule` (and, for
`stream-drained`, `rollout.in_flight_weights: false`): 1 trainer + 1 sampler as Ray actors, 1 CPU and 1 torch thread
each, on a randomly initialised Qwen2 of ~55 M parameters (hidden 512, 14 layers, MLP 2048; 220 MB of fp32 weights,
well beyond the processor's caches), built here in a temporary folder with the demo's tokenizer. The prompts are the
demo task's questions, in a jsonl file written here whose rows carry their own `max_new_tokens`: 85% of prompts get
SHORT tokens, 15% eight times that, with EOS ignored, so every completion's length is fixed by its prompt; every mode
sees the same prompts in the same order with the same lengths. `--engine vllm`: the sampler is vLLM in process
(`VLLMStream` under the stream modes) instead of the embedded engine. The reward (exact match) is about 0 for a random
model: what is measured is the machinery, not learning.

`placement.max_staleness` is the same for every mode (4: a long completion spans several updates under streaming).
Printed per mode: trained tokens per second (prompt + completion tokens trained, over the timed steps' wall time;
tokens a stream keeps as context but masks as too stale are not counted), the trainer's own rate (the same tokens
over its update time alone: what no schedule can pass), median seconds per step, the trainer's idle share and the
sampler's idle and weight-load shares of the step time, the per-token staleness of what is trained (mean over the
steps of each step's mean, and the max), and for the stream modes the requests restarted and the share of sampled
tokens masked as stale. Then the machine's fp32 matmul rate at one thread and its load, and as the last line
`streaming/async R1 streaming/sync R2` (trained tokens per second, streaming with in-flight weights, same run).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHORT, LONG_EVERY = 16, 0.15  # short completions' tokens; the share of prompts whose completions are 8x longer
PROMPTS, GROUP = 4, 2  # per step
ROWS = PROMPTS * GROUP
IN_FLIGHT = 32  # rollout.max_in_flight: the stream's requests decoding at once (4 steps' rows)
MODES = {
    "sync": ["placement.schedule=sync"],
    "async": ["placement.schedule=async"],
    "stream": ["placement.schedule=stream", f"rollout.max_in_flight={IN_FLIGHT}"],
    "stream-drained": ["placement.schedule=stream", f"rollout.max_in_flight={IN_FLIGHT}",
                       "rollout.in_flight_weights=false"],
}


def build_model(folder: Path) -> int:
    from bench_trl import Workload, build_model as build

    return build(folder, Workload("stream", 0, 0, 0, 512, 14, 8, 4, 2048, ignore_eos=True, micro_rows=0))


def write_prompts(path: Path, n: int = 400, seed: int = 0) -> None:
    """The demo's questions, each with its completions' length: SHORT, or 8 x SHORT for LONG_EVERY of them."""
    from tandem.data import arithmetic

    rng = random.Random(seed)
    rows = arithmetic.rows("train")[:n]
    with path.open("w") as fh:
        for r in rows:
            tokens = 8 * SHORT if rng.random() < LONG_EVERY else SHORT
            fh.write(json.dumps({"question": r["question"], "answer": r["answer"], "max_new_tokens": tokens}) + "\n")


def run(mode: str, steps: int, out: Path, model: str, data: Path, extra: list[str]) -> list[dict]:
    from tandem.config import load_config
    from tandem.trainer import train

    cfg = load_config(None, [
        f"model.path={model}", f"run.output_dir={out}", f"run.steps={steps}", "run.eval_every=0",
        "run.save_every=0", "run.progress=false", "run.plots=false", "run.report_to=[]", "data.task=jsonl",
        f"data.path={data}", "data.eval_size=4", "data.max_prompt_tokens=16", "rollout.ignore_eos=true",
        f"rollout.max_new_tokens={8 * SHORT}", f"batch.prompts_per_step={PROMPTS}", f"batch.group_size={GROUP}",
        "batch.micro_batch_tokens=1024", "optim.lr=1e-5", "rewards=[{name: arithmetic_exact}]",
        "placement.mode=split", "placement.backend=ray", "placement.train_workers=1",
        "placement.rollout_workers=1", "placement.cpus_per_worker=1", "placement.max_staleness=4",
        "reward_pool.workers=0", "eval.k=1", "run.seed=0", *MODES[mode], *extra])
    train(cfg)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def summarize(hist: list[dict], warmup: int) -> dict[str, float]:
    steps = [h for h in hist if h["step"] > warmup and "time/step" in h]
    wall = sum(h["time/step"] for h in steps)
    processed = [h["tokens_per_s"] * h["time/step"] for h in steps]  # prompt + completion tokens through the update
    # tokens beyond the staleness bound stay as context (processed) but are masked out of the loss: not trained
    masked = [h.get("stream/stale_masked_frac", 0.0) * h["completion/length_mean"] * ROWS for h in steps]
    return {
        "trained tok/s": (sum(processed) - sum(masked)) / wall,
        "trainer alone": sum(processed) / sum(h["time/update"] for h in steps),  # the ceiling of any schedule
        "s/step": statistics.median(h["time/step"] for h in steps),
        "trainer idle": sum(h["time/trainer_idle"] for h in steps) / wall,
        "sampler idle": sum(h.get("time/sampler_idle", 0.0) for h in steps) / wall,
        "sampler load": sum(h.get("time/weight_load", 0.0) for h in steps) / wall,
        "staleness mean": statistics.mean(h.get("async/staleness_mean", h.get("async/staleness", 0)) for h in steps),
        "staleness max": max(h.get("async/staleness", 0) for h in steps),
        "restarted": sum(h.get("stream/restarted", 0) for h in steps),
        "masked frac": sum(masked) / max(sum(h["completion/length_mean"] * ROWS for h in steps), 1e-9),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the timing (start-up, first syncs)")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--engine", choices=["hf", "vllm"], default="hf", help="the sampler's engine (rollout.engine)")
    p.add_argument("overrides", nargs="*", help="extra config overrides for every run")
    args = p.parse_args()
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    from bench_trl import matmul_gflops

    rate = matmul_gflops(1)
    rows: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="tandem-bench-stream-") as tmp:
        model, data = Path(tmp) / "model", Path(tmp) / "prompts.jsonl"
        params = build_model(model)
        write_prompts(data)
        for mode in args.modes:
            t0 = time.perf_counter()
            hist = run(mode, args.steps, Path(tmp) / mode, str(model), data,
                       [f"rollout.engine={args.engine}", *args.overrides])
            rows[mode] = dict(summarize(hist, args.warmup), **{"wall s": time.perf_counter() - t0})
    print(f"\nsplit placement, {args.engine} engine, 1 trainer + 1 sampler (1 CPU, 1 torch thread each), Qwen2 "
          f"{params / 1e6:.1f} M parameters fp32, {PROMPTS} prompts x {GROUP} per step, completions {SHORT} or "
          f"{8 * SHORT} tokens ({LONG_EVERY:.0%} long), max_staleness 4, stream: {IN_FLIGHT} requests in flight, "
          f"{args.steps} steps, timing steps > {args.warmup}")
    print(f"fp32 matmul rate at 1 thread: {rate:.1f} GFLOP/s; {os.cpu_count()} cores; load "
          f"{os.getloadavg()[0]:.2f} (1 min) at the end")
    cols = list(next(iter(rows.values())))
    print(f"{'mode':<16}" + "".join(f"{c:>16}" for c in cols))
    for mode, r in rows.items():
        print(f"{mode:<16}" + "".join(f"{r[c]:>16.3f}" for c in cols))
    if "stream-drained" in rows and "async" in rows:
        print(f"stream-drained/async {rows['stream-drained']['trained tok/s'] / rows['async']['trained tok/s']:.2f} "
              f"(rollout.in_flight_weights: false); the trainer alone / async "
              f"{rows['async']['trainer alone'] / rows['async']['trained tok/s']:.2f} (no schedule passes it)")
    if "stream" in rows and "async" in rows and "sync" in rows:
        tps = {m: r["trained tok/s"] for m, r in rows.items()}
        print(f"streaming/async {tps['stream'] / tps['async']:.2f} streaming/sync {tps['stream'] / tps['sync']:.2f}")


if __name__ == "__main__":
    main()
