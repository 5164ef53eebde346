"""LoRA on an MoE's experts where the suite does not go (each run starts Ray or gloo processes: 1-2 min on 2 cores).

    .venv/bin/python bench/moe_lora_check.py

On the zoo's tiny random Qwen3-MoE (tests/zoo_models.py: 4 experts, top 2), one torch thread per process, fp32:
  1. split: 1 trainer -> 1 in-process vLLM sampler, LoRA on attention and experts (the defaults), 3 steps: the bytes
     each sync sends (the adapter only) and the sampler's logprob gap (logprob_diff_max, bound 1e-5);
  2. 2 gloo processes against one process, the same 3 updates (tests/train/test_parallel.py's batches, lr 1e-2):
     LoRA on the experts under FSDP dp 2, and LoRA on attention alone under dp 2 x expert_parallel 2; the largest
     relative loss difference and the largest absolute adapter difference.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before `import ray`: stay on loopback
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
ROOT = Path(__file__).resolve().parents[1]
for sub in ("", "tests", "tests/train", "tests/workers", "tests/core"):
    sys.path.insert(0, str(ROOT / sub))

import torch  # noqa: E402

CASES = {"experts, fsdp dp 2": (1, dict(rank=4, alpha=8)),
         "attention, dp 2 x ep 2": (2, dict(rank=4, alpha=8, target_modules=["q_proj", "v_proj"]))}


def split_vllm(model: Path, out: Path) -> list[dict]:
    from test_placement import small_config

    from tandem.trainer import train

    train(small_config(model, out, "lora.enabled=true", "lora.rank=4", "lora.alpha=8", "optim.lr=1e-2",
                       "placement.mode=split", "run.steps=3", "run.save_every=0", "rollout.max_logprob_diff=1e-5",
                       "rollout.engine=vllm", "rollout.vllm.kv_cache_mb=16", "rollout.vllm.max_model_len=64"))
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]


def _policy(path: str, mesh=None, ep: int = 1, lora: dict | None = None):
    from tandem.config import AlgoConfig, LoraConfig, OptimConfig
    from tandem.train.policy import Policy

    torch.manual_seed(0)
    return Policy(path, "float32", False, AlgoConfig(kl_coef=0.1, router_aux_coef=0.0),
                  OptimConfig(lr=1e-2, grad_clip=0.5), 3, 1.0, 8, mesh=mesh, expert_parallel=ep,
                  lora=LoraConfig(enabled=True, **lora), seed=0)


def _train(policy, rows) -> list[float]:
    from test_parallel import _step

    from tandem.config import OldLogprobs

    losses = []
    for seeds in ([1, 2], [3]):
        minis, adv, n = _step(rows, seeds)
        policy.update(policy.prepare(minis, n), adv)
        losses += policy.last_losses
        policy.old_logprobs = OldLogprobs.CURRENT
    return losses


def _worker(rank: int, port: int, path: str, out: str) -> None:
    import torch.distributed as dist

    from test_parallel import SPLIT

    from tandem.train.parallel import build_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    res = {}
    for name, (ep, lora) in CASES.items():
        p = _policy(path, build_mesh([0, 1], 2, 1, "cpu"), ep, lora)
        res[name] = (_train(p, SPLIT[p.dp_rank]), p.full_adapter())
    if rank == 0:
        torch.save(res, Path(out) / "sharded.pt")
    dist.destroy_process_group()


def main() -> None:
    import torch.multiprocessing as mp

    import zoo_models
    from conftest import free_port

    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="moe-lora-"))
    model = zoo_models.build(work / "qwen3_moe", "qwen3_moe")
    rows = split_vllm(model, work / "split")
    mp.spawn(_worker, args=(free_port(), str(model), str(work)), nprocs=2, join=True)
    sharded = torch.load(work / "sharded.pt", weights_only=False)
    print(f"\ntorch {torch.__version__}, 1 thread per process; tiny Qwen3-MoE, 4 experts, LoRA rank 4")
    print("split trainer -> in-process vLLM sampler, LoRA on attention and experts:")
    for r in rows:
        print(f"  step {r['step']}: sync/bytes {r['sync/bytes']}, logprob_diff {r['logprob_diff']:.2g}, "
              f"logprob_diff_max {r['logprob_diff_max']:.2g}")
    print("2 gloo processes against one process, 3 updates:")
    for name, (_ep, lora) in CASES.items():
        one = _policy(str(model), lora=lora)
        losses, adapter = _train(one, None), one.full_adapter()
        got_losses, got_adapter = sharded[name]
        loss_rel = max(abs(a - b) / abs(b) for a, b in zip(got_losses, losses))
        adapter_abs = max(float((got_adapter[k] - v).abs().max()) for k, v in adapter.items())
        print(f"  LoRA on {name}: losses {loss_rel:.2g} relative, adapter {adapter_abs:.2g} absolute "
              f"({len(adapter)} adapter tensors)")


if __name__ == "__main__":
    main()
