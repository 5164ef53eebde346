"""Training placed on Ray workers: colocated FSDP/TP trainers match one process, split + async sampling keeps its
staleness bound and learns, and a worker killed mid-run stops the run by name with the last checkpoint intact."""
from __future__ import annotations

import functools
import json
import os
import signal
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before `import ray`: stay on loopback
os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # no ~/.ray/auth_token
pytest.importorskip("ray")


from tandem.run import checkpoint  # noqa: E402
from tandem.run.metric_names import without_machine  # noqa: E402
from tandem.config import load_config  # noqa: E402
from tandem.rollout import Completion, Samples  # noqa: E402
from tandem.trainer import train  # noqa: E402
from tandem.workers.group import WorkerError  # noqa: E402
from tandem.workers.hybrid import HybridWorker  # noqa: E402
from ray_workers import ray_session, start_group  # noqa: E402
from tandem.workers.train import TrainWorker  # noqa: E402

BOUNDED = dict(pg_timeout_s=120, setup_timeout_s=180)


@pytest.fixture(scope="module")
def session():
    folder = tempfile.mkdtemp(prefix="tandem-ray-")  # short: Ray's socket paths live below it
    with ray_session(num_cpus=4, temp_dir=folder, log_to_driver=False, object_store_memory=100 << 20):
        yield


@pytest.fixture(scope="module")
def demo_path() -> Path:
    from tandem.demo import demo_model

    return demo_model()


def small_config(model: Path, out: Path, *extra: str):
    return load_config(None, [
        f"model.path={model}", f"run.output_dir={out}", "run.steps=4", "run.save_every=2", "run.progress=false",
        "run.report_to=[]", "run.plots=false", "batch.prompts_per_step=4", "batch.group_size=4",
        "rollout.max_new_tokens=4", "data.max_prompt_tokens=8", "batch.micro_batch_tokens=64", "optim.lr=1e-3",
        "data.eval_size=8", "run.seed=3", "reward_pool.workers=0", "placement.backend=ray", *extra])


