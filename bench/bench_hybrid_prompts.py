"""The trainer's update on a Qwen3.5 (Gated DeltaNet hybrid) with each prompt run once per group vs once per row.

    .venv/bin/python bench/bench_hybrid_prompts.py [--steps 12] [--warmup 2] [--prompt 96] [--completion 24]

One torch thread. The Qwen3.5 demo's architecture (tandem.demo.HybridDemoSpec: 3 Gated DeltaNet layers, 1 gated
full-attention layer, untrained: the time does not depend on the weights), batches of 8 prompts x G = 8 completions
with prompts `--prompt` tokens long and completions of `--completion` tokens or fewer (reasoning-style workloads have
long prompts: a problem statement, few-shot examples, a tool transcript). Each batch is updated once with the
prompt-once layout (`token_logprobs(share_prompts=True)`: the prompts' recurrent states carried to their rows) and
once with the per-row forward, in alternating order, from the same weights (restored after each update). Prints the
median update time of each, their ratio, and the matmul rate of the thread.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_buckets import timed_update  # noqa: E402  the same timing of one update, weights restored after it
from bench_trl import matmul_gflops  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2, help="batches left out of the timing")
    p.add_argument("--prompt", type=int, default=96, help="prompt tokens")
    p.add_argument("--completion", type=int, default=24, help="the longest completion's tokens")
    args = p.parse_args()
    torch.set_num_threads(1)

    from tandem import demo
    from tandem.config import AlgoConfig, OptimConfig
    from tandem.data import arithmetic
    from tandem.rollout import Completion, Samples
    from tandem.train.batch import make_micro_batches
    from tandem.train.policy import Policy

    spec = demo.HybridDemoSpec()
    tokenizer = demo.build_tokenizer(arithmetic.corpus(), spec.vocab_size)
    folder = Path(tempfile.mkdtemp(prefix="bench-hybrid-")) / "qwen3_5"
    spec.build(tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    policy = Policy(str(folder), "float32", False, AlgoConfig(), OptimConfig(lr=1e-5), args.steps * 2, 1.0, 64)
    assert policy.share_prompts, "Qwen3.5 in one process: the prompt-once trainer applies"
    rng = random.Random(0)
    vocab = len(tokenizer)
    times: dict[str, list[float]] = {"prompt once": [], "per row": []}
    for step in range(args.steps):
        comps = []
        for i in range(8):
            prompt = [rng.randrange(3, vocab) for _ in range(args.prompt)]
            for _ in range(8):
                n = rng.randint(args.completion // 4, args.completion)
                comps.append(Completion(prompt, [rng.randrange(3, vocab) for _ in range(n)], [-1.0] * n, "", "stop",
                                        prompt_index=i))
        adv = torch.randn(len(comps), generator=torch.Generator().manual_seed(step))
        order = ["prompt once", "per row"] if step % 2 else ["per row", "prompt once"]
        for layout in order:
            policy.share_prompts = layout == "prompt once"
            mbs = make_micro_batches(Samples.of_call(comps), 1 << 20, tokenizer.pad_token_id, by_prompt=True)
            elapsed = timed_update(policy, mbs, adv)
            if step >= args.warmup:
                times[layout].append(elapsed)
    print(f"\nQwen3.5 (HybridDemoSpec, untrained) update, 1 torch thread ({matmul_gflops(1):.1f} GFLOP/s fp32 matmul), "
          f"{args.steps - args.warmup} batches of 8 prompts x 8 (after {args.warmup} warm-up), prompts "
          f"{args.prompt} tokens, completions up to {args.completion}, alternating layouts on the same weights")
    print(f"{'layout':<14}{'update s (median)':>20}")
    for layout, ts in times.items():
        print(f"{layout:<14}{statistics.median(ts):>20.4f}")
    ratio = statistics.median(times["prompt once"]) / statistics.median(times["per row"])
    print(f"prompt once / per row: {ratio:.2f}x the update time")


if __name__ == "__main__":
    main()
