"""Advantage estimators against plain-Python reference formulas, plus edge cases."""
import math
import random

import pytest
import torch

from tandem.algo import ADVANTAGES

EPS = 1e-6


def _groups_of(rewards, groups):
    out: dict[int, list[float]] = {}
    for r, g in zip(rewards, groups):
        out.setdefault(g, []).append(r)
    return out


def _mean(xs):
    return sum(xs) / len(xs)


def _std(xs):  # unbiased; 0 for one element
    if len(xs) < 2:
        return 0.0
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def ref_grpo(rewards, groups):
    by = _groups_of(rewards, groups)
    return [(r - _mean(by[g])) / (_std(by[g]) + EPS) for r, g in zip(rewards, groups)]


def ref_dr_grpo(rewards, groups):
    by = _groups_of(rewards, groups)
    return [r - _mean(by[g]) for r, g in zip(rewards, groups)]


def ref_grpo_batch_std(rewards, groups):
    by = _groups_of(rewards, groups)
    s = _std(rewards)
    return [(r - _mean(by[g])) / (s + EPS) for r, g in zip(rewards, groups)]


def ref_rloo(rewards, groups):
    by = _groups_of(rewards, groups)
    out = []
    for r, g in zip(rewards, groups):
        n = len(by[g])
        out.append(0.0 if n == 1 else r - (sum(by[g]) - r) / (n - 1))
    return out


def ref_reinforce_pp(rewards, groups):
    m, s = _mean(rewards), _std(rewards)
    return [(r - m) / (s + EPS) for r in rewards]


def ref_reinforce_pp_baseline(rewards, groups):
    x = ref_dr_grpo(rewards, groups)
    m, s = _mean(x), _std(x)
    return [(v - m) / (s + EPS) for v in x]


REFS = {
    "grpo": ref_grpo,
    "dr_grpo": ref_dr_grpo,
    "grpo_batch_std": ref_grpo_batch_std,
    "rloo": ref_rloo,
    "reinforce_pp": ref_reinforce_pp,
    "reinforce_pp_baseline": ref_reinforce_pp_baseline,
}


def test_every_registered_estimator_has_a_reference():
    assert set(ADVANTAGES) == set(REFS)


def _case():
    rng = random.Random(0)
    # groups of sizes 4, 1, 3 (all equal), 5, interleaved labels that are not 0..G-1
    groups = [7] * 4 + [2] + [9] * 3 + [4] * 5
    rewards = [rng.random() for _ in range(4)] + [0.5] + [1.0] * 3 + [float(rng.randint(0, 1)) for _ in range(5)]
    perm = list(range(len(groups)))
    rng.shuffle(perm)
    return [rewards[i] for i in perm], [groups[i] for i in perm]


@pytest.mark.parametrize("name", sorted(REFS))
def test_matches_reference(name):
    rewards, groups = _case()
    got = ADVANTAGES[name](torch.tensor(rewards, dtype=torch.float64), torch.tensor(groups), eps=EPS)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, torch.tensor(REFS[name](rewards, groups), dtype=torch.float64))


@pytest.mark.parametrize("name", sorted(REFS))
def test_edge_cases_are_finite(name):
    fn = ADVANTAGES[name]
    # one sample; all groups of one; all rewards equal
    for rewards, groups in [([1.0], [0]), ([1.0, 0.0, 3.0], [0, 1, 2]), ([2.0] * 6, [0, 0, 0, 1, 1, 1])]:
        got = fn(torch.tensor(rewards), torch.tensor(groups), eps=EPS)
        assert got.shape == (len(rewards),) and got.dtype == torch.float32
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.double(), torch.tensor(REFS[name](rewards, groups), dtype=torch.float64))


def test_hand_values():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 5.0])
    g = torch.tensor([0, 0, 0, 0, 1])
    # group 0: mean 0.5; the group of one gets 0 everywhere
    torch.testing.assert_close(ADVANTAGES["dr_grpo"](r, g), torch.tensor([0.5, -0.5, -0.5, 0.5, 0.0]))
    # rloo: 1 - (0+0+1)/3 = 2/3, 0 - (1+0+1)/3 = -2/3
    torch.testing.assert_close(ADVANTAGES["rloo"](r, g), torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0.0]))
    # group std (unbiased) of [1,0,0,1] = sqrt(1/3)
    a = ADVANTAGES["grpo"](r, g, eps=0.0)
    torch.testing.assert_close(a[:4], torch.tensor([1.0, -1.0, -1.0, 1.0]) * 0.5 / math.sqrt(1 / 3))
    assert a[4] == 0


def test_all_equal_rewards_give_zero_for_group_baselines():
    r, g = torch.full((8,), 0.7), torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    for name in ["grpo", "dr_grpo", "grpo_batch_std", "rloo", "reinforce_pp", "reinforce_pp_baseline"]:
        assert torch.allclose(ADVANTAGES[name](r, g), torch.zeros(8), atol=1e-6), name


def test_zero_eps_never_nan():
    r, g = torch.tensor([1.0, 1.0, 2.0]), torch.tensor([0, 0, 1])
    for name in ["grpo", "grpo_batch_std", "reinforce_pp", "reinforce_pp_baseline"]:
        assert torch.isfinite(ADVANTAGES[name](r, g, eps=0.0)).all(), name
        assert torch.isfinite(ADVANTAGES[name](torch.ones(1), torch.zeros(1, dtype=torch.long), eps=0.0)).all()
