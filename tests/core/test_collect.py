"""The controller's collect: a step's samples scored over its rounds; dynamic sampling keeps whole groups with a
reward spread and reports what was sampled beside what is kept."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from tandem import trainer
from tandem.config import Config
from tandem.data.sources import Prompt
from tandem.rewards.base import RewardResult
from tandem.rollout.base import Completion, Samples
from tandem.workers.placement import Rollout

# each round samples 2 prompts x 2; the reward of a completion is its text
ROUNDS = [["1", "1", "0", "1"], ["1", "0", "1", "1"]]  # groups: A all right, B spread | C spread, D all right


def _run(dynamic: bool):
    cfg = Config.model_validate({"batch": {"prompts_per_step": 2, "group_size": 2},
                                 "algo": {"dynamic_sampling": dynamic, "max_sampling_rounds": 2}})

    def take(step, rnd, t):
        batch = [Prompt([rnd, i], {"question": f"q{rnd}{i}"}) for i in range(2)]
        comps = [Completion([rnd, i // 2], [7], [0.0], text, "stop", i // 2) for i, text in enumerate(ROUNDS[rnd])]
        return batch, Rollout(Samples.of_call(comps, 2), version=0, seconds=0.0, idle_seconds=0.0, load_seconds=0.0)

    def score(texts, questions, rows):
        scores = [float(t) for t in texts]
        return RewardResult(total=scores, per_fn={"exact": scores})

    scorer = SimpleNamespace(score=score, error_limit=SimpleNamespace(observe=lambda *a: {}))
    return SimpleNamespace(cfg=cfg, rollouts=SimpleNamespace(take=take), scorer=scorer, correct_reward="exact")


def test_dynamic_sampling_reports_what_was_sampled_and_what_is_kept():
    scored, stats = trainer.collect(_run(dynamic=True), 1, trainer.Timer())
    # B (round 1) and C (round 2) have a spread: they are trained on, renumbered 0 and 1
    assert [c.prompt_ids for c in scored.samples.completions] == [[0, 1], [0, 1], [1, 0], [1, 0]]
    assert scored.samples.group.tolist() == [0, 0, 1, 1] and scored.samples.num_groups == 2
    assert scored.totals == [0.0, 1.0, 1.0, 0.0]
    assert stats["train/accuracy"] == 0.5 and stats["reward/exact"] == 0.5  # what is trained on
    assert stats["sampled/train/accuracy"] == 0.75 and stats["sampled/reward/exact"] == 0.75  # all 8 sampled
    assert stats["dynamic/rounds"] == 2 and stats["dynamic/kept_group_frac"] == 0.5


def test_without_dynamic_sampling_one_round_is_all_there_is():
    scored, stats = trainer.collect(_run(dynamic=False), 1, trainer.Timer())
    assert len(scored.samples) == 4 and scored.samples.group.tolist() == [0, 0, 1, 1]
    assert stats["train/accuracy"] == 0.75 and not any(k.startswith("sampled/") for k in stats)


ASYNC = {"backend": "ray", "mode": "split", "schedule": "async", "max_staleness": 1}


@pytest.mark.parametrize("overrides, source", [
    ({}, "current"),
    ({"algo": {"mu": 2}}, "recomputed"),
    ({"batch": {"mini_batches": 2}}, "recomputed"),
    ({"algo": {"kl_coef": 0.1, "kl_in_reward": True}}, "recomputed"),
    ({"placement": ASYNC}, "sampler"),  # stale samples: the sampler's logprobs are the behaviour policy
    ({"placement": ASYNC, "algo": {"tis_cap": 2.0}}, "recomputed"),  # decoupled: TIS covers sampler -> old
])
def test_the_old_logprob_source_is_decided_by_the_config(overrides, source):
    assert Config.model_validate(overrides).old_logprobs.value == source
