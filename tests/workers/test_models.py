"""Models in the loop on workers of their own (tandem.workers.models), without Ray: a reward model and a judge shared
out over two workers score as they do in the controller's process; the workers' metrics merge into one call's; the
placement settings are refused where they would start workers for nothing or need Ray."""
from __future__ import annotations

import functools
from pathlib import Path

import pytest

from tandem.config import ConfigError, load_config
from tandem.rewards import RewardScorer
from tandem.workers.group import WorkerContext
from tandem.workers.models import RemoteReward, RewardHost, merge_metrics, reward_builders

PROMPTS = ["12+34=", "47+38=", "99+99=", "10+10=", "47+38="]
COMPLETIONS = ["46", "85", "198", "20 and more", "58"]
ROWS = [{"answer": a} for a in ("46", "85", "198", "20", "85")]


@pytest.fixture(scope="module")
def classifier(tmp_path_factory) -> Path:
    from train.test_reward_model import save_classifier

    return save_classifier(tmp_path_factory.mktemp("reward-model"))


class InProcessWorkers:
    """`size` workers in this process, called one after another: the part of a worker group the models' controller
    side uses (the local backend runs one worker; Ray's cost would buy nothing here)."""

    def __init__(self, factory, size: int):
        self.size = size
        self.workers = [factory(WorkerContext(rank=r, size=size)) for r in range(size)]

    def call_each(self, method, per_worker_args):
        return [method(w, *args) for w, args in zip(self.workers, per_worker_args, strict=True)]


def _config(model: Path, reward: str, *extra: str):
    return load_config(None, [f"model.path={model}", f"rewards=[{{name: arithmetic_exact, weight: 0}}, {reward}]",
                              *extra])


def _both(cfg) -> tuple[RewardScorer, RewardScorer]:
    """The config's rewards scored in this process, and with the model-backed one on two local RewardHosts."""
    here = RewardScorer(cfg.rewards, workers=0, builders=reward_builders(cfg, "cpu"))
    there = RewardScorer(cfg.rewards, workers=0, builders={n: RemoteReward for n in ("model", "judge")})
    entry = there.entries[1]
    entry.rf.fn.attach(InProcessWorkers(functools.partial(RewardHost, cfg, 1), 2), entry.key)
    return here, there


def test_a_reward_model_on_two_workers_scores_as_in_process_normalized_over_the_whole_call(classifier, tiny_model):
    """normalize: zscore over all five samples, not over each worker's share (two then three). Red if a worker
    normalized its own share, or the shares came back out of order."""
    cfg = _config(tiny_model, f"{{name: model, path: '{classifier}', normalize: zscore}}")
    here, there = _both(cfg)
    want, got = (s.score(COMPLETIONS, PROMPTS, ROWS) for s in (here, there))
    assert got.per_fn["model"] == pytest.approx(want.per_fn["model"], abs=1e-5)
    assert len(set(round(x, 3) for x in want.per_fn["model"])) == 5  # distinct: an order mix-up would show
    assert got.metrics["reward_model/model/batches"] == 2  # one forward each: the counts of both workers summed
    assert got.metrics["time/reward_model/model"] > 0


def test_a_judge_on_two_workers_gives_the_in_process_verdicts(tiny_model):
    """A judge (hf engine, greedy) built on each worker as the controller would build it: the same verdicts, their
    counts summed over the workers."""
    cfg = _config(tiny_model, f"{{name: judge, path: '{tiny_model}', template: '{{prompt}}', verdict: answer, "
                              "max_new_tokens: 4}")
    here, there = _both(cfg)
    want, got = (s.score(COMPLETIONS, PROMPTS, ROWS) for s in (here, there))
    assert got.per_fn["judge"] == want.per_fn["judge"]
    assert got.metrics["judge/judge/samples"] == 5 and got.metrics["judge/judge/unreadable"] == \
        want.metrics["judge/judge/unreadable"]


def test_the_workers_figures_merge_into_one_calls():
    parts = [{"time/judge/j": 1.0, "judge/j/samples": 2.0, "reward_model/m/raw_mean": 1.0,
              "reward_model/m/batch_tokens": 30.0, "memory/reward_model/m/peak_bytes": 5.0},
             {"time/judge/j": 3.0, "judge/j/samples": 3.0, "reward_model/m/raw_mean": 2.0,
              "reward_model/m/batch_tokens": 10.0}]
    assert merge_metrics(parts) == {"time/judge/j": 3.0, "judge/j/samples": 5.0, "reward_model/m/raw_mean": 1.5,
                                    "reward_model/m/batch_tokens": 30.0, "memory/reward_model/m/peak_bytes": 5.0}


@pytest.mark.parametrize("overrides, says", [
    (["placement.reward_workers=1", "placement.backend=local"], "reward_workers: 1 starts Ray workers"),
    (["placement.reward_workers=1", "placement.backend=ray"], "reserves workers for a reward model or a judge"),
    (["placement.teacher_workers=2", "placement.backend=ray"], "reserves workers for a distillation teacher"),
    (["placement.teacher_workers=1", "algo.distill.teacher=/x"], "teacher_workers: 1 starts Ray workers"),
])
def test_model_workers_are_refused_without_ray_or_without_a_model(tiny_model, overrides, says):
    with pytest.raises(ConfigError, match=says):
        load_config(None, [f"model.path={tiny_model}", *overrides])
