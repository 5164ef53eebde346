"""The GPU path in one prepared script (under 10 minutes): NCCL + FSDP2, CUDA offload, vLLM sleep, memory bench.

    python bench/gpu_check.py [--skip-vllm] [--skip-memory]

Written and run on CPU machines only so far: none of the CUDA paths has been verified on a GPU yet (README, "GPU
status"). Run it on a machine with at least one NVIDIA GPU; each check prints PASS/FAIL with its figures and the
script exits non-zero if any check failed. What it checks:

  1. nccl: a torch.distributed NCCL group (one rank per visible GPU, at most 2) all-reduces, then an FSDP2-sharded
     tiny Qwen2 takes one GRPO update on CUDA and its loss matches the same update without sharding.
  2. offload: a CUDA policy offloads params, grads, optimizer state and reference to pinned host memory;
     `torch.cuda.memory_allocated` must drop by at least the bytes accounted, and after reload an update is
     bit-identical to one that never offloaded.
  3. vllm-sleep: vLLM generates, sleeps (level 1) and must free at least its weights and KV cache
     (`torch.cuda.mem_get_info`), wakes, takes new weights through tandem's sync path and generates the same.
  4. train: the real loop (`tandem.trainer.train`, local backend, embedded engine) for 3 steps on the GPU it
     finds by itself: the policy, reference and engine weights must be on CUDA, the metrics finite, a checkpoint
     written; the same run with `CUDA_VISIBLE_DEVICES=""` must stay on the CPU.
  5. memory: bench/bench_memory.py on CUDA (`torch.cuda.max_memory_allocated` per phase), GRPO peak / SFT peak.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

RESULTS: list[tuple[str, bool, str]] = []


def check(name: str):
    def wrap(fn):
        def run(*args):
            start = time.perf_counter()
            try:
                info = fn(*args) or ""
                RESULTS.append((name, True, f"{info} ({time.perf_counter() - start:.1f} s)"))
            except Exception as exc:  # report every check, whatever fails
                traceback.print_exc()
                RESULTS.append((name, False, f"{type(exc).__name__}: {exc}"))
        return run
    return wrap


def tiny(folder: Path) -> Path:
    from conftest import save_tiny_model

    return save_tiny_model(folder, hidden=64, layers=2)


def _grpo_batch(policy):
    from tandem.rollout.base import Completion
    from tandem.train.batch import make_micro_batches

    g = torch.Generator().manual_seed(0)
    comps = [Completion(torch.randint(5, 200, (6,), generator=g).tolist(), torch.randint(5, 200, (5,), generator=g).tolist(),
                        (-torch.rand(5, generator=g)).tolist(), "", "stop", i // 4) for i in range(16)]
    return [make_micro_batches(comps, torch.randn(16, generator=g), 4096, 0)]  # host tensors: the policy moves them


def _policy(model: Path, mesh=None):
    from tandem.config import AlgoConfig, OptimConfig
    from tandem.train.policy import Policy

    torch.manual_seed(0)
    return Policy(str(model), "float32", False, AlgoConfig(kl_coef=0.05), OptimConfig(lr=1e-3), 10, 1.0, 5,
                  mesh=mesh, device="cuda")


def _nccl_rank(rank: int, world: int, port: int, model: str, out: str) -> None:
    import torch.distributed as dist

    from tandem.train.parallel import build_mesh

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    t = torch.ones(4, device="cuda") * (rank + 1)
    dist.all_reduce(t)
    assert float(t[0]) == world * (world + 1) / 2
    mesh = build_mesh(list(range(world)), world, 1, "cuda")
    policy = _policy(Path(model), mesh)
    mini = _grpo_batch(policy)
    sums, _ = policy.prepare(mini)
    stats = policy.update(mini, sums)
    if rank == 0:
        Path(out).write_text(repr(stats["loss"]))
    dist.destroy_process_group()


@check("nccl")
def check_nccl(model: Path) -> str:
    import socket

    import torch.multiprocessing as mp

    world = min(2, torch.cuda.device_count())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = Path(tempfile.mkdtemp()) / "loss"
    mp.spawn(_nccl_rank, args=(world, port, str(model), str(out)), nprocs=world, join=True)
    sharded = float(out.read_text())
    plain = _policy(model)
    mini = _grpo_batch(plain)
    sums, _ = plain.prepare(mini)
    loss = plain.update(mini, sums)["loss"]
    assert abs(sharded - loss) <= 1e-5 * max(1.0, abs(loss)), (sharded, loss)
    return f"world {world}, loss sharded {sharded:.6g} vs plain {loss:.6g}"


@check("offload")
def check_offload(model: Path) -> str:
    a, b = _policy(model), _policy(model)
    for p in (a, b):
        mini = _grpo_batch(p)
        sums, _ = p.prepare(mini)
        p.update(mini, sums)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    accounted = sum(b.residency().values())
    released = b.to_host("params", "grads", "optim", "ref")
    torch.cuda.synchronize()
    dropped = before - torch.cuda.memory_allocated()
    assert sum(b.residency().values()) == 0, b.residency()
    assert dropped >= 0.9 * released, (dropped, released)
    b.to_device("params", "grads", "optim", "ref")
    for p in (a, b):
        mini = _grpo_batch(p)
        sums, _ = p.prepare(mini)
        p.update(mini, sums)
    for (n, x), (_, y) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert torch.equal(x, y), n
    return f"released {released / 2**20:.1f} MiB accounted of {accounted / 2**20:.1f}, allocator dropped {dropped / 2**20:.1f} MiB; bit-identical after reload"


@check("vllm-sleep")
def check_vllm(model: Path) -> str:
    from tandem.rollout import Sampling, make_engine

    engine = make_engine("vllm", model_path=str(model), dtype="float32", seed=0, kv_cache_bytes=256 << 20,
                         gpu_memory_utilization=0.2, enable_sleep=True, sleep_level=1, max_num_seqs=16)
    s = Sampling(n=2, temperature=0.0, max_new_tokens=8)
    first = [c.completion_ids for c in engine.generate([[5, 6, 7]], s)]
    free0 = torch.cuda.mem_get_info()[0]
    engine.sleep()
    freed = torch.cuda.mem_get_info()[0] - free0
    engine.wake()
    from transformers import AutoModelForCausalLM

    weights = AutoModelForCausalLM.from_pretrained(str(model)).state_dict()
    engine.load_weights(list(weights.items()))
    again = [c.completion_ids for c in engine.generate([[5, 6, 7]], s)]
    engine.close()
    assert freed > 200 << 20, f"sleep freed only {freed / 2**20:.0f} MiB"
    assert first == again, (first, again)
    return f"sleep freed {freed / 2**20:.0f} MiB; same greedy tokens after wake + weight sync"


@check("memory")
def check_memory() -> str:
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_memory.py")], capture_output=True, text=True,
                         timeout=300)
    print(out.stdout[-3000:], out.stderr[-2000:])
    if out.returncode:
        raise RuntimeError(f"bench_memory exited {out.returncode}")
    return out.stdout.strip().splitlines()[-1]


@check("train")
def check_train(model: Path) -> str:
    import json

    from tandem.config import load_config
    from tandem.trainer import train
    from tandem.workers import placement

    out = Path(tempfile.mkdtemp()) / "run"
    cfg = load_config(None, [
        f"model.path={model}", f"run.output_dir={out}", "run.steps=3", "run.save_every=3", "run.progress=false",
        "run.report_to=[]", "run.plots=false", "batch.prompts_per_step=4", "batch.group_size=4",
        "rollout.max_new_tokens=8", "data.max_prompt_tokens=8", "data.eval_size=8", "algo.kl_coef=0.04",
        "rewards=[{name: arithmetic_exact}]"])
    devices = {}
    build = placement.build

    def spying_build(c):  # the one worker of the local backend, to read where its tensors live
        p = build(c)
        w = p.groups[0].workers[0]
        devices.update(policy=w.policy.device.type, ref=next(w.policy.ref.parameters()).device.type,
                       engine=w.engine.device.type)
        return p

    placement.build = spying_build
    try:
        train(cfg)
    finally:
        placement.build = build
    assert set(devices.values()) == {"cuda"}, devices
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 3 and all(v == v for r in rows for v in r.values() if isinstance(v, float)), rows[-1]
    assert (out / "checkpoints" / "step-00000003").is_dir()
    cpu = subprocess.run([sys.executable, "-c", "from tandem.workers.group import local_device; print(local_device())"],
                         env=dict(os.environ, CUDA_VISIBLE_DEVICES=""), capture_output=True, text=True, cwd=ROOT)
    assert cpu.stdout.strip() == "cpu", cpu.stdout + cpu.stderr
    return f"3 steps on {devices}, loss {rows[-1].get('loss')}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--skip-memory", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device visible; run it on a GPU machine")
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} x "
          f"{torch.cuda.get_device_name(0)}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")
    os.environ.setdefault("TANDEM_CACHE", tempfile.mkdtemp())
    model = tiny(Path(tempfile.mkdtemp()) / "tiny")
    check_nccl(model)
    check_offload(model)
    check_train(model)
    if not args.skip_vllm:
        check_vllm(model)
    if not args.skip_memory:
        check_memory()
    print("\ncheck        result  detail")
    for name, ok, info in RESULTS:
        print(f"{name:<12} {'PASS' if ok else 'FAIL':<7} {info}")
    sys.exit(0 if all(ok for _, ok, _ in RESULTS) else 1)


if __name__ == "__main__":
    main()
