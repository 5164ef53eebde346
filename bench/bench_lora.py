"""LoRA GRPO beside full fine-tuning GRPO of the same model, same run: bytes synced per step, training state, memory.

    .venv/bin/python bench/bench_lora.py [--hidden 512] [--layers 8] [--vocab 32768] [--rank 8] [--steps 2]

A random Qwen2 (tied embeddings; the defaults give ~42 M parameters) is built here, no download. Two measurements,
each for full fine-tuning and for LoRA (rank --rank on every attention and MLP projection, the default targets):

  sync bytes   a real split run (placement.mode: split on Ray, 1 trainer + 1 hf sampler, 1 CPU and 1 torch thread
               each): `sync/bytes` per step, what the trainer sends to the sampler (full: every weight; LoRA: A and
               B of each adapted module, which the sampler merges into the base weights it loaded itself).
  state bytes  one GRPO step (KL on, mu = 1) through bench_memory.grpo_step in this process: the bytes training
               keeps besides the weights (a gradient per trainable parameter, AdamW's two moments, the reference
               model for KL, which LoRA replaces by the base with its adapters off), and the update phase's peak
               device bytes (weights + state + activations; bench_memory explains how it is tracked on CPU).

Targets: LoRA's sync bytes <= 5% of full's; optimizer + gradient bytes >= 10x smaller. The
machine's fp32 matmul rate at one thread is printed: figures of other machines compare as ratios only.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

MB = 1 << 20


def split_run(model: Path, out: Path, steps: int, lora: list[str]) -> list[dict]:
    from tandem.config import load_config
    from tandem.trainer import train

    cfg = load_config(None, [
        f"model.path={model}", f"run.output_dir={out}", f"run.steps={steps}", "run.save_every=0", "run.eval_every=0",
        "run.progress=false", "run.plots=false", "run.report_to=[]", "data.eval_size=4", "batch.prompts_per_step=4",
        "batch.group_size=4", "rollout.max_new_tokens=8", "data.max_prompt_tokens=16", "batch.micro_batch_tokens=512",
        "placement.backend=ray", "placement.mode=split", "placement.cpus_per_worker=1", "reward_pool.workers=0",
        *lora])
    train(cfg)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"sync/bytes"' in line]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--steps", type=int, default=2, help="steps of each split run")
    args = ap.parse_args()
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import torch

    from bench_memory import build_model, grpo_step
    from bench_trl import matmul_gflops

    from tandem.config import LoraConfig

    torch.set_num_threads(1)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    lora = LoraConfig(enabled=True, rank=args.rank, alpha=2.0 * args.rank)
    step_args = argparse.Namespace(prompts=8, n=4, prompt_len=16, new_tokens=32, micro_tokens=1024)
    rows: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="tandem-bench-lora-") as tmp:
        model = build_model(Path(tmp) / "model", args.hidden, args.layers, args.vocab)
        from safetensors.torch import load_file

        params = sum(t.numel() for t in load_file(str(model / "model.safetensors")).values())
        print(f"fp32 matmul rate at 1 thread: {matmul_gflops(1):.1f} GFLOP/s; {os.cpu_count()} cores; device "
              f"{device.type}; Qwen2 hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}: "
              f"{params / 1e6:.1f} M parameters; LoRA rank {args.rank} on q k v o gate up down")
        for name, cfg in (("full", None), ("lora", lora)):
            peaks, info = grpo_step(model, step_args, device, offload=False, lora=cfg)
            acc = info["accounted"]
            runs = split_run(model, Path(tmp) / name, args.steps,
                             ["lora.enabled=true", f"lora.rank={args.rank}", f"lora.alpha={2 * args.rank}"]
                             if cfg else [])
            rows[name] = {"sync bytes/step": runs[-1]["sync/bytes"], "sync s/step": runs[-1]["time/sync"],
                          "grads": acc["grads"], "optim": acc["optim"], "grads+optim": acc["grads"] + acc["optim"],
                          "reference": acc["ref"], "update peak": peaks["update"]}
    cols = list(rows["full"])
    print(f"\n{'':8}" + "".join(f"{c:>17}" for c in cols))
    for name, r in rows.items():
        print(f"{name:8}" + "".join(f"{r[c]:>17.4f}" if c == "sync s/step" else f"{r[c] / MB:>14.2f} MB"
                                    for c in cols))
    ratio = {c: rows["lora"][c] / rows["full"][c] if rows["full"][c] else float("nan") for c in cols}
    print(f"{'lora/full':8}" + "".join(f"{ratio[c]:>17.4f}" for c in cols))
    print(f"\nLoRA sync bytes = {100 * ratio['sync bytes/step']:.2f}% of full (target <= 5%); grads + optimizer state "
          f"{1 / ratio['grads+optim']:.0f}x smaller (target >= 10x); reference model "
          f"{rows['full']['reference'] / MB:.1f} MB -> {rows['lora']['reference'] / MB:.1f} MB")


if __name__ == "__main__":
    main()
