"""The multi-process resharding cases, run by every gloo process of one spawn; each rank writes its verdicts
(case -> "ok" or the failure) to a JSON file the tests read."""
from __future__ import annotations

import json
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the synthetic model shape, also in the children
from qwen2_shape import Qwen2Shape  # noqa: E402
from tandem.sync.layout import (Mesh, ModelLayout, Spec, build_layout, layout_from_dtensors, local_tensor,
                                mark_unchanging, replicated_layout)
from tandem.sync.planner import assign_ranks, plan, renumber
from tandem.sync.reshard import Resharder

DENSE = Qwen2Shape(vocab=96, hidden=32, layers=2, heads=4, kv_heads=2, intermediate=48)
DENSE_TP4 = Qwen2Shape(vocab=96, hidden=32, layers=2, heads=8, kv_heads=4, intermediate=48)
MOE = Qwen2Shape(vocab=96, hidden=32, layers=2, heads=4, kv_heads=2, intermediate=24, experts=4)


def full_model(layout: ModelLayout, seed: int = 0) -> dict[str, torch.Tensor]:
    """The same random full model on every rank."""
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(pl.shape, generator=g).to(pl.dtype) for n, pl in layout.items()}


def layout_cases() -> dict[str, tuple[ModelLayout, ModelLayout, dict]]:
    """name -> (source layout, destination layout, executor options) over world ranks 0..3."""
    p, p4, pm = DENSE.params(), DENSE_TP4.params(), MOE.params()
    dp2tp2 = Mesh.of(dp=2, tp=2)
    cases = {
        "dp1tp2pp2_to_dp2tp2": (build_layout(p, Mesh.of(pp=2, tp=2), DENSE.spec(pp=2)),
                                build_layout(p, dp2tp2, DENSE.spec()), {}),
        "dp1tp4_to_dp2tp2": (build_layout(p4, Mesh.of(tp=4), DENSE_TP4.spec()),
                             build_layout(p4, dp2tp2, DENSE_TP4.spec()), {}),
        "dp1tp2cp2_to_dp2tp2": (build_layout(p, Mesh.of(cp=2, tp=2), DENSE.spec()),
                                build_layout(p, dp2tp2, DENSE.spec()), {}),
        # tandem's context parallel: FSDP2 over dp x cp after TP (placement.context_parallel: 2, tensor_parallel: 2)
        "dp1tp2cp2_fsdp_to_dp2tp2": (build_layout(p, Mesh.of(cp=2, tp=2), DENSE.spec(zero="dim0")),
                                     build_layout(p, dp2tp2, DENSE.spec()), {}),
        "dp1tp2cp2_fsdp_to_replicas": (build_layout(p, Mesh.of(cp=2, tp=2), DENSE.spec(zero="dim0")),
                                       replicated_layout(p, range(4)), {}),
        "dp1tp2ep2_to_dp2tp2": (build_layout(pm, Mesh.of(ep=2, tp=2), MOE.spec(ep=2)),
                                build_layout(pm, dp2tp2, MOE.spec()), {}),
        "dp1tp4_to_dp2tp2_ranks_assigned": (build_layout(p4, Mesh.of(tp=4), DENSE_TP4.spec()),
                                            _assigned(build_layout(p4, Mesh.of(tp=4), DENSE_TP4.spec()),
                                                      build_layout(p4, dp2tp2, DENSE_TP4.spec())), {}),
        "fsdp4_to_tp2dp2": (build_layout(p, Mesh.of(dp=4), Spec(zero="dim0")),
                            build_layout(p, dp2tp2, DENSE.spec()), {}),
        "fsdp_ranks01_to_replicas_ranks23": (build_layout(p, Mesh.of(dp=2), Spec(zero="dim0")),
                                             replicated_layout(p, [2, 3]), {}),
        # ZeRO flat shards of a bf16 model into replicas, streamed through a bucket far smaller than one tensor
        "flat_zero4_bf16_to_replicas_streamed": (
            build_layout(DENSE.params(torch.bfloat16), Mesh.of(dp=4), Spec(zero="flat")),
            replicated_layout(DENSE.params(torch.bfloat16), range(4)),
            {"bucket_bytes": 1024, "stream": True}),
        # the same layouts over gloo p2p only (another host, or a GPU, takes this path)
        "dp1tp2pp2_to_dp2tp2_p2p": (build_layout(p, Mesh.of(pp=2, tp=2), DENSE.spec(pp=2)),
                                    build_layout(p, dp2tp2, DENSE.spec()),
                                    {"shared_memory": False}),
        "flat_zero4_bf16_to_replicas_streamed_p2p": (
            build_layout(DENSE.params(torch.bfloat16), Mesh.of(dp=4), Spec(zero="flat")),
            replicated_layout(DENSE.params(torch.bfloat16), range(4)),
            {"bucket_bytes": 1024, "stream": True, "shared_memory": False}),
        # sources that are strided views (the left half of tensors twice as wide) into a destination of another dtype
        "dp1tp2pp2_to_dp2tp2_strided_sources_cast": (build_layout(p, Mesh.of(pp=2, tp=2), DENSE.spec(pp=2)),
                                                     build_layout(DENSE.params(torch.float64), dp2tp2, DENSE.spec()),
                                                     {"strided": True}),
        "dp1tp2pp2_to_dp2tp2_strided_sources_cast_p2p": (
            build_layout(p, Mesh.of(pp=2, tp=2), DENSE.spec(pp=2)),
            build_layout(DENSE.params(torch.float64), dp2tp2, DENSE.spec()),
            {"strided": True, "shared_memory": False}),
        "tp2pp2_to_replicas_into_out": (build_layout(p, Mesh.of(pp=2, tp=2), DENSE.spec(pp=2)),
                                        replicated_layout(p, range(4)), {"out": True}),
    }
    return cases


