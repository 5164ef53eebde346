"""The GRPO loop end to end on a tiny model: determinism, exact resume, safe checkpoints, metrics, batching."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tandem.run import checkpoint
from tandem.config import load_config
from tandem.trainer import train

TIMING = ("time/", "tokens_per_s", "rollout/tokens_per_s")


def small_config(model: Path, out: Path, *extra: str):
    return load_config(None, [
        f"model.path={model}", f"run.output_dir={out}", "run.steps=4", "run.save_every=2", "run.progress=false",
        "run.report_to=[]", "run.plots=false", "batch.prompts_per_step=4", "batch.group_size=4",
        "rollout.max_new_tokens=4", "data.max_prompt_tokens=8", "batch.micro_batch_tokens=64", "optim.lr=1e-3",
        "data.eval_size=8", "run.seed=3",
        "rewards=[{name: arithmetic_exact}, {name: 'toy_rewards:text_length', weight: 0.5}]", *extra,
    ])


def read_metrics(out: Path) -> list[dict]:
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows]


def test_same_seed_same_metrics(tiny_model, tmp_path):
    train(small_config(tiny_model, tmp_path / "a"))
    train(small_config(tiny_model, tmp_path / "b"))
    a, b = read_metrics(tmp_path / "a"), read_metrics(tmp_path / "b")
    assert [r["step"] for r in a] == [0, 1, 2, 3, 4]
    assert a == b
    train(small_config(tiny_model, tmp_path / "c", "run.seed=4"))
    assert read_metrics(tmp_path / "c") != a


def test_resume_reproduces_the_uninterrupted_run(tiny_model, tmp_path):
    extra = ("algo.kl_coef=0.05", "algo.mu=2")  # reference model, optimizer moments and old logprobs all matter
    full = tmp_path / "full"
    train(small_config(tiny_model, full, *extra))
    # the same run, stopped after step 2: its step-2 checkpoint and metrics up to step 2 are all that is left
    cut = tmp_path / "cut"
    shutil.copytree(full, cut)
    shutil.rmtree(cut / "checkpoints" / "step-00000004")
    lines = (cut / "metrics.jsonl").read_text().splitlines()
    (cut / "metrics.jsonl").write_text("\n".join(lines[:4]) + "\n")  # steps 0-2 and half of step 3's work lost
    torch.manual_seed(12345)  # a resumed process starts with other global RNG state
    train(small_config(tiny_model, cut, *extra), resume=True)
    assert read_metrics(cut) == read_metrics(full)
    a = checkpoint.latest(full / "checkpoints")
    b = checkpoint.latest(cut / "checkpoints")
    from safetensors.torch import load_file

    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_checkpoint_is_a_plain_hf_folder_and_survives_a_failed_save(tiny_model, tmp_path):
    out = tmp_path / "run"
    train(small_config(tiny_model, out, "run.steps=2", "run.save_every=1", "run.keep_checkpoints=5"))
    from transformers import AutoModelForCausalLM

    last = checkpoint.latest(out / "checkpoints")
    assert last.name == "step-00000002"
    AutoModelForCausalLM.from_pretrained(str(last))  # loadable as is
    state = json.loads((last / "trainer_state.json").read_text())
    assert state["step"] == 2 and state["data"] == {"epoch": 0, "index": 8}

    def crash(folder):
        (Path(folder) / "model.safetensors").write_bytes(b"partial")
        raise KeyboardInterrupt  # killed mid-write

    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(out / "checkpoints", 3, crash, {"step": 3}, keep=1)
    assert checkpoint.latest(out / "checkpoints") == last  # the half-written one is invisible
    assert not (out / "checkpoints" / "step-00000003.tmp").exists()  # and removed on the way out (kill -9 cannot)
    assert [s for s, _ in checkpoint.checkpoints(out / "checkpoints")] == [1, 2]


def test_metrics_cover_the_step(tiny_model, tmp_path):
    out = tmp_path / "run"
    summary = train(small_config(tiny_model, out, "run.steps=2", "run.plots=true", "run.report_to=[tensorboard]",
                                 "algo.kl_coef=0.1"))
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    step = rows[1]
    for key in ("reward/mean", "reward/std", "reward/arithmetic_exact", "reward/toy_rewards:text_length",
                "reward/errors/arithmetic_exact",
                "train/accuracy", "advantage/mean", "advantage/std", "kl", "clip_frac", "entropy",
                "completion/length_mean", "completion/length_max", "completion/truncated_frac", "grad_norm", "lr",
                "time/rollout", "time/reward", "time/logprobs", "time/update", "time/sync", "tokens_per_s",
                "logprob_diff", "sync/bytes", "time/step", "time/trainer_idle"):
        assert key in step, key
    # in one process nothing overlaps: the step holds its sampling, scoring, update and sync
    assert step["time/step"] >= step["time/rollout"] + step["time/logprobs"] + step["time/update"] + step["time/sync"]
    # the embedded engine samples with the trainer's own numbers: the mismatch is rounding only
    assert step["logprob_diff"] < 1e-4
    assert step["kl"] == 0.0 or step["kl"] < 1e-6  # first step: policy == reference
    assert (out / "curves.png").stat().st_size > 0
    assert any((out / "tensorboard").iterdir())
    assert "eval/accuracy" in summary and "initial_eval/accuracy" in summary
    # the final evaluation as a results file, and a model card in each checkpoint naming what made it
    results = json.loads((out / "eval_results.json").read_text())
    assert {f"eval/{k}": v for k, v in results["results"].items()} == {k: v for k, v in rows[-1].items()
                                                                        if k.startswith("eval/")}
    card = (checkpoint.latest(out / "checkpoints") / "README.md").read_text()
    assert card.startswith(f"---\nbase_model: {tiny_model}\nlibrary_name: transformers\n")
    for words in ("after step 2 of 2", "`arithmetic_exact` (weight 1)", "`toy_rewards:text_length` (weight 0.5)",
                  "advantage `grpo`", "KL to the reference | 0.1", "4 prompts x 4 completions per step",
                  f"| accuracy | {rows[-1]['eval/accuracy']:.4g} |", "tandem 0."):
        assert words in card, (words, card)
    assert checkpoint.problems(checkpoint.latest(out / "checkpoints")) == []  # the card is among the checksums


def test_micro_batch_budget_does_not_change_the_update(tiny_model, tmp_path):
    """Token-budget micro-batches are a memory knob only: one big micro-batch and many small ones agree."""
    from safetensors.torch import load_file

    train(small_config(tiny_model, tmp_path / "big", "run.steps=1", "batch.micro_batch_tokens=1000"))
    train(small_config(tiny_model, tmp_path / "small", "run.steps=1", "batch.micro_batch_tokens=12"))
    a = load_file(str(checkpoint.latest(tmp_path / "big" / "checkpoints") / "model.safetensors"))
    b = load_file(str(checkpoint.latest(tmp_path / "small" / "checkpoints") / "model.safetensors"))
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-6
    assert any(not torch.equal(a[k], load_file(str(next(Path(tiny_model).glob("*.safetensors"))))[k]) for k in a)


def test_broken_rewards_score_zero_are_counted_and_training_goes_on(tiny_model, tmp_path):
    out = tmp_path / "run"
    rewards = ("rewards=[{name: arithmetic_exact}, {name: 'toy_rewards:text_length', weight: 0.5}, "
               "{name: 'toy_rewards:raises'}, {name: 'toy_rewards:hangs'}, {name: 'toy_rewards:kills_worker'}, "
               "{name: 'toy_rewards:not_a_number'}]")
    # these fail on every sample, which by default stops the run (tests/rewards/test_limits.py): here it goes on
    train(small_config(tiny_model, out, "run.steps=1", rewards, "reward_pool.timeout_s=1", "reward_pool.workers=2",
                       "reward_pool.max_error_rate=1", "batch.prompts_per_step=2", "batch.group_size=2",
                       "data.eval_size=2"))
    step = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()][1]
    assert step["reward/error_rate/toy_rewards:raises"] == 1.0
    assert step["reward/error_rate/toy_rewards:text_length"] == 0
    assert step["reward/errors/toy_rewards:raises"] == 4 and step["reward/errors/toy_rewards:raises/raised"] == 4
    assert step["reward/errors/toy_rewards:hangs/timeout"] == 4
    assert step["reward/errors/toy_rewards:kills_worker/crashed"] == 4
    assert step["reward/errors/toy_rewards:not_a_number/bad_value"] == 4
    assert step["reward/toy_rewards:raises"] == 0.0 and step["reward/errors/toy_rewards:text_length"] == 0
    assert step["reward/toy_rewards:text_length"] > 0


@pytest.mark.parametrize("extra", [
    ("algo.dynamic_sampling=true", "algo.max_sampling_rounds=3"),
    ("algo.overlong_buffer=2", "algo.mask_truncated=true"),
    ("algo.kl_coef=0.1", "algo.kl_in_reward=true", "algo.kl_estimator=k2"),
    ("algo.tis_cap=2.0", "algo.entropy_coef=0.01", "batch.mini_batches=2"),
    ("algo.advantage=rloo", "algo.policy_loss=gspo", "algo.loss_agg=seq_mean_token_sum_norm", "algo.mu=2"),
    ("algo.advantage=dr_grpo", "algo.policy_loss=cispo", "algo.dual_clip=3.0"),
])
def test_algorithm_options_train(tiny_model, tmp_path, extra):
    out = tmp_path / "run"
    train(small_config(tiny_model, out, "run.steps=2", *extra))
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    for r in rows[1:]:
        assert all(not isinstance(v, str) for v in r.values()), r  # no NaN/inf (logged as strings)
    if "algo.dynamic_sampling=true" in extra:
        assert 1 <= rows[1]["dynamic/rounds"] <= 3 and 0 <= rows[1]["dynamic/kept_group_frac"] <= 1
        assert rows[1]["completion/length_mean"] > 0
    if "algo.mask_truncated=true" in extra:
        assert rows[1]["completion/truncated_frac"] > 0  # a random model rarely stops: these got no gradient
    if "algo.tis_cap=2.0" in extra:
        assert rows[1]["tis_capped_frac"] == 0.0  # the embedded engine samples with the trainer's numbers


def test_offload_changes_residency_not_results(tiny_model, tmp_path):
    """With offload on, each phase holds only what it needs (the engine sleeps while training, the policy and
    reference leave while sampling), and the run's metrics are exactly those of the run that kept everything."""
    extra = ("algo.kl_coef=0.05", "algo.mu=2")
    train(small_config(tiny_model, tmp_path / "on", *extra, "placement.offload=on"))
    train(small_config(tiny_model, tmp_path / "off", *extra, "placement.offload=off"))
    on, off = read_metrics(tmp_path / "on"), read_metrics(tmp_path / "off")
    memory = [k for k in on[-1] if k.startswith("memory/")]
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith("memory/")} for r in rows]  # noqa: E731
    assert strip(on) == strip(off)
    last_on, last_off = on[-1], off[-1]
    assert set(memory) == {"memory/generate_bytes", "memory/logprobs_bytes", "memory/update_bytes", "memory/sync_bytes"}
    # sampling: only the engine's weights (+ nothing of the policy); kept: policy, reference, engine all resident
    assert last_on["memory/generate_bytes"] < last_off["memory/generate_bytes"] / 2
    assert last_on["memory/update_bytes"] < last_off["memory/update_bytes"]


