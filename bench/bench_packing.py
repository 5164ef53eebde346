"""Trained tokens per second and peak memory of the policy update, padded vs packed micro-batches, on a long-tail mix.

    .venv/bin/python bench/bench_packing.py [--steps 3] [--warmup 1] [--prompts 4] [--group 8] [--prompt-tokens 32]
        [--median 128] [--sigma 1.3] [--seed 0] [--micro-tokens 4096] [--threads 1] [--arch qwen2|qwen3] [--no-trl]
        [--quick]

One step's completions are drawn once, with fixed token ids: `--prompts` prompts of `--prompt-tokens` tokens, each
with `--group` completions whose lengths are lognormal (median `--median`, sigma `--sigma`, seeded by `--seed`)
clipped to [16, 2048] tokens, as reasoning traces are: most short, a few over a thousand. The model is a random Qwen2
of bench/bench_trl.py's `small` shape (hidden 256, 4 layers, 4 heads, 2 KV heads, MLP 512, the demo's byte-level
BPE; built here, no download); `--arch qwen3`, the model zoo's Qwen3 (tests/zoo_models.py) at that shape, which
has no prompt-once layout, so its padded micro-batches are plain [rows, longest].

The policy update is measured through tandem's trainer as a run drives it: a `TrainWorker` per layout
(`batch.padding_free=false`, today's left-padded micro-batches, and `true`, each micro-batch's rows end to end),
`prepare` (the reference's logprob pass: KL 0.04, k3) then `train` (the policy's forward, the token-mean clipped loss,
backward, the AdamW step), on the same samples and advantages, the layouts alternating step by step. A Qwen2 in one
process also has the prompt-once layout: each micro-batch keeps it where it runs fewer positions. Each layout's
figures: its micro-batches and the token positions their forwards run, completion tokens trained per second (median
step), and the peak bytes of tensors alive during a further, untimed step (bench/bench_memory.py's meter: weights,
gradients, AdamW state and the reference, plus the peak of what the step allocates). The machine is the CPU.

TRL (where installed, `--no-trl` to leave it out): its GRPOTrainer on the same model, prompts and completions, in a
child process. TRL 1.16 has no padding-free option for GRPO (GRPOConfig has no `padding_free`; a TRL whose
GRPOConfig has one runs with it on, and the output says which), and its `rollout_func` (an experimental GRPOTrainer
argument) hands it completions instead of sampling them: so its step here is its real one on these fixed
completions (the reference forward, the loss, backward, the optimizer step), rows right-padded to the batch's
longest completion as TRL lays them out, micro-batches of as many rows as the token budget holds at that width. Its
figures: completion tokens per second of its step minus its rollout_func and rewards; peak tensor bytes as above,
over its scoring and training passes (its optimizer step, outside those, is not metered).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_memory import MB, Meter  # noqa: E402  the peak-memory meter, shared
from bench_trl import WORKLOADS, TrlTimes, Workload, build_model, matmul_gflops  # noqa: E402  model, TRL timing, rate

SHORTEST, LONGEST = 16, 2048  # the completion lengths' clip
KL, CLIP, LR = 0.04, 0.2, 1e-5
LAYOUTS = {"padded": False, "packed": True}  # label -> batch.padding_free


def length_mix(n: int, median: float, sigma: float, seed: int) -> list[int]:
    """`n` completion lengths, lognormal around `median` (sigma `sigma` of its log), clipped to [16, 2048]."""
    rng = random.Random(seed)
    return [min(LONGEST, max(SHORTEST, round(rng.lognormvariate(math.log(median), sigma)))) for _ in range(n)]


def fixed_step(args, vocab: int) -> dict:
    """The step's prompts and completions as token ids (special tokens 0 and 1 left out), with each completion's
    advantage: the same for every layout and framework."""
    rng = random.Random(args.seed + 1)
    lengths = length_mix(args.prompts * args.group, args.median, args.sigma, args.seed)
    prompts = [[rng.randrange(2, vocab) for _ in range(args.prompt_tokens)] for _ in range(args.prompts)]
    completions = [[rng.randrange(2, vocab) for _ in range(n)] for n in lengths]
    advantages = [rng.gauss(0.0, 1.0) for _ in lengths]
    return {"prompts": prompts, "completions": completions, "advantages": advantages}


def samples_of(step: dict, group: int):
    """The step as the trainer receives it from the sampler (its sampler logprobs zeros: the check is off)."""
    from tandem.samples import Completion, Samples

    comps = [Completion(list(step["prompts"][i // group]), ids, [0.0] * len(ids), "", "length", i // group)
             for i, ids in enumerate(step["completions"])]
    return Samples.of_call(comps, len(step["prompts"]))


def train_worker(model: Path, padding_free: bool, args, out: Path):
    """The trainer of a one-process run on this model with this layout."""
    from tandem.config import load_config
    from tandem.workers.train import TrainWorker

    cfg = load_config(None, [
        f"model.path={model}", f"run.output_dir={out}", f"run.steps={args.warmup + args.steps + 1}",
        f"batch.prompts_per_step={args.prompts}", f"batch.group_size={args.group}",
        f"batch.micro_batch_tokens={args.micro_tokens}", f"batch.padding_free={str(padding_free).lower()}",
        f"data.max_prompt_tokens={args.prompt_tokens}", f"rollout.max_new_tokens={LONGEST}",
        "rollout.max_logprob_diff=null", f"algo.kl_coef={KL}", "algo.kl_estimator=k3", "algo.loss_agg=token_mean",
        f"algo.clip_low={CLIP}", f"algo.clip_high={CLIP}", f"optim.lr={LR}",
    ])
    return TrainWorker(cfg)


def update_seconds(worker, samples, advantages: torch.Tensor) -> float:
    """One update as a run's step makes it: the reference's logprobs (`prepare`), then the policy's (`train`)."""
    start = time.perf_counter()
    worker.prepare(samples)
    worker.train(advantages)
    return time.perf_counter() - start


