"""CPU training's own ops (`tandem.train.fused`: fused SiLU gate and RMS norm, grouped-query attention) against HF's.

    .venv/bin/python bench/bench_fused.py [--workload large|small] [--rounds 15] [--threads 1]

Builds the workload's Qwen2 (bench/bench_trl.py's shapes, random weights, in memory) twice with the same weights,
fuses one (`fused.fuse`), and times a forward and backward of one micro-batch as tandem's trainer runs it: bench_trl's
`micro_rows` rows of its completion length, in groups of its group size on prompts of 7 tokens, laid out prompt-once
(`collate(..., share_prompts=True)`, `token_logprobs`; loss = the completion tokens' logprobs summed). Three variants
in turn for `--rounds` rounds, so all see the same drift of the machine: `hf` (HF's ops and SDPA attention), `fused`
(the fused ops, HF's attention) and `fused+grouped` (the fused ops and `fused.group_attention`, as the trainer runs
on CPU). Prints each one's median seconds, its ratio to `hf` (of the medians, and the median of the rounds'), the
largest logprob difference and the relative difference of a gradient against `hf` (float rounding), the thread
count and the machine's fp32 matmul rate.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

PROMPT_TOKENS = 7  # bench_trl's questions are 6-8 tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=["large", "small"], default="large")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from bench_trl import WORKLOADS, matmul_gflops
    from tandem.rollout.base import Completion
    from tandem.train import fused
    from tandem.train.batch import collate
    from tandem.train.policy import token_logprobs

    torch.set_num_threads(args.threads)
    w = WORKLOADS[args.workload]
    cfg = dict(vocab_size=258, hidden_size=w.hidden, num_hidden_layers=w.layers, num_attention_heads=w.heads,
               num_key_value_heads=w.kv_heads, intermediate_size=w.mlp, tie_word_embeddings=True,
               attn_implementation="sdpa")
    torch.manual_seed(0)
    hf = Qwen2ForCausalLM(Qwen2Config(**cfg)).train()
    own = Qwen2ForCausalLM(Qwen2Config(**cfg)).train()  # its own config: the attention is set per model
    own.load_state_dict(hf.state_dict())
    if fused.fuse(own) == 0:
        raise SystemExit(f"the fused kernels are not available here: {fused.library()[1]}")
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(w.micro_rows):
        if i % w.generations == 0:
            prompt = torch.randint(3, 258, (PROMPT_TOKENS,), generator=g).tolist()
        done = torch.randint(3, 258, (w.new_tokens,), generator=g).tolist()
        rows.append(Completion(prompt, done, [0.0] * w.new_tokens, "", "length", i // w.generations))
    mb = collate(rows, list(range(len(rows))), 0, share_prompts=True)
    variants = {"hf": (hf, "sdpa"), "fused": (own, "sdpa"), "fused+grouped": (own, fused.GROUPED_SDPA)}

    def step(name: str) -> tuple[float, torch.Tensor, torch.Tensor]:
        model, attention = variants[name]
        model.config._attn_implementation = attention
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        logp, _ = token_logprobs(model, mb, 1.0, share_prompts=True)
        (logp * mb.mask).sum().backward()
        return time.perf_counter() - start, logp.detach(), model.model.layers[0].self_attn.k_proj.weight.grad

    checks = {name: step(name) for name in variants}  # warm-up, and the check
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(args.rounds):
        for name in names[r % 3:] + names[:r % 3]:
            times[name].append(step(name)[0])
    print(f"{args.workload} micro-batch ({w.micro_rows} rows x {w.new_tokens} completion tokens on "
          f"{w.micro_rows // w.generations} prompts of {PROMPT_TOKENS}, prompt-once; hidden {w.hidden}, "
          f"{w.heads}/{w.kv_heads} heads, MLP {w.mlp}, {w.layers} layers), forward and backward; "
          f"threads={args.threads}, fp32 matmul rate {matmul_gflops(args.threads):.1f} GFLOP/s, {args.rounds} rounds "
          "in turn")
    base = statistics.median(times["hf"])
    print(f"{'variant':14s} {'median s':>9s} {'/ hf':>6s} {'rounds / hf':>11s}  by round / hf")
    _, hf_logp, hf_grad = checks["hf"]
    for name in variants:
        rounds = [a / b for a, b in zip(times[name], times["hf"])]
        print(f"{name:14s} {statistics.median(times[name]):9.3f} {statistics.median(times[name]) / base:6.3f} "
              f"{statistics.median(rounds):11.3f}  " + " ".join(f"{x:.2f}" for x in rounds))
    for name in list(variants)[1:]:
        _, logp, grad = checks[name]
        print(f"{name}: largest logprob difference {(hf_logp - logp).abs().max():.2e}, k_proj gradient relative "
              f"difference {((hf_grad - grad).norm() / hf_grad.norm()):.2e}")


if __name__ == "__main__":
    main()
