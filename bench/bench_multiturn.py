"""Multi-turn rollout throughput: conversations batched across rows at every turn vs one conversation at a time.

    .venv/bin/python bench/bench_multiturn.py [--engines hf vllm] [--prompts 32] [--n 4] [--turns 3] [--tokens 24]

A random Qwen2 (hidden 256, 4 layers, vocab 32768; no download) holds --prompts x --n conversations of --turns
sampled turns of --tokens tokens each (EOS ignored, so every row does the same work), an environment appending a
fixed observation after each turn but the last. Batched: `tandem.rollout.multiturn.converse` over all
conversations (vLLM: one continuous batch, each conversation's next turn queued as its last one ends; hf: each turn
one engine call for every row still going, which vLLM is also timed with as "turn by turn"). One at a time: the same
function called per conversation, as a loop over rows would. Prints sampled tokens per second for each and the
ratio batched / one at a time. 1 torch thread; the machine's fp32 matmul rate at one thread is printed, so figures
of other machines compare as ratios only.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


class FixedObservation:
    """Appends the same text after every turn until `turns` turns are done."""

    stop: tuple[str, ...] = ()

    def __init__(self, turns: int, text: str):
        self.turns, self.text, self.seen = turns, text, 0

    def reset(self, prompt: str) -> str:
        return ""

    def step(self, turn_text: str):
        from tandem.rollout.tools import StepResult

        self.seen += 1
        done = self.seen >= self.turns
        return StepResult("" if done else self.text, None, done, None if done else "fixed")


class TurnByTurn:
    """An engine seen through `generate` only: the multi-turn loop then batches turn by turn (every conversation's
    turn t before any turn t + 1), as it does for engines without continuous batching."""

    def __init__(self, engine):
        self.generate = engine.generate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", nargs="+", default=["hf", "vllm"], choices=["hf", "vllm"])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=24, help="sampled tokens per turn")
    args = ap.parse_args()
    import torch

    from bench_memory import build_model
    from bench_trl import matmul_gflops

    from tandem.modeling import load_tokenizer
    from tandem.rollout import make_engine
    from tandem.rollout.base import Sampling
    from tandem.rollout.multiturn import TurnLimits, converse

    torch.set_num_threads(1)
    print(f"fp32 matmul rate at 1 thread: {matmul_gflops(1):.1f} GFLOP/s; 1 torch thread")
    limits = TurnLimits(args.turns, args.turns * (args.tokens + 16))
    sampling = Sampling(n=args.n, temperature=1.0, max_new_tokens=args.tokens, ignore_eos=True, seed=0)
    rows = []
    with tempfile.TemporaryDirectory(prefix="tandem-bench-mt-") as tmp:
        model = build_model(Path(tmp) / "model", 256, 4, 32768)
        tok = load_tokenizer(model)
        text = " ".join("12" for _ in range(4))  # a few tokens of tool output
        make_env = lambda: FixedObservation(args.turns, text)  # noqa: E731
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(3, 250, (12,), generator=g).tolist() for _ in range(args.prompts)]
        for name in args.engines:
            kwargs = dict(model_path=str(model), seed=0)
            if name == "vllm":
                kwargs.update(max_model_len=256, kv_cache_bytes=256 << 20, max_num_seqs=args.prompts * args.n)
            engine = make_engine(name, **kwargs)
            converse(engine, tok, prompts[:2], replace(sampling, n=1), make_env, limits)  # warm-up
            t0 = time.perf_counter()
            batched = converse(engine, tok, prompts, sampling, make_env, limits)
            t_batched = time.perf_counter() - t0
            synchronous = t_batched
            if hasattr(engine, "generate_continuous"):  # the same conversations, turn by turn as other engines run
                t0 = time.perf_counter()
                converse(TurnByTurn(engine), tok, prompts, sampling, make_env, limits)
                synchronous = time.perf_counter() - t0
            t0 = time.perf_counter()
            single = [c for i, p in enumerate(prompts) for k in range(args.n)
                      for c in converse(engine, tok, [p], replace(sampling, n=1, seed=i * args.n + k), make_env,
                                        limits)]
            t_single = time.perf_counter() - t0
            engine.close()
            tokens = sum(c.sampled_tokens for c in batched)
            assert tokens == sum(c.sampled_tokens for c in single)
            rows.append((name, tokens / t_batched, tokens / synchronous, tokens / t_single))
    print(f"\n{args.prompts} prompts x {args.n} conversations, {args.turns} turns of {args.tokens} sampled tokens, "
          f"observations between turns")
    print(f"{'engine':8}{'batched tok/s':>16}{'turn by turn tok/s':>20}{'one at a time tok/s':>22}"
          f"{'batched / one at a time':>25}")
    for name, b, t, s in rows:
        print(f"{name:8}{b:>16.0f}{t:>20.0f}{s:>22.0f}{b / s:>25.2f}")


if __name__ == "__main__":
    main()
