"""DAPO's dynamic sampling, overlong shaping and filtering, TIS weights, KL-in-reward, totals."""
import math

import torch

from tandem.algo import (
    aggregation_totals,
    first_k_groups,
    kl_reward_penalty,
    nonzero_variance_groups,
    overlong_penalty,
    tis_weights,
    truncation_mask,
)


def test_nonzero_variance_groups():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 3.0, 0.0, 0.0])
    groups = torch.tensor([5, 5, 5, 2, 2, 8, 1, 1])  # mixed, all-equal, size one, all-equal zero
    ref = []
    for g in groups.tolist():
        vals = [r for r, h in zip(rewards.tolist(), groups.tolist()) if h == g]
        ref.append(max(vals) != min(vals))
    got = nonzero_variance_groups(rewards, groups)
    assert got.dtype == torch.bool and got.tolist() == ref == [True] * 3 + [False] * 5
    assert nonzero_variance_groups(torch.zeros(0), torch.zeros(0, dtype=torch.long)).numel() == 0


def test_first_k_groups():
    groups = torch.tensor([3, 3, 1, 1, 4, 4, 0, 0, 3])
    keep = torch.tensor([True, True, False, False, True, True, True, True, True])
    assert first_k_groups(groups, keep, 2).tolist() == [0, 1, 4, 5, 8]
    assert first_k_groups(groups, keep, 10).tolist() == [0, 1, 4, 5, 6, 7, 8]
    assert first_k_groups(groups, keep, 0).tolist() == []


def test_overlong_penalty():
    lengths = torch.tensor([0, 10, 12, 14, 16, 20])
    # max_len 16, buffer 4: ramp from length 12 to 16
    got = overlong_penalty(lengths, max_len=16, buffer=4, penalty_factor=2.0)
    ref = [0.0 if n <= 12 else -2.0 * min((n - 12) / 4, 1.0) for n in lengths.tolist()]
    torch.testing.assert_close(got, torch.tensor(ref))
    assert got.tolist() == [0.0, 0.0, 0.0, -1.0, -2.0, -2.0]
    step = overlong_penalty(lengths, max_len=16, buffer=0, penalty_factor=1.0)
    assert step.tolist() == [0.0, 0.0, 0.0, 0.0, 0.0, -1.0]


def test_truncation_mask_and_totals():
    t = torch.tensor([False, True, False])
    f = truncation_mask(t)
    assert f.tolist() == [1.0, 0.0, 1.0]
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0]]) * f[:, None]
    assert aggregation_totals(mask) == (3, 2)  # the filtered row counts as neither tokens nor a sequence


def test_tis_weights():
    old = torch.tensor([[0.0, -1.0, -50.0, 0.0], [-2.0, 30.0, 0.0, 0.0]])
    samp = torch.tensor([[-1.0, -1.0, 0.0, 0.0], [-1.0, -30.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    w, capped = tis_weights(old, samp, mask, cap=2.0)
    ref_w, ref_c = [], []
    for i in range(2):
        for j in range(4):
            r = math.exp(max(min(old[i, j] - samp[i, j], 20.0), -20.0))
            ref_w.append(min(r, 2.0) * mask[i, j].item())
            ref_c.append(float(r > 2.0 and mask[i, j] > 0))
    torch.testing.assert_close(w.flatten(), torch.tensor(ref_w))
    assert capped.flatten().tolist() == ref_c
    assert torch.isfinite(w).all() and not w.requires_grad
    old.requires_grad_(True)
    assert not tis_weights(old, samp, mask, 2.0)[0].requires_grad


def test_kl_reward_penalty():
    kl = torch.tensor([[0.1, 0.2, 9.0], [0.5, 0.5, 0.5], [1.0, 1.0, 1.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    got = kl_reward_penalty(kl, mask, coef=0.5)
    torch.testing.assert_close(got, torch.tensor([0.15, 0.75, 0.0]))
    assert not got.requires_grad
