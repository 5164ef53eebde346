"""Per-worker memory of a long sequence's update under context parallel 1, 2 and 4, and the longest that fits a cap.

    .venv/bin/python bench/bench_context_parallel.py [--cp 1 2 4] [--lengths 1024 2048 4096] [--cap-mb 512]
        [--quick]

For each context-parallel degree N, N local processes (gloo) form a dp 1 x cp N mesh over a random Qwen2 of
bench/bench_trl.py's `small` shape (hidden 256, 4 layers, 4 heads, 2 KV heads, MLP 512: under cp 4 each worker's one
query head reads a KV head copied to it), and the policy (`tandem.train.policy.Policy`, FSDP2 over the cp workers,
the Ulysses attention) updates once on one packed micro-batch holding one sequence of each length in turn (a 32-token
prompt and the rest completion; no KL, one on-policy update: the policy's forward, the loss, backward, the AdamW
step). Each worker's peak tensor bytes of that update are measured by bench/bench_memory.py's meter (its weights,
gradients and AdamW state shard at the start, plus the peak of what the update allocates: its activations, FSDP's
gathered weights, the all-to-alls' buffers); the table shows the most of any worker, the part the update allocates
(`activations`), its ratio to one worker's at the same length (about 1/N expected) and, per N, the longest of the
lengths tried whose peak stays within `--cap-mb`: the longest sequence a worker trains under that cap, to the grid
of `--lengths`.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_memory import MB, Meter  # noqa: E402  the peak-memory meter, shared
from bench_trl import WORKLOADS, Workload, build_model  # noqa: E402  the model builder, shared

PROMPT = 32  # tokens of each sequence's prompt


def one_sequence(length: int, vocab: int, seed: int = 0):
    """A step of one completion: a PROMPT-token prompt and `length - PROMPT` completion tokens (ids 2.., seeded)."""
    from tandem.samples import Completion, Samples

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab, (length,), generator=g).tolist()
    n = length - PROMPT
    return Samples.of_call([Completion(ids[:PROMPT], ids[PROMPT:], [0.0] * n, "", "length", 0)])


def measure(rank: int, cp: int, port: int, model: str, lengths: list[int], out: str) -> None:
    """One worker of a dp 1 x cp `cp` group: each length's update, metered; rank 0's process writes nothing more than
    the others (each writes its own figures)."""
    import torch.distributed as dist

    from tandem.config import AlgoConfig, OldLogprobs, OptimConfig
    from tandem.train.batch import make_micro_batches
    from tandem.train.policy import Policy
    from tandem.util import residency

    torch.set_num_threads(1)
    mesh = None
    if cp > 1:
        from tandem.train.parallel import build_mesh

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=cp)
        mesh = build_mesh(list(range(cp)), 1, 1, "cpu", cp=cp)
    policy = Policy(model, "float32", False, AlgoConfig(kl_coef=0.0), OptimConfig(lr=1e-5), len(lengths) + 1, 1.0,
                    max(lengths), mesh=mesh, old_logprobs=OldLogprobs.CURRENT)
    vocab = policy.model.config.vocab_size
    tensors = lambda: [t for g in ("params", "grads", "optim") for t in policy._tensors(g)]  # noqa: E731
    rows = []
    for length in lengths:
        mbs = make_micro_batches(one_sequence(length, vocab), length, 0, packed=True)
        step = policy.prepare([mbs], 1)
        resident = residency.storage_bytes(tensors(), policy.device)
        meter = Meter(policy.device, tensors)
        with meter.phase("update"):
            policy.update(step, torch.ones(1))
        rows.append({"length": length, "peak": meter.rows["update"], "activations": meter.rows["update"] - resident})
    Path(out).with_suffix(f".rank{rank}.json").write_text(json.dumps(rows))
    if mesh is not None:
        dist.barrier()
        dist.destroy_process_group()


def run(cp: int, model: Path, lengths: list[int], work: Path) -> list[dict]:
    """The `cp` workers' figures per length: the most of any worker."""
    import torch.multiprocessing as mp

    from tandem.util.net import free_address

    out = work / f"cp{cp}"
    mp.spawn(measure, args=(cp, free_address()[1], str(model), lengths, str(out)), nprocs=cp, join=True)
    ranks = [json.loads(out.with_suffix(f".rank{r}.json").read_text()) for r in range(cp)]
    return [{k: max(rank[i][k] for rank in ranks) if k != "length" else lengths[i] for k in ranks[0][i]}
            for i in range(len(lengths))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4], help="context-parallel degrees (1 first)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096], help="sequence lengths, tokens")
    ap.add_argument("--cap-mb", type=float, default=512.0, help="the per-worker memory cap, MB")
    ap.add_argument("--quick", action="store_true", help="a tiny model, cp 1 and 2, two short lengths: checks the "
                    "bench runs")
    args = ap.parse_args()
    if args.quick:
        args.cp, args.lengths = [1, 2], [128, 256]
    if args.cp[0] != 1:
        ap.error("--cp: start with 1, the baseline the ratios are against")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    shape = Workload("quick", 1, 1, 1, 64, 2, 4, 2, 128, ignore_eos=False, micro_rows=1) if args.quick \
        else WORKLOADS["small"]
    with tempfile.TemporaryDirectory(prefix="tandem-cp-") as tmp:
        work = Path(tmp)
        params = build_model(work / "model", shape)
        results = {cp: run(cp, work / "model", args.lengths, work) for cp in args.cp}
    print(f"torch {torch.__version__}, gloo, {os.cpu_count()} cores, 1 torch thread per worker; model: random Qwen2 "
          f"hidden {shape.hidden}, {shape.layers} layers, {shape.heads} heads, {shape.kv_heads} KV heads, MLP "
          f"{shape.mlp} ({params / 1e6:.2f} M parameters); one sequence per update ({PROMPT}-token prompt), fp32")
    print(f"\n{'cp':>3}{'length':>8}{'peak MB':>10}{'activations MB':>16}{'x cp 1':>8}")
    for cp, rows in results.items():
        for row, base in zip(rows, results[1]):
            print(f"{cp:>3}{row['length']:>8}{row['peak'] / MB:>10.1f}{row['activations'] / MB:>16.1f}"
                  f"{row['activations'] / base['activations']:>8.2f}")
    for cp, rows in results.items():
        fits = [r["length"] for r in rows if r["peak"] <= args.cap_mb * MB]
        longest = f"{max(fits)} tokens" if fits else f"none of {args.lengths}"
        print(f"cp {cp}: the longest sequence within {args.cap_mb:g} MB per worker: {longest}")


if __name__ == "__main__":
    main()
