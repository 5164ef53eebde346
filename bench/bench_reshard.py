"""Online resharding (tandem.sync): planned point-to-point moves against all-gather-then-slice and a disk round trip.

    .venv/bin/python bench/bench_reshard.py [--hidden 512] [--layers 4] [--vocab 4096] [--repeats 5] [--bucket-mb 64]

4 gloo processes on loopback, one torch thread each, a Qwen2-shaped fp32 parameter set (fused qkv / gate_up);
the `dp4 ep2` cases start from tandem's expert parallel training layout (`ep_fsdp_layout`, transformers 5's fused
3-D experts) and must move exactly the lower bound: what each engine rank does not hold already, once.
For every case: bytes moved over the lower bound (the planner's target is exactly 1.00); the median time of the
planned reshard into preallocated tensors (as an engine's own weights are filled), through shared memory (these 4
processes share a host: the default) and over gloo p2p alone (`p2p`, the path between hosts); the naive path
(all_gather every parameter's local shards onto every rank, then slice) in time and bytes; and a disk round trip (rank 0
saves the full model with safetensors, every rank loads it and slices; the full model is assumed already on rank 0, and
the page cache is warm, both in the disk path's favour), and the round trip an engine reloading from disk pays,
`save_pretrained` on rank 0 then `from_pretrained` on every rank (`hf/time`). Times are the slowest rank's, median of
--repeats after one warm-up (the hf round trip's too). Every result is checked bit for bit.
"""
from __future__ import annotations

import argparse
import functools
import os
import socket
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the synthetic model shape the resharding tests use too

from qwen2_shape import Qwen2Shape  # noqa: E402
from tandem.sync.layout import (Mesh, ModelLayout, Spec, build_layout, local_tensor,  # noqa: E402
                                numel, replicated_layout, slices)
from tandem.sync.planner import assign_ranks, plan, renumber  # noqa: E402
from tandem.sync.reshard import Resharder  # noqa: E402

WORLD = 4


def fused_experts(moe: Qwen2Shape) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """`moe`'s parameters as transformers 5 trains them: each layer's experts fused into 3-D gate_up_proj [E, 2I, H]
    and down_proj [E, H, I] (what tandem's expert parallelism shards), the rest as they are."""
    out = {}
    for name, (shape, dtype) in moe.params().items():
        if ".experts." not in name:
            out[name] = (shape, dtype)
        elif ".experts.0." in name:  # one fused tensor per layer and kind, from expert 0's name and shape
            prefix, leaf = name.split(".experts.0.")
            out[f"{prefix}.experts.{leaf.removesuffix('.weight')}"] = ((moe.experts, *shape), dtype)
    return out