def fixed_completions(n_groups: int = 4, group: int = 4, seed: int = 0) -> tuple[list[Completion], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    comps = []
    for i in range(n_groups * group):
        p = torch.randint(5, 200, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
        c = torch.randint(5, 200, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g).tolist()
        lp = (-torch.rand(len(c), generator=g) * 5).tolist()
        comps.append(Completion(p, c, lp, "", "stop", i // group))
    return comps, torch.randn(len(comps), generator=g)


def train_steps(group_call, steps: int = 3) -> tuple[list[float], dict[str, torch.Tensor]]:
    comps, adv = fixed_completions()
    losses = []
    for _ in range(steps):
        group_call("prepare", Samples.of_call(comps))
        losses.append(group_call("train", adv)["loss"])
    return losses, group_call("full_weights")


class _Probe(TrainWorker):
    def full_weights(self) -> dict[str, torch.Tensor]:
        return self.policy.full_state_dict()


def test_fsdp_trainers_match_one_process(session, tiny_model, tmp_path):
    """The same completions and advantages, 3 updates (KL on, 2 mini-batches: the off-policy path): 2 workers
    (FSDP dp=2) give the loss and weights of one process. Rows are split unevenly (token-balanced), so the ranks'
    micro-batch counts differ and the dummy passes run. (dp=2 x tp=2 against one process: the policy's own test,
    tests/train/test_parallel.py, which needs no Ray; 4 actors on 2 cores cost this suite half a minute.)"""
    # the completions' sampler logprobs are made up: the sampler-vs-trainer check would (rightly) stop them
    extra = ["algo.kl_coef=0.05", "batch.mini_batches=2", "batch.micro_batch_tokens=24",
             "rollout.max_logprob_diff=null"]
    one = _Probe(small_config(tiny_model, tmp_path / "one", *extra))
    ref_losses, ref_weights = train_steps(lambda m, *a: getattr(one, m)(*a))
    for workers, tp in ((2, 1),):
        cfg = small_config(tiny_model, tmp_path / f"w{workers}", *extra, f"placement.workers={workers}",
                           f"placement.tensor_parallel={tp}")
        group = start_group("trainers", functools.partial(_Probe, cfg), workers, **BOUNDED)
        try:
            losses, weights = train_steps(lambda m, *a, group=group: group.call(m, *a)[0])
        finally:
            group.shutdown()
        # fp32 sums in another order: losses agree to ~1e-7; Adam can turn that into ~1e-6 on tiny-gradient weights
        assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-7), (workers, tp)
        assert weights.keys() == ref_weights.keys()
        for name, w in ref_weights.items():
            torch.testing.assert_close(weights[name], w, rtol=1e-5, atol=2e-6, msg=f"{workers}x{tp}: {name}")


class _HybridProbe(HybridWorker):
    def full_weights(self) -> dict[str, torch.Tensor]:
        return self.policy.full_state_dict()

    def engine_weights(self) -> dict[str, torch.Tensor]:
        return {n: t.clone() for n, t in self.engine.weights().items()}


def test_colocated_sync_fills_every_engine_with_the_full_policy(session, tiny_model, tmp_path):
    """After FSDP updates on 2 colocated workers, the planned in-group reshard writes each worker's engine weights
    in place (shared memory between the two actors) and they equal the gathered policy, bit for bit."""
    # the completions' logprobs are made up: the sampler-vs-trainer check would stop them
    cfg = small_config(tiny_model, tmp_path / "w2", "placement.workers=2", "rollout.max_logprob_diff=null")
    group = start_group("hybrid", functools.partial(_HybridProbe, cfg), 2, **BOUNDED)
    try:
        _, full = train_steps(lambda m, *a: group.call(m, *a)[0], steps=2)
        before = group.call("engine_weights")
        stats = group.call("sync_weights", 2)
        engines = group.call("engine_weights")
    finally:
        group.shutdown()
    assert all(s["bytes"] > 0 for s in stats)
    for rank, weights in enumerate(engines):
        assert weights.keys() <= full.keys() and len(weights) > 0
        for name, w in weights.items():
            assert torch.equal(w, full[name]), (rank, name)
        assert all(not torch.equal(before[rank][n], w) for n, w in weights.items())  # every tensor was rewritten


def _actor_pids_by_group(monkeypatch) -> dict[str, list[int]]:
    """Filled when the run's workers are built: each group's actor processes, in rank order."""
    import ray

    from tandem.workers import placement

    pids: dict[str, list[int]] = {}
    build = placement.build

    def build_and_record(cfg, model):
        built = build(cfg, model)
        for g in built.groups:
            pids[g.name] = ray.get([a.__ray_call__.remote(lambda _: os.getpid()) for a in g.actors])
        return built

    monkeypatch.setattr(placement, "build", build_and_record)
    return pids


def _kill_after_checkpoint(root: Path, victim) -> threading.Thread:
    """Once a checkpoint is published, SIGKILL the process `victim()` names (in a background thread)."""
    def run():
        deadline = time.monotonic() + 300
        while checkpoint.latest(root / "checkpoints") is None and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(victim(), signal.SIGKILL)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _assert_intact(root: Path, step: int) -> None:
    from safetensors.torch import load_file

    last = checkpoint.latest(root / "checkpoints")
    assert last is not None and last.name == f"step-{step:08d}"
    assert json.loads((last / "trainer_state.json").read_text())["step"] == step
    assert load_file(str(last / "model.safetensors"))


def _train_until_killed(cfg, root: Path, monkeypatch, group: str, rank: int, error: str) -> None:
    """Train until a checkpoint exists, SIGKILL worker `rank` of `group` (found by asking each actor: process ids
    are not in rank order), and expect a prompt stop naming it, with the last checkpoint intact."""
    pids = _actor_pids_by_group(monkeypatch)
    killer = _kill_after_checkpoint(root, lambda: pids[group][rank])
    start = time.monotonic()
    with pytest.raises(WorkerError, match=error):
        train(cfg)
    assert time.monotonic() - start < 240
    killer.join(1)
    last = checkpoint.latest(root / "checkpoints")
    _assert_intact(root, int(last.name.split("-")[1]))


def test_killed_colocated_worker_stops_the_run_by_name(session, tiny_model, tmp_path, monkeypatch):
    cfg = small_config(tiny_model, tmp_path, "run.steps=200", "run.keep_checkpoints=1", "placement.workers=2")
    _train_until_killed(cfg, tmp_path, monkeypatch, "hybrid", 1, r"worker \d/2 of 'hybrid' died in \w+")


def test_killed_sampler_stops_the_run_by_name(session, tiny_model, tmp_path, monkeypatch):
    cfg = small_config(tiny_model, tmp_path, "run.steps=200", "run.keep_checkpoints=1", "placement.mode=split",
                       "placement.rollout_workers=2", "placement.schedule=async")
    _train_until_killed(cfg, tmp_path, monkeypatch, "samplers", 1, r"worker \d/2 of 'samplers' died in \w+")


@pytest.mark.parametrize("schedule", ["sync", "async"])
def test_killed_trainer_stops_a_split_run_by_name(session, tiny_model, tmp_path, schedule, monkeypatch):
    """The samplers may be waiting for weights the dead trainer will never send: the run still stops promptly,
    naming the trainer."""
    cfg = small_config(tiny_model, tmp_path, "run.steps=200", "run.keep_checkpoints=1", "placement.mode=split",
                       f"placement.schedule={schedule}")
    _train_until_killed(cfg, tmp_path, monkeypatch, "trainers", 0, r"worker 0/1 of 'trainers' died in \w+")


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def split_demo_config(demo_path: Path, out: Path, steps: int, samplers: int, schedule: str):
    """The demo on 1 trainer and `samplers` Ray samplers under `schedule`, one version of staleness allowed."""
    from tandem.demo import DEMO_DEFAULTS

    return load_config(None, [
        f"model.path={demo_path}", f"run.output_dir={out}", f"run.steps={steps}", "run.eval_every=0",
        "run.save_every=0", "run.progress=false", "run.plots=false", "run.report_to=[]", "data.eval_size=200",
        "reward_pool.workers=0", "placement.backend=ray", "placement.mode=split",
        f"placement.rollout_workers={samplers}", f"placement.schedule={schedule}", "placement.max_staleness=1"],
        DEMO_DEFAULTS)


@pytest.mark.parametrize("samplers", [1, 2])
def test_async_sampling_keeps_the_staleness_bound_and_learns(session, demo_path, tmp_path, samplers):
    steps = 12 if samplers == 1 else 6
    cfg = split_demo_config(demo_path, tmp_path, steps, samplers, "async")
    summary = train(cfg)
    rows = [r for r in read_metrics(tmp_path) if r["step"] > 0]
    staleness = [r["async/staleness"] for r in rows]
    # step 1 is sampled by the initial weights (version 0) with the trainer at version 0; from then on the
    # sampler runs exactly one version behind: never more than the bound, never on-policy
    assert staleness == [0] + [1] * (steps - 1)
    assert all(r["sync/bytes"] > 0 for r in rows)
    # the final checkpoint's prompt position is where trained batches end, not where sampling ran ahead to:
    # a resumed run re-samples the batch that was in flight
    state = json.loads((checkpoint.latest(tmp_path / "checkpoints") / "trainer_state.json").read_text())
    from tandem.data.arithmetic import rows as arithmetic_rows

    n_train = len(arithmetic_rows("train"))
    assert state["data"]["epoch"] * n_train + state["data"]["index"] == steps * cfg.batch.prompts_per_step
    if samplers == 1:
        assert summary["eval/accuracy"] > summary["initial_eval/accuracy"] + 0.25, summary


@pytest.mark.parametrize("samplers", [1, 2])
def test_streaming_split_samplers_keep_the_per_token_bound_and_learn(session, demo_path, tmp_path, samplers):
    """placement.schedule: stream on Ray samplers, new weights landing while requests are in flight: each step
    trains whole groups whose tokens are all within the bound, tagged with the versions that sampled them, and
    the run learns."""
    steps = 12 if samplers == 1 else 6
    cfg = split_demo_config(demo_path, tmp_path, steps, samplers, "stream")
    summary = train(cfg)
    rows = [r for r in read_metrics(tmp_path) if r["step"] > 0]
    assert all(r["async/staleness"] <= 1 and r["async/staleness_mean"] <= 1 for r in rows)
    assert any(r["async/staleness"] == 1 for r in rows)  # samples did come from an older policy than the trainer's
    assert all(r["sync/bytes"] > 0 and "stream/tokens_in_flight" in r for r in rows[1:])
    if samplers == 1:
        assert summary["eval/accuracy"] > summary["initial_eval/accuracy"] + 0.25, summary


def test_multi_turn_conversations_on_split_async_samplers(session, tiny_model, tmp_path):
    """Whole conversations (a plugin environment answering each turn) sampled ahead by 2 sampler actors: the run
    trains on their sampled tokens only and counts their turns."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rollout"))  # the plugin, for the actors too
    cfg = small_config(tiny_model, tmp_path, "placement.mode=split", "placement.rollout_workers=2",
                       "placement.schedule=async", "run.steps=3", "run.save_every=0",
                       "env.name=test_multiturn:echo_env", "env.kwargs={turns: 3}", "env.max_tokens=48",
                       "rollout.ignore_eos=true", "batch.micro_batch_tokens=128")
    train(cfg)
    rows = [r for r in read_metrics(tmp_path) if r["step"] > 0]
    assert [r["async/staleness"] for r in rows] == [0, 1, 1]
    assert all(r["multiturn/turns_mean"] == 3 and 0 < r["multiturn/masked_frac"] < 1 for r in rows)


def test_async_sampling_with_dynamic_sampling_keeps_the_bound(session, tiny_model, tmp_path):
    """DAPO's extra sampling rounds take batches sampled ahead: every one still within the staleness bound, and a
    checkpoint's prompt position counts every round's prompts."""
    steps, rounds = 4, 3
    cfg = small_config(tiny_model, tmp_path, f"run.steps={steps}", "run.save_every=0", "placement.mode=split",
                       "placement.schedule=async", "algo.dynamic_sampling=true", f"algo.max_sampling_rounds={rounds}")
    train(cfg)
    rows = [r for r in read_metrics(tmp_path) if r["step"] > 0]
    assert all(r["async/staleness"] <= 1 for r in rows)
    used = [int(r["dynamic/rounds"]) for r in rows]
    assert max(used) > 1  # the extra rounds ran (a random model rarely spreads a group's rewards)
    state = json.loads((checkpoint.latest(tmp_path / "checkpoints") / "trainer_state.json").read_text())
    assert state["data"]["index"] == sum(used) * cfg.batch.prompts_per_step


def _cut_at_step_2(full: Path, cut: Path) -> None:
    """A copy of run `full` as if killed after its step-2 checkpoint."""
    import shutil

    shutil.copytree(full, cut)
    for later in (cut / "checkpoints").glob("step-*"):
        if later.name != "step-00000002":
            shutil.rmtree(later)
    lines = (cut / "metrics.jsonl").read_text().splitlines()
    (cut / "metrics.jsonl").write_text("\n".join(lines[:3]) + "\n")


def test_two_worker_resume_reproduces_the_uninterrupted_run(session, tiny_model, tmp_path):
    """Sharded optimizer state per rank, the gathered HF weights and the resharded engines: a colocated 2-worker
    run resumed from its step-2 checkpoint ends with the metrics of the run that never stopped."""
    extra = ("placement.workers=2", "algo.kl_coef=0.05", "rewards=[{name: 'toy_rewards:text_length'}]")
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))  # toy_rewards, in the driver
    train(small_config(tiny_model, tmp_path / "full", *extra))
    _cut_at_step_2(tmp_path / "full", tmp_path / "cut")
    train(small_config(tiny_model, tmp_path / "cut", *extra), resume=True)
    assert without_machine(read_metrics(tmp_path / "cut")) == without_machine(read_metrics(tmp_path / "full"))


def test_a_reward_model_and_a_teacher_on_workers_of_their_own_score_as_in_one_process(session, tiny_model, tmp_path):
    """placement.reward_workers and teacher_workers: the reward model and the distillation teacher on Ray workers
    of their own beside a colocated worker give step 1 the rewards and the reverse KL that one process gives (the
    same samples: the same seed), with the reward model's and the teacher's figures logged."""
    from conftest import save_tiny_model
    from train.test_reward_model import save_classifier

    classifier, teacher = save_classifier(tmp_path / "rm"), save_tiny_model(tmp_path / "teacher", seed=1)
    models = [f"algo.distill.teacher={teacher}", "run.steps=2", "run.save_every=0", "run.eval_every=0",
              f"rewards=[{{name: arithmetic_exact, weight: 0}}, {{name: model, path: '{classifier}'}}]"]
    train(small_config(tiny_model, tmp_path / "one", *models, "placement.backend=local"))
    train(small_config(tiny_model, tmp_path / "ray", *models, "placement.reward_workers=1",
                       "placement.teacher_workers=1"))
    one, ray = (next(r for r in read_metrics(tmp_path / d) if r["step"] == 1) for d in ("one", "ray"))
    for key in ("reward/model", "reward/model/std", "distill/reverse_kl"):
        assert ray[key] == pytest.approx(one[key], abs=1e-5), key
    assert abs(ray["distill/reverse_kl"]) > 1e-3 and ray["reward/model/std"] > 0  # the models score something
    assert ray["time/teacher"] > 0 and ray["reward_model/model/batches"] >= 1


@pytest.mark.parametrize("placement", [
    ["placement.workers=2"],
    ["placement.mode=split", "placement.train_workers=2", "placement.rollout_workers=1"]])
def test_context_parallel_trainers_train_as_one_process_and_sync_exactly(session, tiny_model, tmp_path, placement):
    """2 training workers under placement.context_parallel: 2 (each row's sequence split over both, FSDP over both),
    colocated and split, run the GRPO loop as one process does: the same losses, and every step's sampler logprobs
    (the hf engine, filled by the planned reshard of the cp-sharded weights, in the group or over the weight channel)
    equal the trainer's (1e-5): red if the sync misread the dp x cp layout, or if either side's forward differed."""
    extra = ["run.steps=3", "run.save_every=0"]
    train(small_config(tiny_model, tmp_path / "one", *extra, "placement.backend=local"))
    train(small_config(tiny_model, tmp_path / "cp", *extra, *placement, "placement.context_parallel=2"))
    one, cp = ([r for r in read_metrics(tmp_path / d) if r["step"] > 0] for d in ("one", "cp"))
    assert [r["step"] for r in cp] == [1, 2, 3] and all(r["sync/bytes"] > 0 for r in cp)
    assert all(r["logprob_diff"] < 1e-5 for r in cp), [r["logprob_diff"] for r in cp]
    assert [r["loss"] for r in cp] == pytest.approx([r["loss"] for r in one], rel=1e-4, abs=1e-6)


@pytest.mark.parametrize("model,placement", [
    ("vlm", ["placement.workers=2"]),
    ("vlm", ["placement.mode=split", "placement.rollout_workers=1", "placement.schedule=async",
             "placement.max_staleness=1"]),
    ("qwen_vlm", ["placement.workers=2"])])
def test_a_vision_model_samples_and_trains_with_its_images_on_ray_workers(session, request, tmp_path, model,
                                                                          placement):
    """The vision demo's tiny Idefics3 on the colors task (hf engine): on 2 colocated workers (FSDP over the whole
    model, tower included: each row's forward takes its picture) and on a split trainer and sampler (async, the
    pictures travel to the sampler with the prompts); a tiny Qwen2.5-VL (3-D positions, computed by the FSDP-wrapped
    model's own rope index) on 2 colocated workers. Every fresh batch's sampler logprobs equal the trainer's (1e-5):
    red if the pictures missed the engines or the trainer's forwards (they move the logprobs, tests/train/
    test_vision.py), or if FSDP did not shard the model (it refused a model whose layers are not model.model.layers)."""
    cfg = small_config(request.getfixturevalue(model), tmp_path, "data.task=colors", "data.max_prompt_tokens=32",
                       "run.steps=3",
                       "run.save_every=0", "rewards=[{name: colors_exact}]", *placement)
    train(cfg)
    rows = [r for r in read_metrics(tmp_path) if r["step"] > 0]
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["sync/bytes"] > 0 for r in rows)
    fresh = [r for r in rows if r.get("async/staleness", 0) == 0]
    assert fresh and all(r["logprob_diff"] < 1e-5 for r in fresh), [r["logprob_diff"] for r in rows]
