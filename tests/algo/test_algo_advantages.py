"""Advantage estimators against plain-Python reference formulas, plus edge cases.

Every estimator takes (rewards, groups, lengths, eps); `lengths` (the tokens each sample trains on) matters only to
the token-level whitening of REINFORCE++, whose references below expand each reward to one value per token."""
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


def ref_grpo(rewards, groups, lengths):
    by = _groups_of(rewards, groups)
    return [(r - _mean(by[g])) / (_std(by[g]) + EPS) for r, g in zip(rewards, groups)]


def ref_dr_grpo(rewards, groups, lengths):
    by = _groups_of(rewards, groups)
    return [r - _mean(by[g]) for r, g in zip(rewards, groups)]


def ref_grpo_batch_std(rewards, groups, lengths):
    by = _groups_of(rewards, groups)
    s = _std(rewards)
    return [(r - _mean(by[g])) / (s + EPS) for r, g in zip(rewards, groups)]


def ref_rloo(rewards, groups, lengths):
    by = _groups_of(rewards, groups)
    out = []
    for r, g in zip(rewards, groups):
        n = len(by[g])
        out.append(0.0 if n == 1 else r - (sum(by[g]) - r) / (n - 1))
    return out


def ref_reinforce_pp_sample(rewards, groups, lengths):
    m, s = _mean(rewards), _std(rewards)
    return [(r - m) / (s + EPS) for r in rewards]


def ref_reinforce_pp_baseline_sample(rewards, groups, lengths):
    x = ref_dr_grpo(rewards, groups, lengths)
    m, s = _mean(x), _std(x)
    return [(v - m) / (s + EPS) for v in x]


def _token_whitened(values, lengths):
    """Whitening over tokens, as verl's masked_whiten: each token's return is its sequence's value."""
    tokens = [v for v, n in zip(values, lengths) for _ in range(n)]
    if not tokens:
        return [0.0] * len(values)
    m, s = _mean(tokens), _std(tokens)
    return [(v - m) / (s + EPS) for v in values]


def ref_reinforce_pp(rewards, groups, lengths):
    return _token_whitened(rewards, lengths)


def ref_reinforce_pp_baseline(rewards, groups, lengths):
    return _token_whitened(ref_dr_grpo(rewards, groups, lengths), lengths)


REFS = {
    "grpo": ref_grpo,
    "dr_grpo": ref_dr_grpo,
    "grpo_batch_std": ref_grpo_batch_std,
    "rloo": ref_rloo,
    "reinforce_pp": ref_reinforce_pp,
    "reinforce_pp_sample": ref_reinforce_pp_sample,
    "reinforce_pp_baseline": ref_reinforce_pp_baseline,
    "reinforce_pp_baseline_sample": ref_reinforce_pp_baseline_sample,
}
GROUP_BASELINES = ["grpo", "dr_grpo", "grpo_batch_std", "rloo", "reinforce_pp_baseline", "reinforce_pp_baseline_sample"]


def test_every_registered_estimator_has_a_reference():
    assert set(ADVANTAGES) == set(REFS)


def _case():
    rng = random.Random(0)
    # groups of sizes 4, 1, 3 (all equal), 5, interleaved labels that are not 0..G-1
    groups = [7] * 4 + [2] + [9] * 3 + [4] * 5
    rewards = [rng.random() for _ in range(4)] + [0.5] + [1.0] * 3 + [float(rng.randint(0, 1)) for _ in range(5)]
    lengths = [rng.randint(0, 9) for _ in groups]
    perm = list(range(len(groups)))
    rng.shuffle(perm)
    return [rewards[i] for i in perm], [groups[i] for i in perm], [lengths[i] for i in perm]


@pytest.mark.parametrize("name", sorted(REFS))
def test_matches_reference(name):
    rewards, groups, lengths = _case()
    got = ADVANTAGES[name](torch.tensor(rewards, dtype=torch.float64), torch.tensor(groups),
                           lengths=torch.tensor(lengths), eps=EPS)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, torch.tensor(REFS[name](rewards, groups, lengths), dtype=torch.float64))


@pytest.mark.parametrize("name", sorted(REFS))
def test_edge_cases_are_finite(name):
    fn = ADVANTAGES[name]
    # one sample; all groups of one; all rewards equal; no token trained on; one token in all
    for rewards, groups, lengths in [([1.0], [0], [3]), ([1.0, 0.0, 3.0], [0, 1, 2], [2, 5, 1]),
                                     ([2.0] * 6, [0, 0, 0, 1, 1, 1], [4] * 6), ([1.0, 0.0], [0, 0], [0, 0]),
                                     ([1.0, 0.0, 2.0], [0, 0, 1], [0, 1, 0])]:
        got = fn(torch.tensor(rewards), torch.tensor(groups), lengths=torch.tensor(lengths), eps=EPS)
        assert got.shape == (len(rewards),) and got.dtype == torch.float32
        assert torch.isfinite(got).all()
        want = REFS[name](rewards, groups, lengths)
        torch.testing.assert_close(got.double(), torch.tensor(want, dtype=torch.float64))