def ep_fsdp_layout(params: dict, dp: int, ep: int) -> ModelLayout:
    """tandem's expert parallel training layout on dp ranks, as `layout_from_dtensors` reads the live DTensors
    (tests/train/test_expert_parallel.py syncs from those): fused experts Shard(0) over "ep" (adjacent ranks) and
    FSDP over "edp" on the (edp, ep) mesh, i.e. placements (_StridedShard(0, sf=ep), Shard(0)); every other
    parameter FSDP Shard(0) over all dp ranks."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from tandem.sync.layout import ParamLayout, dtensor_shards

    grid, flat = torch.arange(dp).view(dp // ep, ep), torch.arange(dp).view(dp)
    return {n: ParamLayout(shape, dtype, dtensor_shards(shape, grid, [_StridedShard(0, split_factor=ep), Shard(0)])
                           if ".experts." in n else dtensor_shards(shape, flat, [Shard(0)]))
            for n, (shape, dtype) in params.items()}


def cases(dense: Qwen2Shape, moe: Qwen2Shape) -> dict[str, tuple[ModelLayout, ModelLayout]]:
    p, pm = dense.params(), moe.params()
    fused, ep = fused_experts(moe), ep_fsdp_layout(fused_experts(moe), 4, 2)
    dp2tp2 = Mesh.of(dp=2, tp=2)
    tp4, to = build_layout(p, Mesh.of(tp=4), dense.spec()), build_layout(p, dp2tp2, dense.spec())
    return {
        "dp1tp2pp2 -> dp2tp2": (build_layout(p, Mesh.of(pp=2, tp=2), dense.spec(pp=2)), to),
        "dp1tp4 -> dp2tp2": (tp4, to),  # destination numbered TP-fastest, as given
        # the same, destination ranks numbered by the planner (assign_ranks): each rank's quarter lies in its new half
        "dp1tp4 -> dp2tp2 (ranks assigned)": (tp4, renumber(to, assign_ranks(tp4, to))),
        "dp1tp2cp2 -> dp2tp2": (build_layout(p, Mesh.of(cp=2, tp=2), dense.spec()), to),
        # tandem's context parallel trains with FSDP2 over dp x cp after TP: each cp rank holds half its tp shard
        "dp1tp2cp2 (FSDP over cp) -> dp2tp2": (build_layout(p, Mesh.of(cp=2, tp=2), dense.spec(zero="dim0")), to),
        "dp1tp2ep2 -> dp2tp2 (MoE)": (build_layout(pm, Mesh.of(ep=2, tp=2), moe.spec(ep=2)),
                                      build_layout(pm, dp2tp2, moe.spec())),
        # tandem's expert parallel training (dp 4, ep 2: FSDP over 2 x EP over 2 for the fused experts) into engines
        "dp4 ep2 (fused MoE) -> 1 engine": (ep, replicated_layout(fused, [0])),
        "dp4 ep2 (fused MoE) -> 2 engines": (ep, replicated_layout(fused, [0, 1])),
        "fsdp4 -> tp2dp2": (build_layout(p, Mesh.of(dp=4), Spec(zero="dim0")), to),
        "fsdp4 -> 4 replicas (colocated)": (build_layout(p, Mesh.of(dp=4), Spec(zero="dim0")),
                                            replicated_layout(p, range(4))),
        "fsdp ranks 0,1 -> replicas 2,3": (build_layout(p, Mesh.of(dp=2), Spec(zero="dim0")),
                                           replicated_layout(p, [2, 3])),
    }


def naive(rank: int, src: ModelLayout, dst: ModelLayout, mine: dict[str, torch.Tensor]) -> tuple[dict, int]:
    """All-gather every parameter's local shards (padded to the largest) onto every rank, rebuild it, slice."""
    out, traffic = {}, 0
    for name, pl in src.items():
        sizes = [numel(tuple((0, n) for n in pl.shards[r].shape)) if r in pl.shards else 0 for r in range(WORLD)]
        most = max(sizes)
        buf = torch.zeros(most, dtype=pl.dtype)
        if rank in pl.shards:
            buf[:sizes[rank]] = mine[name].reshape(-1)
        parts = [torch.empty(most, dtype=pl.dtype) for _ in range(WORLD)]
        dist.all_gather(parts, buf)
        traffic += WORLD * (WORLD - 1) * most * pl.dtype.itemsize
        if rank in dst[name].shards:
            full = torch.empty(pl.shape, dtype=pl.dtype)
            for r, shard in pl.shards.items():
                local = parts[r][:sizes[r]].view(shard.shape)
                for piece in shard.pieces:
                    full[slices(piece.box)] = piece.view(local)
            out[name] = local_tensor(dst[name], rank, full)
    return out, traffic


def disk(rank: int, dst: ModelLayout, full: dict[str, torch.Tensor], folder: str) -> dict:
    from safetensors.torch import load_file, save_file

    path = os.path.join(folder, "model.safetensors")
    if rank == 0:
        save_file(full, path)
    dist.barrier()
    loaded = load_file(path)
    out = {n: local_tensor(pl, rank, loaded[n]) for n, pl in dst.items() if rank in pl.shards}
    del loaded
    dist.barrier()  # nobody overwrites the file while another rank still reads it
    return out


def hf_round_trip(rank: int, shape: Qwen2Shape, folder: str) -> None:
    """The disk round trip: rank 0 `save_pretrained`s a real Qwen2 of the dense shape (tied embeddings off,
    like the parameter set), every rank `from_pretrained`s it (what an engine reloading from disk pays)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path = os.path.join(folder, "hf")
    if rank == 0:
        cfg = Qwen2Config(vocab_size=shape.vocab, hidden_size=shape.hidden, num_hidden_layers=shape.layers,
                          num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                          intermediate_size=shape.intermediate, tie_word_embeddings=False)
        Qwen2ForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    dist.barrier()
    Qwen2ForCausalLM.from_pretrained(path)
    dist.barrier()


def timed(fn, repeats: int) -> tuple[float, object]:
    """Median over repeats (after a warm-up) of the slowest rank's seconds."""
    times, result = [], None
    for i in range(repeats + 1):
        dist.barrier()
        start = time.perf_counter()
        result = fn()
        took = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        if i:
            times.append(float(took))
    return statistics.median(times), result


