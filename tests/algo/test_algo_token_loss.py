"""`token_loss`, the per-token loss training runs, against the inline composition of its registered parts."""
import itertools

import pytest
import torch

from tandem.algo import (
    KL_ESTIMATORS,
    POLICY_LOSSES,
    LossParams,
    LossSpec,
    entropy_from_logits,
    entropy_from_logprobs,
    entropy_loss_term,
    kl_loss_term,
    tis_weights,
    token_loss,
)
from tandem.config import AlgoConfig

B, T, V = 3, 5, 7


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, V, (B, T), generator=g)
    noisy = lambda: torch.log_softmax(torch.randn(B, T, V, generator=g, dtype=torch.float64), -1).gather(  # noqa: E731
        -1, targets[..., None]).squeeze(-1)
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.float64)
    adv = torch.tensor([1.5, -2.0, 0.7], dtype=torch.float64)
    return logits, targets, mask, adv, noisy(), noisy(), noisy()


def _logp(logits, targets):
    logp_all = torch.log_softmax(logits, -1)
    return logp_all.gather(-1, targets[..., None]).squeeze(-1), entropy_from_logprobs(logp_all)


def _inline(spec: LossSpec, logp, adv, mask, old, sampler, ref, entropy):
    """What `Policy.update` composed inline before `token_loss` existed, op for op."""
    old = logp.detach() if old is None else old
    loss, m = POLICY_LOSSES[spec.policy_loss](logp, old, adv, mask, spec.params)
    if spec.tis_cap is not None:
        w, m["tis_capped"] = tis_weights(old, sampler, mask, spec.tis_cap)
        loss = loss * w
    if spec.kl_coef > 0:
        kl = KL_ESTIMATORS[spec.kl_estimator](logp, ref)
        loss = loss + kl_loss_term(kl, mask, spec.kl_coef)
        m["kl"] = kl.detach()
    if spec.entropy_coef > 0:
        loss = loss + entropy_loss_term(entropy, mask, spec.entropy_coef)
    return loss, m


SPECS = [
    LossSpec(policy_loss=name, params=params, kl_coef=kl, kl_estimator=est, entropy_coef=ent, tis_cap=tis)
    for name, (params, kl, est, ent, tis) in itertools.product(
        sorted(POLICY_LOSSES),
        [(LossParams(), 0.0, "k3", 0.0, None), (LossParams(dual_clip=1.5), 0.1, "k3", 0.0, None),
         (LossParams(clip_high=0.28), 0.0, "k3", 0.01, 1.5), (LossParams(), 0.05, "k2", 0.02, 2.0)])
]


def _spec_id(s: LossSpec) -> str:
    return f"{s.policy_loss}-kl{s.kl_coef}-ent{s.entropy_coef}-tis{s.tis_cap}"


@pytest.mark.parametrize("spec", SPECS, ids=_spec_id)
@pytest.mark.parametrize("on_policy", [True, False])
def test_equals_the_inline_composition_bitwise(spec, on_policy):
    logits, targets, mask, adv, old, sampler, ref = _inputs()
    old = None if on_policy else old

    def run(compose):
        logits.grad = None
        logp, entropy = _logp(logits, targets)
        loss, m = compose(logp, entropy)
        (loss * mask).sum().backward()
        return loss.detach(), m, logits.grad.clone()

    loss, m, grad = run(lambda logp, entropy: token_loss(spec, logp, adv, mask, old_logp=old, sampler_logp=sampler,
                                                         ref_logp=ref, entropy=entropy))
    want, want_m, want_grad = run(lambda logp, entropy: _inline(spec, logp, adv, mask, old, sampler, ref, entropy))
    assert torch.equal(loss, want) and torch.equal(grad, want_grad)
    assert set(m) == set(want_m) and all(torch.equal(m[k], want_m[k]) for k in m)
    expected = {"clip_frac", "ratio"} | ({"dual_clip_frac"} if spec.params.dual_clip and spec.policy_loss == "clip"
                                        else set())
    expected |= {"tis_capped"} if spec.tis_cap else set()
    expected |= {"kl"} if spec.kl_coef else set()
    assert set(m) == expected
    assert all(v.shape == (B, T) and not v.requires_grad for v in m.values())


