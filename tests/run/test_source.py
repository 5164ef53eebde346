"""The rollout source: a step's batch scored over its rounds; dynamic sampling keeps whole groups with a reward
spread and reports what was sampled beside what is kept; shaping masks truncated rows out of training."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from tandem.config import Config
from tandem.data.sources import Prompt
from tandem.rewards.base import RewardResult
from tandem.rollout.base import Completion, Rollout, Samples
from tandem.run.source import RolloutSource

# each round samples 2 prompts x 2; the reward of a completion is its text
ROUNDS = [["1", "1", "0", "1"], ["1", "0", "1", "1"]]  # groups: A all right, B spread | C spread, D all right


class _Rounds:
    """The prompt stream and the placement in one: round r's 2 prompts, and 2 completions each with ROUNDS[r]'s
    texts (the second prompt's second completion hits the length limit)."""

    def __init__(self):
        self.round = 0

    def state_dict(self) -> dict:
        return {"round": self.round}

    def take(self, n: int) -> list[Prompt]:
        return [Prompt([self.round, i], {"question": f"q{self.round}{i}"}) for i in range(n)]

    def submit_generate(self, prompts, sampling):
        r, self.round = self.round, self.round + 1
        comps = [Completion([r, i // 2], [7, 8], [0.0, 0.0], text, "length" if i == 3 else "stop", i // 2)
                 for i, text in enumerate(ROUNDS[r])]
        return SimpleNamespace(get=lambda timeout=None: Rollout(Samples.of_call(comps, 2)))


def _source(dynamic: bool, *extra: dict) -> RolloutSource:
    settings = {"batch": {"prompts_per_step": 2, "group_size": 2}, "rollout": {"max_new_tokens": 2},
                "algo": {"dynamic_sampling": dynamic, "max_sampling_rounds": 2}}
    for more in extra:
        settings["algo"].update(more)
    cfg = Config.model_validate(settings)

    def score(texts, questions, rows):
        scores = [float(t) for t in texts]
        return RewardResult(total=scores, per_fn={"exact": scores})

    scorer = SimpleNamespace(score=score, error_limit=SimpleNamespace(observe=lambda *a: {}))
    rounds = _Rounds()
    return RolloutSource(cfg, rounds, rounds, scorer, "exact", 0, lambda: None)


def test_dynamic_sampling_reports_what_was_sampled_and_what_is_kept():
    batch, stats = _source(dynamic=True).next(1)
    # B (round 1) and C (round 2) have a spread: they are trained on, renumbered 0 and 1
    assert [c.prompt_ids for c in batch.samples.completions] == [[0, 1], [0, 1], [1, 0], [1, 0]]
    assert batch.samples.group.tolist() == [0, 0, 1, 1] and batch.samples.num_groups == 2
    assert batch.rewards.tolist() == [0.0, 1.0, 1.0, 0.0]
    assert stats["train/accuracy"] == 0.5 and stats["reward/exact"] == 0.5  # what is trained on
    assert stats["sampled/train/accuracy"] == 0.75 and stats["sampled/reward/exact"] == 0.75  # all 8 sampled
    assert stats["dynamic/rounds"] == 2 and stats["dynamic/kept_group_frac"] == 0.5


def test_without_dynamic_sampling_one_round_is_all_there_is():
    batch, stats = _source(dynamic=False).next(1)
    assert len(batch.samples) == 4 and batch.samples.group.tolist() == [0, 0, 1, 1]
    assert stats["train/accuracy"] == 0.75 and not any(k.startswith("sampled/") for k in stats)
    assert [c.loss_mask for c in batch.samples.completions] == [None] * 4


def test_shaping_masks_truncated_rows_and_penalizes_overlong_ones():
    """mask_truncated: a truncated row trains on nothing (its loss mask is 0, so is its advantage's token count);
    the overlong ramp lowers the reward of a row near the length limit (max_new_tokens 2, buffer 1: -1 at 2)."""
    batch, _ = _source(False, {"mask_truncated": True}, {"overlong_buffer": 1}).next(1)
    assert [c.loss_mask for c in batch.samples.completions] == [None, None, None, [0, 0]]
    assert batch.samples.sampled_lengths.tolist() == [2, 2, 2, 0]
    assert batch.rewards.tolist() == [0.0, 0.0, -1.0, 0.0]  # 1, 1, 0, 1 less the ramp's 1 at the limit


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


def test_an_environments_reward_beyond_float32_is_its_error_scored_0():
    """An environment's own reward (StepResult.reward, summed per conversation) joins the total as a reward
    function's score does, held to the same rule: one not finite in float32, alone or added to the total, is the
    `env` reward's `bad_value` error, scored 0 and counted where the step's reward errors are (and in the error-rate
    stop's input); the step's rewards stay finite."""
    from collections import Counter, defaultdict

    cfg = Config.model_validate({"batch": {"prompts_per_step": 1, "group_size": 4}, "env": {"name": "tools"}})
    texts = ["1", "1", "3e38", "0"]
    own = [1e39, float("nan"), 1e38, 0.5]  # beyond float32; NaN; 3e38 + 1e38 summed; fine

    def score(texts, questions, rows):
        scores = [float(t) for t in texts]
        return RewardResult(total=scores, per_fn={"exact": scores})

    source = RolloutSource(cfg, None, None, SimpleNamespace(score=score), "exact", 0, lambda: None)
    comps = [Completion([0], [7], [0.0], t, "stop", 0, meta={"env_reward": r}) for t, r in zip(texts, own)]
    stats, errors, last = defaultdict(float), Counter(), {}
    batch = source._rewarded([Prompt([0], {"question": "q"})], Rollout(Samples.of_call(comps, 1)), stats, errors,
                             last)
    assert batch.rewards.isfinite().all() and batch.rewards.tolist() == pytest.approx([1.0, 1.0, 3e38, 0.5])
    assert batch.scores["env"] == [0.0, 0.0, 0.0, 0.5]
    assert stats["reward/errors/env"] == 3 and stats["reward/errors/env/bad_value"] == 3 and errors["env"] == 3
    assert "beyond float32" in last["env"]
