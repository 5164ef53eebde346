"""The trainer's update with completions in length buckets vs one bucket (padded to the longest), on the demo's batches.

    .venv/bin/python bench/bench_buckets.py [--steps 24] [--warmup 2]

One torch thread. The demo's model samples the demo's batches (32 prompts x 8, answers of 2-6 tokens) with the
embedded engine; each batch is then laid out twice for the prompt-once trainer, with `BUCKET_PASS_TOKENS` at its
default (buckets by length) and infinite (one bucket: the layout before buckets), and updated once with each, in
alternating order, from the same weights (restored after each update). Prints the median update time of each,
their ratio, and the padded positions each layout runs.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def timed_update(policy, mbs: list, adv: torch.Tensor) -> float:
    """Seconds of one update of `policy` on the micro-batches `mbs` (their old and reference logprobs prepared first,
    untimed), the weights restored after it, so the next layout updates from the same ones."""
    weights = {k: v.clone() for k, v in policy.model.state_dict().items()}
    prepared = policy.prepare([mbs], len(adv))
    start = time.perf_counter()
    policy.update(prepared, adv)
    elapsed = time.perf_counter() - start
    policy.model.load_state_dict(weights)
    return elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--warmup", type=int, default=2, help="batches left out of the timing")
    args = p.parse_args()
    torch.set_num_threads(1)

    import tandem.train.batch as batch
    from tandem.demo import DEMO_DEFAULTS
    from tandem.config import load_config
    from tandem.data.sources import load_task_rows, tokenize_rows
    from tandem.demo import demo_model
    from tandem.modeling import load_tokenizer
    from tandem.rollout import Samples, make_engine
    from tandem.run.source import sampling_for
    from tandem.train.policy import Policy

    path = str(demo_model())
    cfg = load_config(None, [f"model.path={path}"], DEMO_DEFAULTS)
    engine = make_engine("hf", model_path=path, dtype="float32", seed=0)
    policy = Policy(path, "float32", False, cfg.algo, cfg.optim, args.steps * 2, cfg.rollout.temperature,
                    cfg.rollout.max_new_tokens, old_logprobs=cfg.old_logprobs)
    assert policy.share_prompts, "the demo model is a Qwen2: the prompt-once trainer applies"
    tok = load_tokenizer(path)
    P = cfg.batch.prompts_per_step
    rows = load_task_rows("arithmetic", None, "question", "answer", "train")[: P * args.steps]
    prompts = tokenize_rows(rows, tok, cfg.data.chat_template, cfg.data.system_prompt, cfg.data.max_prompt_tokens,
                            "arithmetic")
    default = batch.BUCKET_PASS_TOKENS
    times: dict[str, list[float]] = {"buckets": [], "one bucket": []}
    positions: dict[str, list[int]] = {"buckets": [], "one bucket": []}
    for step in range(args.steps):
        comps = engine.generate([q.ids for q in prompts[P * step: P * (step + 1)]], sampling_for(cfg, step))
        adv = torch.randn(len(comps), generator=torch.Generator().manual_seed(step))
        order = ["buckets", "one bucket"] if step % 2 else ["one bucket", "buckets"]
        for layout in order:
            batch.BUCKET_PASS_TOKENS = default if layout == "buckets" else 1 << 40
            mbs = batch.make_micro_batches(Samples.of_call(comps), cfg.batch.micro_batch_tokens, tok.pad_token_id,
                                           by_prompt=True)
            elapsed = timed_update(policy, mbs, adv)
            if step >= args.warmup:
                times[layout].append(elapsed)
                positions[layout].append(sum(len(r) * w for mb in mbs for r, w in mb.shared.buckets))
    batch.BUCKET_PASS_TOKENS = default
    print(f"\nthe demo's update, 1 torch thread, {args.steps - args.warmup} batches of {P} x {cfg.batch.group_size} "
          f"(after {args.warmup} warm-up), alternating layouts on the same samples and weights")
    print(f"{'layout':<12}{'update s (median)':>20}{'row positions (mean)':>24}")
    for layout in times:
        print(f"{layout:<12}{statistics.median(times[layout]):>20.4f}{statistics.mean(positions[layout]):>24.0f}")
    ratio = statistics.median(times["buckets"]) / statistics.median(times["one bucket"])
    print(f"buckets / one bucket: {ratio:.2f}x the update time")


if __name__ == "__main__":
    main()
