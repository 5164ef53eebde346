"""One sampling draw of the hf engine (`tandem.rollout.hf.draw`) against the exponential race it replaced.

    .venv/bin/python bench/bench_sampling.py [--threads 1] [--repeats 20]

For each vocabulary size (the demo's 258, Llama-2's 32,000, Qwen2's 151,936) and row count (16, 128), times one draw
of one token per row from logits at temperature 1, each returning the token and its logprob: the baseline,
torch.multinomial's own one-sample draw as the engine wrote it out before (softmax, then the argmax of probs over
Exp(1) noise from `exponential_`: a random number per row and vocabulary entry; log_softmax for the logprob), and
tandem's inverse-CDF draw (one uniform per row: log_softmax, exp, a float64 running sum, `searchsorted`). Prints
the median milliseconds of each, the ratio to the baseline, and, for scale, the decode step's LM-head product alone
at that vocabulary (rows x 896 hidden, Qwen2-0.5B's) and the machine's fp32 matmul rate.
"""
from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def exponential_race(logits, gen):
    """The engine's draw before: torch.multinomial's one-sample algorithm, written out."""
    import torch

    logp_all = torch.log_softmax(logits, dim=-1)
    probs = torch.softmax(logits, dim=-1)
    noise = torch.empty_like(probs).exponential_(generator=gen)
    tok = probs.div_(noise).argmax(-1)
    return tok, logp_all.gather(-1, tok[:, None]).squeeze(-1)


def timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    import torch

    from tandem.rollout.base import Sampling
    from tandem.rollout.hf import draw, uniforms

    torch.set_num_threads(args.threads)
    a, b = torch.randn(2048, 896), torch.randn(896, 2048)
    rate = 2 * 2048 * 896 * 2048 / timed(lambda: a @ b, 10) / 1e9
    print(f"torch {torch.__version__}, threads={args.threads}, cores={os.cpu_count()}, fp32 matmul {rate:.1f} GFLOP/s, "
          f"load average {os.getloadavg()[0]:.2f}")
    head = f"{'vocab':>7s} {'rows':>5s} {'exponential race ms':>20s} {'inverse-CDF draw ms':>20s} {'ratio':>6s} " \
           f"{'LM head ms':>11s}"
    print(head)
    print("-" * len(head))
    sampling = Sampling(temperature=1.0)
    for vocab in (258, 32000, 151936):
        for rows in (16, 128):
            logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 2
            gen = torch.Generator().manual_seed(1)
            u = uniforms([gen], 1, rows)[0]
            race = timed(functools.partial(exponential_race, logits, gen), args.repeats)
            ops = timed(functools.partial(draw, logits, sampling, u), args.repeats)
            x, w = torch.randn(rows, 896), torch.randn(vocab, 896)
            head_ms = timed(functools.partial(torch.nn.functional.linear, x, w), args.repeats)
            print(f"{vocab:7d} {rows:5d} {1e3 * race:20.3f} {1e3 * ops:20.3f} {ops / race:6.3f} {1e3 * head_ms:11.3f}")


if __name__ == "__main__":
    main()