def _assigned(src: ModelLayout, dst: ModelLayout) -> ModelLayout:
    return renumber(dst, assign_ranks(src, dst))


def run_layout_case(rank: int, src: ModelLayout, dst: ModelLayout, opts: dict) -> str:
    full = full_model(src)
    mine = {n: local_tensor(pl, rank, full[n]) for n, pl in src.items() if rank in pl.shards}
    if opts.get("strided"):  # each source a strided view: the left half of a tensor twice as wide
        mine = {n: torch.cat([t, torch.full_like(t, float("nan"))], dim=-1)[..., : t.shape[-1]]
                for n, t in mine.items()}
    p = plan(src, dst)
    if p.bytes_moved != p.lower_bound:
        return f"moved {p.bytes_moved} != lower bound {p.lower_bound}"
    kwargs = {"bucket_bytes": opts["bucket_bytes"]} if "bucket_bytes" in opts else {}
    kwargs["shared_memory"] = opts.get("shared_memory", True)
    if "channel" in opts:
        kwargs["channel"] = opts["channel"]
    out = None
    if opts.get("out"):
        out = {n: torch.zeros(s, dtype=dst[n].dtype) for n, s in p.dst_shapes.get(rank, {}).items()}
    resharder = Resharder(p, rank, **kwargs)
    if opts.get("stream"):
        got, batches = {}, 0
        for batch in resharder.stream(mine):
            batches += 1
            for name, t in batch:
                if name in got:
                    return f"{name} yielded twice"
                got[name] = t.clone()  # a consumer loads it and lets it go
        if rank in {r for pl in dst.values() for r in pl.shards} and batches < 2:
            return f"streaming yielded {batches} batch(es)"
    else:
        got = resharder.run(mine, out=out)
    want = {n: local_tensor(pl, rank, full[n]).to(pl.dtype) for n, pl in dst.items() if rank in pl.shards}
    mine_remote = {(m.src, m.dst) for m in p.moves if m.src != m.dst and rank in (m.src, m.dst)}
    shared = resharder.shared
    if kwargs["shared_memory"] and (shared is None or shared.pairs != mine_remote):
        return f"shared memory not used by every remote pair of this rank: {shared and shared.pairs} vs {mine_remote}"
    if not kwargs["shared_memory"] and shared is not None:
        return "shared memory set up although turned off"
    if set(got) != set(want):
        return f"tensors {sorted(set(got) ^ set(want))} missing or extra"
    bad = [n for n in want if got[n].dtype != want[n].dtype or not torch.equal(got[n], want[n])]
    if out is not None:
        bad += [n for n in want if got[n].data_ptr() != out[n].data_ptr()]
    return f"not bit-exact: {bad[:5]}" if bad else "ok"