def update_peak(worker, samples, advantages: torch.Tensor) -> int:
    """Peak tensor bytes of one update: resident weights, gradients, AdamW state and reference at the start of each
    phase, plus the peak of what the phase allocates."""
    policy = worker.policy
    meter = Meter(policy.device, lambda: [t for g in ("params", "grads", "optim", "ref") for t in policy._tensors(g)])
    with meter.phase("logprobs"):
        worker.prepare(samples)
    with meter.phase("update"):
        worker.train(advantages)
    return max(meter.rows.values())


def positions_run(worker, samples) -> tuple[int, int]:
    """(micro-batches, token positions their forwards run) of the step as this worker lays it out: each micro-batch
    in the layout it runs (prompt-once where it kept it, else packed, else padded)."""
    from tandem.train.batch import make_micro_batches

    p = worker.policy
    mbs = make_micro_batches(samples, worker.cfg.batch.micro_batch_tokens, worker.pad_id, by_prompt=p.share_prompts,
                             packed=p.padding_free)
    total = 0
    for mb in mbs:
        if mb.shared is not None:
            total += mb.shared.ids.numel() + sum(len(rows) * width for rows, width in mb.shared.buckets)
        else:
            total += mb.packed.ids.numel() if mb.packed is not None else mb.input_ids.numel()
    return len(mbs), total


def run_tandem(model: Path, step: dict, args, work: Path) -> dict[str, dict]:
    """Each layout's step times (alternating layouts, warm-up left out) and its peak memory on a further step."""
    samples = samples_of(step, args.group)
    advantages = torch.tensor(step["advantages"])
    workers = {label: train_worker(model, on, args, work / label) for label, on in LAYOUTS.items()}
    times: dict[str, list[float]] = {label: [] for label in workers}
    for k in range(args.warmup + args.steps):
        order = list(workers) if k % 2 else list(workers)[::-1]  # each layout first half the time
        for label in order:
            seconds = update_seconds(workers[label], samples, advantages)
            if k >= args.warmup:
                times[label].append(seconds)
    return {label: {"times": times[label], "peak": update_peak(w, samples, advantages),
                    "layout": positions_run(w, samples)} for label, w in workers.items()}


# ---------------------------------------------------------------------------------------------- TRL child


def trl_rows(completions: int, budget: int, width: int, group: int) -> int:
    """TRL's rows per micro-batch: the most that fit `budget` tokens at `width` (prompt + the batch's longest
    completion), dividing the batch, whole groups per generation batch."""
    fits = [r for r in range(1, completions + 1) if completions % r == 0 and r * width <= budget]
    return max(fits or [1])