def test_a_failed_step_still_logs_the_step_queued_before_it(tiny_model, tmp_path, monkeypatch):
    """Step 2's update is still queued when step 3's sampling fails: step 2 trained, so its metrics line is
    written before the error propagates (it would otherwise be lost with the run)."""
    from tandem.run.source import RolloutSource

    real = RolloutSource.next

    def failing(self, step):
        if step == 3:
            raise RuntimeError("sampler lost")
        return real(self, step)

    monkeypatch.setattr(RolloutSource, "next", failing)
    out = tmp_path / "run"
    with pytest.raises(RuntimeError, match="sampler lost"):
        train(small_config(tiny_model, out, "run.save_every=0", "run.eval_every=0"))
    assert [r["step"] for r in read_metrics(out)] == [0, 1, 2]


def test_a_failed_worker_is_the_clis_one_line_message(tiny_model, tmp_path, monkeypatch, capsys):
    """The worker's summary (which worker, in which phase, why) is the message and the last line; the controller's
    traceback is left out (`-v` prints it)."""
    from tandem.cli import main
    from tandem.workers.hybrid import HybridWorker

    calls = {"n": 0}
    real = HybridWorker.generate

    def dies_on_the_second(self, *a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise MemoryError("the engine ran out of memory")
        return real(self, *a, **k)

    monkeypatch.setattr(HybridWorker, "generate", dies_on_the_second)
    cfg = tmp_path / "run.yaml"
    cfg.write_text(json.dumps(small_config(tiny_model, tmp_path / "out", "run.eval_every=0").model_dump(mode="json")))
    assert main(["train", str(cfg)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert lines[-2] == "tandem: error: worker 0/1 failed in generate: MemoryError('the engine ran out of memory')"
    assert lines[-1].startswith(f"tandem: the run stopped; what it saved is resumed with: tandem train {cfg} --resume")