CHANNEL_CASES = ["channel_fsdp_ranks01_to_replicas_ranks23", "channel_fsdp_ranks01_to_replicas_ranks23_p2p",
                 "channel_unchanging_sent_once", "channel_transfer_timeout"]


def run_sent_once_case(rank: int, src: ModelLayout, dst: ModelLayout, channel) -> str:
    """Three syncs of a plan whose layer-0 tensors are unchanging (`mark_unchanging`: a frozen tower): the first
    brings every tensor, the next two only the others, with their new values each time (a training step between),
    and move that many fewer bytes."""
    frozen = {n for n in src if ".layers.0." in n}
    p = plan(mark_unchanging(src, frozen), dst)
    if p.unchanging != frozen:
        return f"the plan's unchanging tensors are {sorted(p.unchanging)}, not {sorted(frozen)}"
    resharder = Resharder(p, rank, channel=channel)
    steps = [full_model(src, seed) for seed in range(3)]
    for k, full in enumerate(steps):
        full.update({n: steps[0][n] for n in frozen})  # the trainer never changes them
        mine = {n: local_tensor(pl, rank, full[n]) for n, pl in src.items() if rank in pl.shards}
        got = resharder.run(mine)
        names = {n for n, pl in dst.items() if rank in pl.shards and (k == 0 or n not in frozen)}
        if set(got) != names:
            return f"sync {k}: tensors {sorted(set(got) ^ names)[:4]} missing or extra"
        bad = [n for n in names if not torch.equal(got[n], local_tensor(dst[n], rank, full[n]))]
        if bad:
            return f"sync {k}: not bit-exact: {bad[:4]}"
        want = p.bytes_moved if k == 0 else p.without(frozen).bytes_moved
        if resharder.bytes_moved != want or (k and not 0 < want < p.bytes_moved):
            return f"sync {k}: {resharder.bytes_moved} bytes moved, not {want} (whole plan: {p.bytes_moved})"
    return "ok"


def channel_cases(rank: int, world: int, port: int) -> dict[str, str]:
    """Trainers (ranks 0, 1) to samplers (2, 3) over a WeightChannel, no default group used: shared memory and
    p2p; then a receive whose sender never sends fails within the transfer timeout, naming that sender."""
    from tandem.sync.channel import WeightChannel

    results: dict[str, str] = {}
    p = DENSE.params()
    src, dst = build_layout(p, Mesh.of(dp=2), Spec(zero="dim0")), replicated_layout(p, [2, 3])
    channel = WeightChannel(("127.0.0.1", port), rank, world, timeout_s=2.0)
    try:
        for name, shm in zip(CHANNEL_CASES, (True, False)):
            try:
                results[name] = run_layout_case(rank, src, dst, {"channel": channel, "shared_memory": shm})
            except Exception:
                results[name] = traceback.format_exc()
        try:
            results["channel_unchanging_sent_once"] = run_sent_once_case(rank, src, dst, channel)
        except Exception:
            results["channel_unchanging_sent_once"] = traceback.format_exc()
        if rank == 3:
            start = time.perf_counter()
            try:
                channel.exchange([(False, torch.zeros(1), 0, 77)])
                results["channel_transfer_timeout"] = "no timeout"
            except TimeoutError as exc:
                took = time.perf_counter() - start
                ok = "receiving from rank 0" in str(exc) and took < 10
                results["channel_transfer_timeout"] = "ok" if ok else f"{took:.1f} s: {exc}"
        else:
            results["channel_transfer_timeout"] = "ok"
    finally:
        dist.barrier()  # over the default group: rank 3's timed-out receive is over before anyone closes
        channel.close()
    return results