def run_trl(model: Path, step: dict, args, out: Path) -> dict:
    """TRL's GRPOTrainer on the fixed step: its rollout_func returns the step's completions for its prompts."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    G, names = args.group, [f"prompt {i}" for i in range(len(step["prompts"]))]
    n = len(step["completions"])
    width = args.prompt_tokens + max(map(len, step["completions"]))
    rows = trl_rows(n, args.micro_tokens, width, G)

    def rollout(prompts, trainer):
        """The step's completions of these prompts: the k-th time a prompt is given (TRL repeats each G times, or
        gives it once), its k-th completion, or all G."""
        seen: dict[str, int] = {}
        pids, cids = [], []
        for p in prompts:
            i = names.index(p)
            first = seen.setdefault(p, 0)
            ks = range(G) if len(prompts) == len(names) else [first]
            seen[p] += 1
            for k in ks:
                pids.append(list(step["prompts"][i]))
                cids.append(list(step["completions"][i * G + k]))
        return {"prompt_ids": pids, "completion_ids": cids, "logprobs": None}

    def reward(prompts, completions, completion_ids, **_):
        return [float(len(ids) % 5) for ids in completion_ids]  # a spread inside every group: advantages not zero

    timer = TrlTimes()
    total = args.warmup + args.steps + 1  # the last step is metered
    # a TRL whose GRPOConfig has padding_free runs with it on (1.16 has none)
    packed = {"padding_free": True} if "padding_free" in GRPOConfig.__dataclass_fields__ else {}
    cfg = GRPOConfig(
        output_dir=str(out), use_cpu=True, bf16=False, gradient_checkpointing=False, seed=0,
        per_device_train_batch_size=rows, gradient_accumulation_steps=n // rows, steps_per_generation=n // rows,
        num_generations=G, max_completion_length=LONGEST, max_steps=total, learning_rate=LR, beta=KL, epsilon=CLIP,
        loss_type="dapo", scale_rewards="group", num_iterations=1, logging_steps=1, report_to=[],
        save_strategy="no", disable_dropout=True, dataloader_num_workers=0, **packed,
    )
    trainer = GRPOTrainer(model=str(model), reward_funcs=reward, args=cfg, rollout_func=rollout,
                          train_dataset=Dataset.from_list([{"prompt": p} for p in names]),
                          callbacks=[timer.callback()])
    timer.attach(trainer)
    peak = _meter_last_step(trainer, timer, total)
    trainer.train()
    given = sum(map(len, step["completions"]))
    if any(t != given for t in timer.tokens):
        raise RuntimeError(f"TRL trained {timer.tokens} completion tokens per step, not the step's {given}")
    phases = timer.phases()[args.warmup:total - 1]
    return {"times": [p["logprobs"] + p["update"] for p in phases], "peak": max(peak), "rows": rows, "width": width,
            "layout": (n // rows, n * width), "padding_free": bool(packed)}


def _meter_last_step(trainer, timer, total: int) -> list[int]:
    """Wrap TRL's scoring (`_generate_and_score_completions`) and training passes (`training_step`) in the memory
    meter on its last step only (the meter's dispatch hook would slow the timed ones); returns the list the peaks
    of those calls land in."""
    peaks = [0]

    def tensors():
        opt = trainer.optimizer
        state = [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)] if opt else []
        params = list(trainer.model.parameters()) + list(trainer.ref_model.parameters())
        return params + [p.grad for p in trainer.model.parameters() if p.grad is not None] + state

    def metered(fn):
        def wrapper(*a, **k):
            if len(timer.times) < total - 1:
                return fn(*a, **k)
            meter = Meter(torch.device("cpu"), tensors)
            with meter.phase("call"):
                out = fn(*a, **k)
            peaks.append(meter.rows["call"])
            return out
        return wrapper

    trainer._generate_and_score_completions = metered(trainer._generate_and_score_completions)
    trainer.training_step = metered(trainer.training_step)
    return peaks


def trl_child(model: Path, step: dict, args, work: Path) -> dict:
    """TRL in a child process: importing its trainer imports vLLM where that is installed, which changes the process
    it lands in (threads, environment)."""
    spec, result = work / "step.json", work / "trl.json"
    spec.write_text(json.dumps({"step": step, "args": vars(args)}))
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), TOKENIZERS_PARALLELISM="false",
               TRANSFORMERS_VERBOSITY="error", PYTHONWARNINGS="ignore", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", str(spec), "--model", str(model),
                           "--out", str(result)], env=env, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
    if proc.returncode != 0:
        sys.stdout.write(proc.stdout[-6000:])
        raise SystemExit(f"TRL failed (exit {proc.returncode})")
    return json.loads(result.read_text())


# ---------------------------------------------------------------------------------------------- parent


def build(folder: Path, shape: Workload, arch: str) -> int:
    """The model of `shape` in `folder`: bench_trl's Qwen2, or the zoo's Qwen3; returns its parameter count."""
    if arch == "qwen2":
        return build_model(folder, shape)
    sys.path.insert(0, str(ROOT / "tests"))
    import zoo_models

    zoo_models.build(folder, "qwen3", hidden_size=shape.hidden, num_hidden_layers=shape.layers,
                     num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                     head_dim=shape.hidden // shape.heads, intermediate_size=shape.mlp)
    from tandem.modeling import load_causal_lm

    return sum(p.numel() for p in load_causal_lm(folder).parameters())


def quick_shape() -> Workload:
    """The --quick model: the `small` workload's Qwen2 cut to hidden 64 and 2 layers."""
    return Workload("quick", 1, 1, 1, 64, 2, 4, 2, 128, ignore_eos=False, micro_rows=1)


def print_table(step: dict, results: dict[str, dict]) -> None:
    """One row per layout (and TRL): micro-batches and the token positions their forwards run, median update seconds,
    completion tokens trained per second, peak MB, ratios to the padded layout."""
    trained = sum(map(len, step["completions"]))
    base = results["padded"]
    print(f"\n{'layout':<10}{'micro':>6}{'positions':>10}{'update s':>10}{'compl tok/s':>13}{'peak MB':>10}"
          f"{'x padded tok/s':>16}{'x padded peak':>15}")
    for label, r in results.items():
        s = statistics.median(r["times"])
        ratio = statistics.median(base["times"]) / s
        micro, positions = r["layout"]
        print(f"{label:<10}{micro:>6}{positions:>10}{s:>10.3f}{trained / s:>13.0f}{r['peak'] / MB:>10.1f}"
              f"{ratio:>16.2f}{r['peak'] / base['peak']:>15.2f}")
    speedup = statistics.median(base["times"]) / statistics.median(results["packed"]["times"])
    print(f"packed / padded throughput: {speedup:.2f}x ({'meets' if speedup >= 1.5 else 'misses'} the 1.5x target)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3, help="measured updates per layout")
    ap.add_argument("--warmup", type=int, default=1, help="updates per layout before measuring")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=8, help="completions per prompt (the GRPO group)")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--median", type=float, default=128.0, help="median completion length, tokens")
    ap.add_argument("--sigma", type=float, default=1.3, help="sigma of the lengths' log")
    ap.add_argument("--seed", type=int, default=0, help="seed of the lengths, token ids and advantages")
    ap.add_argument("--micro-tokens", type=int, default=4096, help="batch.micro_batch_tokens")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (TRL's child too)")
    ap.add_argument("--arch", choices=["qwen2", "qwen3"], default="qwen2",
                    help="qwen3: the zoo's Qwen3 at the same shape (no prompt-once layout: padded is plain)")
    ap.add_argument("--no-trl", action="store_true", help="leave TRL out")
    ap.add_argument("--quick", action="store_true",
                    help="a tiny model, 2 prompts x 2, one update each, no TRL: checks the bench runs (times mean "
                         "nothing at this size)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        given = json.loads(Path(args.child).read_text())
        res = run_trl(Path(args.model), given["step"], argparse.Namespace(**given["args"]), Path(args.out).parent)
        Path(args.out).write_text(json.dumps(res))
        return
    if args.quick:
        args.steps, args.warmup, args.prompts, args.group, args.median, args.no_trl = 1, 0, 2, 2, 24.0, True
    torch.set_num_threads(args.threads)
    with_trl = not args.no_trl and importlib.util.find_spec("trl") is not None
    with tempfile.TemporaryDirectory(prefix="tandem-packing-") as tmp:
        work = Path(tmp)
        shape = quick_shape() if args.quick else WORKLOADS["small"]
        params = build(work / "model", shape, args.arch)
        vocab = json.loads((work / "model" / "config.json").read_text())["vocab_size"]
        step = fixed_step(args, vocab)
        lengths = sorted(map(len, step["completions"]))
        print(f"torch {torch.__version__}, {args.threads} torch thread(s), {os.cpu_count()} cores; fp32 matmul rate "
              f"{matmul_gflops(args.threads):.1f} GFLOP/s; load average {os.getloadavg()[0]:.2f}")
        name = "Qwen2" if args.arch == "qwen2" else "Qwen3 (the zoo's builder)"
        print(f"model: random {name} hidden {shape.hidden}, {shape.layers} layers, {shape.heads} heads, "
              f"{shape.kv_heads} KV heads, MLP {shape.mlp} ({params / 1e6:.2f} M parameters)")
        print(f"mix: {args.prompts} prompts of {args.prompt_tokens} tokens x group {args.group}; completion lengths "
              f"lognormal(median {args.median:g}, sigma {args.sigma:g}) clipped to [{SHORTEST}, {LONGEST}], seed "
              f"{args.seed}: min {lengths[0]}, median {lengths[len(lengths) // 2]}, max {lengths[-1]}, "
              f"{sum(lengths)} tokens; micro_batch_tokens {args.micro_tokens}; KL {KL} (reference loaded)")
        results = run_tandem(work / "model", step, args, work)
        if with_trl:
            trl = trl_child(work / "model", step, args, work)
            results["TRL"] = trl
            free = "padding_free on" if trl["padding_free"] else "its GRPOConfig has no padding_free"
            print(f"TRL {version('trl')} ({free}): {trl['rows']} rows per micro-batch, each {trl['width']} tokens "
                  "wide (prompt + the batch's longest completion)")
    print_table(step, results)


if __name__ == "__main__":
    main()
