"""Scores beyond float32, the dtype a step's rewards train in: an error of the reward that returned them (scored 0,
counted as `bad_value`), alone or once weighted and summed, never an inf that silently zeroes a group's advantages."""
from __future__ import annotations

import pytest
import torch

from tandem.algo.core import grpo_advantages
from tandem.rewards import RewardScorer
from tandem.rewards.base import FLOAT32_MAX


def _advantages(total: list[float]) -> list[float]:
    """One group's GRPO advantages, from the totals as the rollout source makes them (a float32 tensor)."""
    rewards = torch.tensor(total, dtype=torch.float32)
    return grpo_advantages(rewards, torch.zeros(len(total), dtype=torch.long), torch.ones(len(total))).tolist()


def test_the_bound_is_float32s_largest():
    assert FLOAT32_MAX == torch.finfo(torch.float32).max


def test_two_rewards_of_3e38_sum_to_an_error_scored_0_not_an_inf_that_zeroes_the_group():
    """Two rewards of 3e38 for a right answer, each within float32 alone: their sum, 6e38, used to pass (no error
    counted), became inf in the step's float32 rewards, and the group's advantages were 0, 0 (loss 0, grad 0). Now
    the second is that reward's `bad_value` error on the sample, scored 0, and the group trains."""
    assert _advantages([6e38, 0.0]) == [0.0, 0.0]  # what the sum did: inf in float32, and nothing to learn
    with RewardScorer([("bad_rewards:right_is_3e38", 1.0, {}), ("bad_rewards:right_is_3e38", 1.0, {})],
                      workers=0) as s:
        res = s.score(["right", "wrong"], ["Q", "Q"], [{}, {}])
    first, second = "bad_rewards:right_is_3e38", "bad_rewards:right_is_3e38_2"
    assert res.errors == {first: 0, second: 1} and res.error_kinds[second] == {"bad_value": 1}
    assert res.error_counts("reward/errors")[f"reward/errors/{second}/bad_value"] == 1
    assert "beyond float32" in res.last_error[second] and "total" in res.last_error[second]
    assert res.per_fn == {first: [3e38, 0.0], second: [0.0, 0.0]} and res.total == [3e38, 0.0]
    assert _advantages(res.total) == pytest.approx([0.7071, -0.7071], abs=1e-4)


@pytest.mark.parametrize("workers", [0, 1], ids=["inline", "pool"])
def test_a_score_beyond_float32_is_an_error_scored_0(workers):
    """1e39 is finite in float64 and inf in float32: a `bad_value`, as NaN is, in the trainer's process and in a
    pool worker alike; the working reward beside it still scores."""
    with RewardScorer([("bad_rewards:returns_huge", 1.0, {}), ("bad_rewards:good", 1.0, {})], workers=workers,
                      timeout_s=5.0) as s:
        res = s.score(["a", "bb"], ["Q", "Q"], [{}, {}])
    name = "bad_rewards:returns_huge"
    assert res.errors[name] == 2 and res.error_kinds[name] == {"bad_value": 2}
    assert "beyond float32" in res.last_error[name]
    assert res.per_fn[name] == [0.0, 0.0] and res.total == [1.0, 2.0]


def test_an_inline_or_batched_score_beyond_float32_fails_alone():
    with RewardScorer([("bad_rewards:returns_huge_inline", 1.0, {}), ("bad_rewards:batch_returns_huge", 1.0, {})],
                      workers=0) as s:
        res = s.score(["huge", "ok"], ["Q", "Q"], [{}, {}])
    assert res.error_kinds == {"bad_rewards:returns_huge_inline": {"bad_value": 2},
                               "bad_rewards:batch_returns_huge": {"bad_value": 1}}
    assert res.per_fn["bad_rewards:batch_returns_huge"] == [0.0, 1.0] and res.total == [0.0, 1.0]


def test_a_weight_that_takes_a_score_beyond_float32_is_an_error_of_that_reward():
    with RewardScorer([("bad_rewards:right_is_3e38", 2.0, {}), ("bad_rewards:good", 1.0, {})], workers=0) as s:
        res = s.score(["right", "wrong"], ["Q", "Q"], [{}, {}])
    assert res.error_kinds["bad_rewards:right_is_3e38"] == {"bad_value": 1} and res.total == [5.0, 5.0]
    assert "weighted by 2" in res.last_error["bad_rewards:right_is_3e38"]


@pytest.mark.parametrize("weight", [".nan", ".inf", "-.inf"])
def test_a_weight_that_is_not_a_finite_number_is_refused_by_the_config(weight):
    from tandem.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"rewards\.0\.weight: Input should be a finite number"):
        load_config(None, [], [f"rewards=[{{name: gsm8k, weight: {weight}}}]", "data.path=x"])