def test_hand_values():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 5.0])
    g = torch.tensor([0, 0, 0, 0, 1])
    n = torch.ones(5)
    # group 0: mean 0.5; the group of one gets 0 everywhere
    torch.testing.assert_close(ADVANTAGES["dr_grpo"](r, g, lengths=n), torch.tensor([0.5, -0.5, -0.5, 0.5, 0.0]))
    # rloo: 1 - (0+0+1)/3 = 2/3, 0 - (1+0+1)/3 = -2/3
    torch.testing.assert_close(ADVANTAGES["rloo"](r, g, lengths=n), torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0.0]))
    # group std (unbiased) of [1,0,0,1] = sqrt(1/3)
    a = ADVANTAGES["grpo"](r, g, lengths=n, eps=0.0)
    torch.testing.assert_close(a[:4], torch.tensor([1.0, -1.0, -1.0, 1.0]) * 0.5 / math.sqrt(1 / 3))
    assert a[4] == 0


def test_all_equal_rewards_give_zero_for_group_baselines():
    r, g = torch.full((8,), 0.7), torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    for name in sorted(ADVANTAGES):
        assert torch.allclose(ADVANTAGES[name](r, g, lengths=torch.arange(8)), torch.zeros(8), atol=1e-6), name


def test_zero_eps_never_nan():
    r, g = torch.tensor([1.0, 1.0, 2.0]), torch.tensor([0, 0, 1])
    for name in ["grpo", "grpo_batch_std", "reinforce_pp", "reinforce_pp_sample", "reinforce_pp_baseline",
                 "reinforce_pp_baseline_sample"]:
        assert torch.isfinite(ADVANTAGES[name](r, g, lengths=torch.tensor([3, 1, 2]), eps=0.0)).all(), name
        one = torch.ones(1), torch.zeros(1, dtype=torch.long)
        assert torch.isfinite(ADVANTAGES[name](*one, lengths=torch.ones(1), eps=0.0)).all()


def test_reinforce_pp_whitens_over_tokens():
    """REINFORCE++ (and verl) whiten the per-token returns: with outcome rewards a sample of n tokens counts n
    times in the mean and std; the per-sample variant counts each once."""
    r, g = torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64), torch.tensor([0, 1, 2])
    long_right = ADVANTAGES["reinforce_pp"](r, g, lengths=torch.tensor([8, 1, 1]), eps=0.0)
    tokens = torch.tensor([1.0] * 8 + [0.0, 0.0], dtype=torch.float64)
    torch.testing.assert_close(long_right, (r - tokens.mean()) / tokens.std())
    even = ADVANTAGES["reinforce_pp"](r, g, lengths=torch.tensor([4, 4, 4]), eps=0.0)
    assert long_right[0] < even[0]  # the long right answer sets the mean: it stands out less
    torch.testing.assert_close(ADVANTAGES["reinforce_pp_sample"](r, g, lengths=torch.tensor([8, 1, 1]), eps=0.0),
                               (r - r.mean()) / r.std())


def test_only_reinforce_pp_reads_lengths():
    rewards, groups, _ = _case()
    r, g = torch.tensor(rewards, dtype=torch.float64), torch.tensor(groups)
    for name in sorted(ADVANTAGES):
        a, b = (ADVANTAGES[name](r, g, lengths=n, eps=EPS) for n in (torch.ones(len(r)), torch.arange(len(r)) + 1))
        assert torch.equal(a, b) == (name not in ("reinforce_pp", "reinforce_pp_baseline")), name


@pytest.mark.parametrize("name", GROUP_BASELINES)
def test_a_group_of_one_learns_nothing_from_its_own_reward(name):
    """tandem's convention (verl differs: its baseline for a lone sample is 0, so the raw reward is the advantage):
    a group of one is its own baseline, so its reward cannot move its advantage; 0 under GRPO, Dr. GRPO, batch-std
    and RLOO, and the batch's shift under REINFORCE++-baseline's whitening."""
    g, n = torch.tensor([0, 0, 0, 1]), torch.tensor([3, 5, 2, 4])
    lone = [ADVANTAGES[name](torch.tensor([1.0, 0.0, 0.5, r]), g, lengths=n, eps=EPS)[3] for r in (-3.0, 0.0, 7.0)]
    assert lone[0] == lone[1] == lone[2]
    if not name.startswith("reinforce_pp"):
        assert lone[0] == 0


def test_lengths_must_match_the_rewards():
    with pytest.raises(ValueError, match=r"lengths: shape \(2,\) does not match rewards \(3,\)"):
        ADVANTAGES["reinforce_pp"](torch.ones(3), torch.zeros(3, dtype=torch.long), lengths=torch.ones(2))
