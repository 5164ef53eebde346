"""Masked importance sampling (IcePop by token, MIS by sequence) against a float64 reference written out by hand."""
import math

import pytest
import torch

from tandem.algo import IS_MASKS, LossSpec, icepop_weights, sequence_masked_weights, token_loss
from tandem.config import ConfigError, load_config

LOW, HIGH = 0.5, 2.0
# log ratios pi_old / pi_sampler: inside the band, near its edges, outside on both sides, and on padding
LOG_R = torch.tensor([[0.1, math.log(1.99), math.log(2.5), -0.3, 9.0],
                      [math.log(0.51), math.log(0.2), math.log(0.6), 0.0, 0.0],
                      [0.2, 0.3, 0.25, 0.1, 0.15]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.float64)


def _logps():
    sampler = torch.linspace(-3.0, -0.5, LOG_R.numel(), dtype=torch.float64).view_as(LOG_R)
    return sampler + LOG_R, sampler


def test_icepop_keeps_each_token_inside_the_band_at_its_ratio_and_masks_the_rest():
    old, sampler = _logps()
    w, masked = icepop_weights(old, sampler, MASK, LOW, HIGH)
    for b in range(3):
        for t in range(5):
            r = math.exp(LOG_R[b, t].item())
            real = MASK[b, t].item() == 1
            inside = LOW <= r <= HIGH
            assert w[b, t].item() == pytest.approx(r if real and inside else 0.0, rel=1e-12, abs=0.0)
            assert masked[b, t].item() == (1.0 if real and not inside else 0.0)
    # padding is neither weighted nor counted as masked, however far its ratio (9.0 above)
    assert w[0, 4] == 0 and masked[0, 4] == 0
    assert masked.sum().item() == 2  # 2.5 above the band, 0.2 below


def test_sequence_mask_weighs_each_sequence_by_its_geometric_mean_ratio_or_masks_it_whole():
    old, sampler = _logps()
    w, masked = sequence_masked_weights(old, sampler, MASK, LOW, HIGH)
    for b in range(3):
        real = [t for t in range(5) if MASK[b, t] == 1]
        rho = math.exp(sum(LOG_R[b, t].item() for t in real) / len(real))
        inside = LOW <= rho <= HIGH
        for t in range(5):
            expect = rho if (t in real and inside) else 0.0
            assert w[b, t].item() == pytest.approx(expect, rel=1e-12, abs=0.0)
            assert masked[b, t].item() == (1.0 if t in real and not inside else 0.0)
    assert masked[0].sum() == 0 and masked[2].sum() == 0  # rho ~1.4 and ~1.2: kept whole
    seq1 = (0.51 * 0.2 * 0.6) ** (1 / 3)
    assert seq1 < LOW and masked[1].sum() == 3  # one sequence out of the band: all its real tokens masked


def test_masked_weights_carry_no_gradient():
    old, sampler = _logps()
    old, sampler = old.clone().requires_grad_(), sampler.clone().requires_grad_()
    for fn in IS_MASKS.values():
        assert not fn(old, sampler, MASK, LOW, HIGH)[0].requires_grad


@pytest.mark.parametrize("kind", ["token", "sequence"])
def test_token_loss_drops_masked_tokens_from_the_gradient_and_reports_them(kind):
    old, sampler = _logps()
    logp = old.clone().requires_grad_()  # on the old policy: ratio 1, the loss is -A x weight per token
    adv = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    spec = LossSpec(is_mask=kind, is_mask_band=(LOW, HIGH))
    loss, metrics = token_loss(spec, logp, adv[:, None].expand_as(logp), MASK, old_logp=old, sampler_logp=sampler)
    (loss * MASK).sum().backward()
    weight, masked = IS_MASKS[kind](old, sampler, MASK, LOW, HIGH)
    assert torch.equal(metrics["is_masked"], masked)
    # d(-A r w)/d logp = -A w at r = 1: zero exactly where the band masked a token
    assert torch.allclose(logp.grad, -adv[:, None] * weight * MASK, rtol=1e-12, atol=0)
    assert torch.all(logp.grad[masked > 0] == 0)
    with pytest.raises(ValueError, match="sampler_logp"):
        token_loss(spec, logp, adv[:, None].expand_as(logp), MASK, old_logp=old)


def test_config_refuses_is_mask_with_tis_and_a_band_without_one():
    with pytest.raises(ConfigError, match="tis_cap"):
        load_config(None, ["algo.is_mask=token", "algo.tis_cap=2.0"])
    with pytest.raises(ConfigError, match="is_mask_band"):
        load_config(None, ["algo.is_mask=sequence", "algo.is_mask_band=[1.2, 3.0]"])
    cfg = load_config(None, ["algo.is_mask=token", "placement.schedule=stream"])
    assert cfg.old_logprobs.name == "RECOMPUTED"  # the band compares the trainer's old policy with the sampler's
