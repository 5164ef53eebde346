"""Policy losses, KL estimators and entropy against plain-Python references, plus extreme and masked inputs."""
import math

import pytest
import torch

from tandem.algo import KL_ESTIMATORS, POLICY_LOSSES, LossParams, entropy_from_logits, entropy_loss_term, kl_loss_term

B, T = 3, 5


def _inputs(seed=0, scale=0.5):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    old = logp + torch.randn(B, T, generator=g, dtype=torch.float64) * scale
    adv = torch.tensor([1.5, -2.0, 0.7], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.float64)
    return logp, old, adv, mask


def _clamp(x, lo, hi):
    return max(lo, min(hi, x))


def ref_clip(logp, old, adv, mask, p: LossParams):
    out = [[0.0] * T for _ in range(B)]
    for i in range(B):
        for t in range(T):
            r = math.exp(_clamp(logp[i][t] - old[i][t], -20, 20))
            a = adv[i]
            loss = -min(r * a, _clamp(r, 1 - p.clip_low, 1 + p.clip_high) * a)
            if p.dual_clip is not None and a < 0:
                loss = min(loss, -p.dual_clip * a)
            out[i][t] = loss * mask[i][t]
    return out


def ref_gspo(logp, old, adv, mask, p: LossParams):
    out = [[0.0] * T for _ in range(B)]
    for i in range(B):
        n = sum(mask[i])
        lr = sum((logp[i][t] - old[i][t]) * mask[i][t] for t in range(T)) / max(n, 1)
        s = math.exp(_clamp(lr, -20, 20))
        a = adv[i]
        loss = -min(s * a, _clamp(s, 1 - p.seq_clip_low, 1 + p.seq_clip_high) * a)
        for t in range(T):
            out[i][t] = loss * mask[i][t]
    return out


def ref_cispo(logp, old, adv, mask, p: LossParams):
    return [[-_clamp(math.exp(_clamp(logp[i][t] - old[i][t], -20, 20)), 1 - p.clip_low, 1 + p.clip_high) * adv[i]
             * mask[i][t] for t in range(T)] for i in range(B)]


CASES = [
    ("clip", ref_clip, LossParams()),
    ("clip", ref_clip, LossParams(clip_low=0.2, clip_high=0.28)),
    ("clip", ref_clip, LossParams(dual_clip=1.5)),
    ("gspo", ref_gspo, LossParams()),
    ("gspo", ref_gspo, LossParams(seq_clip_low=0.1, seq_clip_high=0.2)),
    ("cispo", ref_cispo, LossParams(clip_low=1.0, clip_high=0.3)),  # the paper's upper bound only
    ("cispo", ref_cispo, LossParams(clip_low=0.2, clip_high=0.3)),  # verl's: both bounds
]


def test_every_loss_has_a_case():
    assert {c[0] for c in CASES} == set(POLICY_LOSSES)


@pytest.mark.parametrize("name,ref,params", CASES)
@pytest.mark.parametrize("scale", [0.05, 0.5, 100.0])  # near on-policy, off-policy, extreme ratios
def test_loss_matches_reference(name, ref, params, scale):
    logp, old, adv, mask = _inputs(scale=scale)
    loss, metrics = POLICY_LOSSES[name](logp, old, adv, mask, params)
    assert loss.shape == (B, T) and torch.isfinite(loss).all()
    expect = torch.tensor(ref(logp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), params), dtype=torch.float64)
    torch.testing.assert_close(loss, expect)
    for k, v in metrics.items():
        assert v.shape == (B, T) and torch.isfinite(v).all() and not v.requires_grad, k
        assert ((v == 0) | (v == 1)).all() or k == "ratio"


def test_clip_hand_values():
    # ratio 2, A = 1: clipped at 1.2 -> loss -1.2; ratio 2, A = -1: -min(-2, -1.2) = 2; dual clip 1.5 caps it.
    logp = torch.log(torch.tensor([[2.0, 2.0]]))
    old = torch.zeros(1, 2)
    mask = torch.ones(1, 2)
    loss, m = POLICY_LOSSES["clip"](logp, old, torch.tensor([1.0]), mask, LossParams())
    torch.testing.assert_close(loss, torch.tensor([[-1.2, -1.2]]))
    assert m["clip_frac"].tolist() == [[1.0, 1.0]]
    loss, _ = POLICY_LOSSES["clip"](logp, old, torch.tensor([-1.0]), mask, LossParams())
    torch.testing.assert_close(loss, torch.tensor([[2.0, 2.0]]))
    loss, m = POLICY_LOSSES["clip"](logp, old, torch.tensor([-1.0]), mask, LossParams(dual_clip=1.5))
    torch.testing.assert_close(loss, torch.tensor([[1.5, 1.5]]))
    assert m["dual_clip_frac"].tolist() == [[1.0, 1.0]]