def worker(rank: int, port: int, args: argparse.Namespace, folder: str) -> None:
    torch.set_num_threads(args.threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=300))
    dense = Qwen2Shape(vocab=args.vocab, hidden=args.hidden, layers=args.layers, heads=8, kv_heads=4,
                       intermediate=args.intermediate)
    moe = Qwen2Shape(vocab=args.vocab, hidden=args.hidden, layers=args.layers, heads=8, kv_heads=4,
                     intermediate=args.intermediate // 4, experts=4)
    t_hf, _ = timed(lambda: hf_round_trip(rank, dense, folder), args.repeats)
    rows = []
    for name, (src, dst) in cases(dense, moe).items():
        g = torch.Generator().manual_seed(0)
        full = {n: torch.randn(pl.shape, generator=g) for n, pl in src.items()}
        mine = {n: local_tensor(pl, rank, full[n]) for n, pl in src.items() if rank in pl.shards}
        want = {n: local_tensor(pl, rank, full[n]) for n, pl in dst.items() if rank in pl.shards}
        start = time.perf_counter()
        p = plan(src, dst)
        plan_s = time.perf_counter() - start
        # into preallocated tensors (`out=`), as a rollout engine's own weights are filled
        out = {n: torch.empty(shape) for n, shape in p.dst_shapes.get(rank, {}).items()}
        # one executor per transport, as a run keeps it: its first run (the setup) is the untimed warm-up
        planned = Resharder(p, rank, bucket_bytes=args.bucket_mb << 20)
        p2p_only = Resharder(p, rank, bucket_bytes=args.bucket_mb << 20, shared_memory=False)
        t_plan, got = timed(functools.partial(planned.run, mine, out=out), args.repeats)
        got = {n: t.clone() for n, t in got.items()}
        for t in out.values():  # so the p2p run's result is its own, not what the run above left there
            t.fill_(float("nan"))
        t_p2p, got_p2p = timed(functools.partial(p2p_only.run, mine, out=out), args.repeats)
        t_naive, (got_naive, naive_bytes) = timed(functools.partial(naive, rank, src, dst, mine), args.repeats)
        t_disk, got_disk = timed(functools.partial(disk, rank, dst, full, folder), args.repeats)
        ok = all(torch.equal(r[n], w) for r in (got, got_p2p, got_naive, got_disk) for n, w in want.items())
        flag = torch.tensor([int(ok)])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        model_mb = sum(t.numel() * t.element_size() for t in full.values()) / 2**20
        rows.append((name, model_mb, p.bytes_moved, p.lower_bound, plan_s, t_plan, t_p2p, t_naive, naive_bytes, t_disk,
                     bool(flag)))
    if rank == 0:
        print(f"\nresharding: {WORLD} gloo processes on loopback, torch threads={args.threads} each, fp32, "
              f"bucket {args.bucket_mb} MiB, median of {args.repeats} (slowest rank)")
        head = (f"{'case':<38} {'model':>6} {'moved':>7} {'moved/':>7} {'plan':>6} {'reshard':>8} {'p2p':>7} "
                f"{'naive':>8} {'naive/':>7} {'naive/':>7} {'disk':>8} {'disk/':>7} {'hf/':>7} {'exact':>5}")
        sub = (f"{'':<38} {'MiB':>6} {'MiB':>7} {'lower':>7} {'ms':>6} {'ms':>8} {'ms':>7} {'ms':>8} "
               f"{'time':>7} {'bytes':>7} {'ms':>8} {'time':>7} {'time':>7} {'':>5}")
        print(head)
        print(sub)
        print("-" * len(head))
        for name, mb, moved, lower, plan_s, tp, t2, tn, nb, td, ok in rows:
            ratio = moved / lower if lower else 1.0  # nothing to move and nothing moved: exact
            less = f"{nb / moved:>6.1f}x" if moved else f"{'all':>7}"  # "all": the plan moves nothing at all
            print(f"{name:<38} {mb:>6.1f} {moved / 2**20:>7.1f} {ratio:>7.2f} {plan_s * 1e3:>6.1f} {tp * 1e3:>8.1f} "
                  f"{t2 * 1e3:>7.1f} {tn * 1e3:>8.1f} {tn / tp:>6.1f}x {less} {td * 1e3:>8.1f} {td / tp:>6.1f}x "
                  f"{t_hf / tp:>6.1f}x "
                  f"{'yes' if ok else 'NO':>5}")
        print(f"hf: save_pretrained on rank 0 + from_pretrained on every rank (an engine reloading from disk) took "
              f"{t_hf * 1e3:.0f} ms; disk: raw safetensors save + load + slice, warm page cache (the harder baseline)")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--bucket-mb", type=int, default=64)
    p.add_argument("--threads", type=int, default=1, help="torch threads per process; 1 is steadiest on 2 shared cores")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-reshard-") as folder:
        os.environ["TMPDIR"] = folder
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(worker, args=(port, args, folder), nprocs=WORLD, join=True)


if __name__ == "__main__":
    main()