def dtensor_cases(rank: int) -> dict[str, str]:
    """Real FSDP2 and FSDP2 x TP parameters: read their layout, reshard to full replicas on every rank."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(30, 16)
            self.up = nn.Linear(16, 22)  # 22 rows: uneven over 4 and over 2 x 2
            self.down = nn.Linear(22, 16, bias=False)
            self.norm = nn.LayerNorm(16)

    results = {}
    for case in ("fsdp2_4", "fsdp2_x_tp_2x2", "fsdp2_x_cp_x_tp_1x2x2"):
        try:
            torch.manual_seed(0)
            model = Tiny()
            full = {n: p.detach().clone() for n, p in model.named_parameters()}
            if case == "fsdp2_4":
                fully_shard(model, mesh=init_device_mesh("cpu", (4,)))
            elif case == "fsdp2_x_tp_2x2":
                mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
                parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
                fully_shard(model, mesh=mesh["dp"])
            else:  # tandem's context parallel mesh: FSDP2 over the flattened dp x cp, TP over tp
                from tandem.train.parallel import build_mesh, fsdp_mesh

                mesh = build_mesh(list(range(4)), 1, 2, "cpu", cp=2)
                parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
                fully_shard(model, mesh=fsdp_mesh(mesh))
            named = dict(model.named_parameters())
            src = layout_from_dtensors(named)
            if case == "fsdp2_x_cp_x_tp_1x2x2":  # the planner's description of it: ZeRO over dp x cp after TP
                tp_dims = {"up.weight": 0, "up.bias": 0, "down.weight": 1}
                said = build_layout({n: (tuple(t.shape), t.dtype) for n, t in named.items()}, Mesh.of(cp=2, tp=2),
                                    {n: Spec(tp_dim=tp_dims.get(n), zero="dim0") for n in named}.__getitem__)
                wrong = [(n, r) for n in full for r in range(4)  # every rank's, so all agree on skipping
                         if not torch.equal(local_tensor(said[n], r, full[n]), local_tensor(src[n], r, full[n]))]
                if wrong:
                    results[case] = f"build_layout's cp x tp layout is not the live one: {wrong}"
                    continue
            dst = replicated_layout({n: (tuple(t.shape), t.dtype) for n, t in named.items()}, range(4))
            got = Resharder(plan(src, dst), rank).run(named)  # every rank takes part before any check can fail
            bad = [n for n in full if not torch.equal(got[n], full[n])]
            # the layout read agrees with the live local shards
            bad += [f"{n} (layout)" for n, t in named.items()
                    if not torch.equal(t.to_local(), local_tensor(src[n], rank, full[n]))]
            results[case] = f"not bit-exact: {bad}" if bad else "ok"
        except Exception:
            results[case] = traceback.format_exc()
    return results


def worker(rank: int, world: int, port: int, out_dir: str, channel_port: int) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    results: dict[str, str] = {}
    for name, (src, dst, opts) in layout_cases().items():
        start = time.perf_counter()
        try:
            results[name] = run_layout_case(rank, src, dst, opts)
        except Exception:
            results[name] = traceback.format_exc()
        results[name + ":seconds"] = f"{time.perf_counter() - start:.3f}"
    results.update(dtensor_cases(rank))
    results.update(channel_cases(rank, world, channel_port))
    dist.barrier()
    dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results, indent=1))