def test_dual_clip_must_exceed_one():
    with pytest.raises(ValueError):
        LossParams(dual_clip=1.0)


def test_gspo_ratio_is_per_sequence():
    logp, old, adv, mask = _inputs()
    _, m = POLICY_LOSSES["gspo"](logp, old, adv, mask, LossParams())
    for i in range(B):
        s = math.exp(((logp[i] - old[i]) * mask[i]).sum().item() / mask[i].sum().item())
        assert torch.allclose(m["ratio"][i], torch.full((T,), s, dtype=torch.float64))


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_fully_masked_rows_and_extreme_ratios(name):
    logp = torch.tensor([[0.0, -1e4, -3.0], [-1e4, 0.0, 0.0]], requires_grad=True)
    old = torch.tensor([[-1e4, 0.0, -3.0], [0.0, -1e4, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    for params in [LossParams(), LossParams(dual_clip=3.0)]:
        loss, metrics = POLICY_LOSSES[name](logp, old, torch.tensor([2.0, -1.0]), mask, params)
        assert torch.isfinite(loss).all() and (loss[1] == 0).all()
        assert all(torch.isfinite(v).all() for v in metrics.values())
        loss.sum().backward()
        assert torch.isfinite(logp.grad).all()
        logp.grad = None


@pytest.mark.parametrize("name", ["k1", "k2", "k3"])
def test_kl_estimators(name):
    logp = torch.tensor([[-1.0, -2.0, 0.0, -50.0]])
    ref = torch.tensor([[-1.5, -1.0, -60.0, 0.0]])
    refs = {
        "k1": lambda a, b: a - b,
        "k2": lambda a, b: 0.5 * (a - b) ** 2,
        "k3": lambda a, b: math.exp(_clamp(b - a, -20, 20)) - _clamp(b - a, -20, 20) - 1,
    }
    got = KL_ESTIMATORS[name](logp, ref)
    expect = torch.tensor([[refs[name](a, b) for a, b in zip(logp[0].tolist(), ref[0].tolist())]])
    torch.testing.assert_close(got, expect)
    assert torch.isfinite(got).all()


def test_entropy_and_terms():
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, -1e4]]], dtype=torch.float64)
    h = entropy_from_logits(logits)
    assert h.dtype == torch.float64
    torch.testing.assert_close(h, torch.tensor([[math.log(4), 0.0]], dtype=torch.float64), atol=1e-12, rtol=0)
    assert entropy_from_logits(logits.bfloat16()).dtype == torch.float32
    mask = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(entropy_loss_term(h, mask, 0.01),
                               torch.tensor([[-0.01 * math.log(4), 0.0]], dtype=torch.float64))
    torch.testing.assert_close(kl_loss_term(torch.tensor([[2.0, 5.0]]), mask.float(), 0.1), torch.tensor([[0.2, 0.0]]))


def test_cispo_applies_clip_low():
    """The weight is clamp(ratio, 1 - clip_low, 1 + clip_high): a ratio of 0.5 weighs 0.8 under clip_low 0.2, and
    0.5 itself with clip_low >= 1 (no lower bound, as in the paper); either bound counts as clipped."""
    logp, old, mask = torch.log(torch.tensor([[0.5, 1.0, 2.0]])), torch.zeros(1, 3), torch.ones(1, 3)
    loss, m = POLICY_LOSSES["cispo"](logp, old, torch.tensor([1.0]), mask, LossParams(clip_low=0.2, clip_high=0.28))
    torch.testing.assert_close(loss, -torch.tensor([[0.8, 1.0, 1.28]]))
    assert m["clip_frac"].tolist() == [[1.0, 0.0, 1.0]]
    loss, m = POLICY_LOSSES["cispo"](logp, old, torch.tensor([1.0]), mask, LossParams(clip_low=10.0, clip_high=0.28))
    torch.testing.assert_close(loss, -torch.tensor([[0.5, 1.0, 1.28]]))
    assert m["clip_frac"].tolist() == [[0.0, 0.0, 1.0]]


def test_clip_low_of_one_or_more_means_no_lower_bound():
    from tandem.config import AlgoConfig

    assert AlgoConfig(clip_low=10.0).clip_low == 10.0  # verl's CISPO example: off
    logp, old, mask = torch.log(torch.tensor([[0.1]])), torch.zeros(1, 1), torch.ones(1, 1)
    loss, m = POLICY_LOSSES["clip"](logp, old, torch.tensor([-1.0]), mask, LossParams(clip_low=1.0))
    torch.testing.assert_close(loss, torch.tensor([[0.1]]))  # -min(0.1 * -1, clamp(0.1, 0, 1.2) * -1)
    assert m["clip_frac"].tolist() == [[0.0]]
