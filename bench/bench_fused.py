"""CPU training's fused SiLU gate and RMS norm (`tandem.train.fused`) against HF's ops, on bench_trl's micro-batches.

    .venv/bin/python bench/bench_fused.py [--workload large|small] [--rounds 15] [--threads 1]

Builds the workload's Qwen2 (bench/bench_trl.py's shapes, random weights, in memory) twice with the same weights,
fuses one (`fused.fuse`), and times a forward and backward of one micro-batch (bench_trl's `micro_rows` rows of
6 prompt tokens, as its questions are, and its completion length; loss = the logits' logsumexp summed) on each, alternating in one process for
`--rounds` rounds so both see the same drift of the machine. Prints each one's median seconds, the fused/HF ratio
of the medians, of each round and the median of those, the largest logit difference and the relative difference of a gradient (float
rounding), the thread count and the machine's fp32 matmul rate.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=["large", "small"], default="large")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from bench_trl import WORKLOADS, matmul_gflops
    from tandem.train import fused

    torch.set_num_threads(args.threads)
    w = WORKLOADS[args.workload]
    cfg = Qwen2Config(vocab_size=258, hidden_size=w.hidden, num_hidden_layers=w.layers, num_attention_heads=w.heads,
                      num_key_value_heads=w.kv_heads, intermediate_size=w.mlp, tie_word_embeddings=True)
    torch.manual_seed(0)
    models = {"hf": Qwen2ForCausalLM(cfg).train()}
    models["fused"] = Qwen2ForCausalLM(cfg).train()
    models["fused"].load_state_dict(models["hf"].state_dict())
    if fused.fuse(models["fused"]) == 0:
        raise SystemExit(f"the fused kernels are not available here: {fused.library()[1]}")
    ids = torch.randint(3, cfg.vocab_size, (w.micro_rows, 6 + w.new_tokens), generator=torch.Generator().manual_seed(0))

    def step(name: str) -> tuple[float, torch.Tensor, torch.Tensor]:
        model = models[name]
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        logits = model(input_ids=ids, use_cache=False).logits
        logits.logsumexp(-1).sum().backward()
        return time.perf_counter() - start, logits.detach(), model.model.layers[0].mlp.gate_proj.weight.grad

    (_, hf_logits, hf_grad), (_, fused_logits, fused_grad) = step("hf"), step("fused")  # warm-up, and the check
    times: dict[str, list[float]] = {"hf": [], "fused": []}
    for r in range(args.rounds):
        for name in ("hf", "fused") if r % 2 == 0 else ("fused", "hf"):
            times[name].append(step(name)[0])
    hf, fz = statistics.median(times["hf"]), statistics.median(times["fused"])
    print(f"{args.workload} micro-batch ({w.micro_rows} x {ids.shape[1]} tokens, hidden {w.hidden}, MLP {w.mlp}, "
          f"{w.layers} layers), forward and backward; threads={args.threads}, fp32 matmul rate "
          f"{matmul_gflops(args.threads):.1f} GFLOP/s, {args.rounds} rounds alternating")
    print(f"{'ops':8s} {'median s':>9s}\n{'hf':8s} {hf:9.3f}\n{'fused':8s} {fz:9.3f}")
    rounds = [a / b for a, b in zip(times["fused"], times["hf"])]
    print(f"fused / hf: {fz / hf:.3f} of the medians, {statistics.median(rounds):.3f} the median of the rounds' "
          "(by round: " + " ".join(f"{x:.2f}" for x in rounds) + ")")
    print(f"largest logit difference {(hf_logits - fused_logits).abs().max():.2e}, gate_proj gradient relative "
          f"difference {((hf_grad - fused_grad).norm() / hf_grad.norm()):.2e}")


if __name__ == "__main__":
    main()