def test_on_policy_is_ratio_one_and_the_policy_gradient():
    """old_logp None: the update's own forward is the old policy, so ratio = 1 and d loss / d logp = -A."""
    logits, targets, mask, adv, *_ = _inputs()
    logp, _ = _logp(logits, targets)
    leaf = logp.detach().requires_grad_(True)
    loss, m = token_loss(LossSpec(), leaf, adv, mask)
    assert torch.equal(m["ratio"], torch.ones_like(leaf)) and not m["clip_frac"].any()
    (loss * mask).sum().backward()
    torch.testing.assert_close(leaf.grad, -adv[:, None] * mask, rtol=0, atol=0)


def test_each_term_moves_the_loss():
    logits, targets, mask, adv, old, sampler, ref = _inputs()
    logp, entropy = _logp(logits.detach(), targets)
    kw = dict(old_logp=old, sampler_logp=sampler, ref_logp=ref, entropy=entropy)
    base, _ = token_loss(LossSpec(), logp, adv, mask, **kw)
    for spec in (LossSpec(kl_coef=0.1), LossSpec(entropy_coef=0.1), LossSpec(tis_cap=1.5)):
        loss, _ = token_loss(spec, logp, adv, mask, **kw)
        assert not torch.equal(loss, base), spec


@pytest.mark.parametrize("spec, missing", [
    (LossSpec(kl_coef=0.1), "ref_logp"), (LossSpec(tis_cap=2.0), "sampler_logp"),
    (LossSpec(entropy_coef=0.01), "entropy"),
    (LossSpec(policy_loss="nope"), "policy_loss"), (LossSpec(kl_coef=0.1, kl_estimator="k9"), "kl_estimator"),
])
def test_missing_inputs_are_named(spec, missing):
    _, _, mask, adv, *_ = _inputs()
    with pytest.raises(ValueError, match=missing):
        token_loss(spec, torch.zeros(B, T, dtype=torch.float64), adv, mask)


def test_from_algo():
    a = AlgoConfig(policy_loss="cispo", clip_low=0.1, clip_high=0.3, dual_clip=2.0, gspo_clip_low=1e-3,
                   gspo_clip_high=2e-3, kl_coef=0.04, kl_estimator="k2", entropy_coef=0.01, tis_cap=2.0,
                   kl_ratio_correction=True)
    assert LossSpec.from_algo(a) == LossSpec(
        policy_loss="cispo", params=LossParams(clip_low=0.1, clip_high=0.3, dual_clip=2.0, seq_clip_low=1e-3,
                                               seq_clip_high=2e-3),
        kl_coef=0.04, kl_estimator="k2", kl_ratio_correction=True, entropy_coef=0.01, tis_cap=2.0)
    assert LossSpec.from_algo(AlgoConfig()) == LossSpec()
    # the KL is in the reward then: no KL term in the loss
    assert LossSpec.from_algo(AlgoConfig(kl_coef=0.04, kl_in_reward=True)).kl_coef == 0.0


def test_entropy_from_logprobs_is_what_entropy_from_logits_computes():
    logits = torch.randn(2, 3, 11, dtype=torch.float32)
    logp_all = torch.log_softmax(logits, -1)
    assert torch.equal(entropy_from_logprobs(logp_all), -(logp_all.exp() * logp_all).sum(-1))
    assert torch.equal(entropy_from_logits(logits), entropy_from_logprobs(logp_all))


def test_ratio_correction_on_policy_keeps_the_value_and_moves_the_gradient():
    logits, targets, mask, adv, _, _, ref = _inputs()
    out = []
    for correction in (False, True):
        logits.grad = None
        logp, _ = _logp(logits, targets)
        loss, m = token_loss(LossSpec(kl_coef=0.1, kl_ratio_correction=correction), logp, adv, mask, ref_logp=ref)
        (loss * mask).sum().backward()
        out.append((loss.detach(), m["kl"], logits.grad.clone()))
    (loss, kl, grad), (loss_c, kl_c, grad_c) = out
    assert torch.equal(loss, loss_c) and torch.equal(kl, kl_c)  # the ratio is exactly 1 on policy
    assert (grad - grad_c).abs().max() > 1e-3
