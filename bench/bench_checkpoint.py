"""What checkpoint checksums cost: a save with and without them, in the same run, and the check at resume.

    .venv/bin/python bench/bench_checkpoint.py [--hidden 1024] [--layers 8] [--vocab 32768] [--rounds 5]

A random Qwen2 (fp32, tied embeddings; the defaults give ~124 M parameters) and an AdamW state after one step (its
two moments: twice the weights) are built here, no download. Each round saves the same checkpoint twice through
`tandem.run.checkpoint.save`, as the trainer does (`save_pretrained` + `torch.save` of the optimizer, RNG and trainer
state, fsync of every file, rename, the previous checkpoint pruned), once with its checksum pass replaced by
nothing (the save before checksums) and once as it is, in alternating order. The table gives the median of each, their
ratio, and the checksum pass timed inside each save (`write_checksums`: every file read back from the page cache and
hashed): that is the cost itself, where the saves' own times vary by more than it (fsync, a shared disk). Then the
resume check (`checkpoint.problems`, which reads every byte against checksums.json) on the saved checkpoint, with its
files in the page cache (a resume right after the save) and evicted from it (posix_fadvise DONTNEED: a resume
read from disk), beside the same check on the checkpoint saved without checksums (headers and sizes only); and
each hash's rate over the same files from the page cache. One torch thread; the checksums hash one file per
thread, up to `checkpoint.HASH_THREADS` (printed). Disk figures are this machine's disk: compare ratios elsewhere.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GB = 1e9


def build(hidden: int, layers: int, vocab: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                      num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
                      num_key_value_heads=max(1, hidden // 256), tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    return model, opt.state_dict()


def evict(folder: Path) -> None:
    """Drop the folder's (clean, fsynced) pages from the page cache, so the next read comes from the disk."""
    for f in folder.iterdir():
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dir", default=None, help="where to write (default: a temporary folder under /tmp)")
    args = p.parse_args()
    torch.set_num_threads(1)
    from transformers.utils import logging as hf_logging

    from tandem.run import checkpoint

    hf_logging.disable_progress_bar()
    sums: list[float] = []
    write_checksums = checkpoint.write_checksums

    def timed_checksums(folder, *a, **k):  # the checksum pass inside each save, timed on its own
        start = time.perf_counter()
        try:
            return write_checksums(folder, *a, **k)
        finally:
            sums.append(time.perf_counter() - start)

    def no_checksums(folder, *a, **k):  # the save as it was before checksums
        return {}

    model, opt_state = build(args.hidden, args.layers, args.vocab)
    params = sum(t.numel() for t in model.parameters())

    def write_model(folder: str) -> None:
        model.save_pretrained(folder, state_dict=model.state_dict(), safe_serialization=True)
        torch.save(opt_state, Path(folder) / "optimizer.pt")

    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-checkpoint-") as tmp:
        roots = {False: Path(tmp) / "without", True: Path(tmp) / "with"}
        times: dict[bool, list[float]] = {False: [], True: []}
        for r in range(args.rounds + 1):  # round 0 warms up (imports, first allocations) and is not timed
            for with_sums in ((False, True) if r % 2 else (True, False)):
                checkpoint.write_checksums = timed_checksums if with_sums else no_checksums
                t = timed(functools.partial(checkpoint.save, roots[with_sums], r + 1, write_model,
                                            {"step": r + 1, "data": {}}, keep=1))
                if r:
                    times[with_sums].append(t)
                elif sums:
                    sums.clear()
        folder, plain = checkpoint.latest(roots[True]), checkpoint.latest(roots[False])
        files = sorted(f.name for f in folder.iterdir())
        size = sum((folder / f).stat().st_size for f in files)
        assert checkpoint.problems(folder) == [] and checkpoint.unverified(folder) is None
        algorithm = json.loads((folder / checkpoint.CHECKSUMS).read_text())["algorithm"]

        verify_hot = statistics.median(timed(lambda: checkpoint.problems(folder)) for _ in range(3))
        verify_cold = []
        for _ in range(2):
            evict(folder)
            verify_cold.append(timed(lambda: checkpoint.problems(folder)))
        old_check = statistics.median(timed(lambda: checkpoint.problems(plain)) for _ in range(3))
        names = [f for f in files if f != checkpoint.CHECKSUMS]
        rates = {}
        for alg in ("xxh3_128", "sha256", "blake2b"):
            checkpoint._digests(folder, names, alg)
            digests = functools.partial(checkpoint._digests, folder, names, alg)
            rates[alg] = size / min(timed(digests) for _ in range(2)) / GB

    without, with_ = statistics.median(times[False]), statistics.median(times[True])
    threads = min(checkpoint.HASH_THREADS, len(names))
    print(f"checkpoint: {params / 1e6:.1f} M parameters fp32, {len(files)} files, {size / GB:.2f} GB "
          f"({', '.join(files)})")
    print(f"{os.cpu_count()} cores, torch threads 1, hash threads {threads} (one per file), checksum {algorithm}, "
          f"median of {args.rounds} rounds")
    print()
    rows = [
        ("save without checksums", f"{without:.2f} s",
         f"{size / without / GB:.2f} GB/s (rounds: {min(times[False]):.2f}-{max(times[False]):.2f} s)"),
        ("save with checksums", f"{with_:.2f} s",
         f"{size / with_ / GB:.2f} GB/s (rounds: {min(times[True]):.2f}-{max(times[True]):.2f} s)"),
        ("ratio with / without", f"{with_ / without:.3f}", f"{with_ - without:+.2f} s per save"),
        ("checksum pass inside the save", f"{statistics.median(sums):.2f} s",
         f"{size / statistics.median(sums) / GB:.2f} GB/s, {statistics.median(sums) / without:.1%} of the save"),
        ("resume check, no checksums (headers, sizes)", f"{old_check:.2f} s", ""),
        ("resume check with checksums, page cache", f"{verify_hot:.2f} s", f"{size / verify_hot / GB:.2f} GB/s"),
        ("resume check with checksums, from disk", f"{statistics.median(verify_cold):.2f} s",
         f"{size / statistics.median(verify_cold) / GB:.2f} GB/s"),
    ] + [(f"hash rate {alg}, page cache", f"{rate:.2f} GB/s", "") for alg, rate in rates.items()]
    width = max(len(r[0]) for r in rows)
    print(f"{'':{width}}  {'time':>10}  rate")
    for name, t, rate in rows:
        print(f"{name:{width}}  {t:>10}  {rate}")


if __name__ == "__main__":
    main()
