"""Gradient checks: a tiny float64 policy (a linear layer producing logits); the autograd gradient of every
loss, through aggregation (with TIS weights, a KL term and an entropy bonus), matches finite differences; and each
KL estimator's expected gradient, with and without the ratio correction, matches its exact expectation's."""
import pytest
import torch

from tandem.algo import (
    AGGREGATIONS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    LossParams,
    LossSpec,
    aggregation_totals,
    entropy_from_logits,
    entropy_loss_term,
    kl_loss_term,
    tis_weights,
    token_loss,
)

B, T, H, V, MAX_LEN = 4, 5, 3, 6, 8
torch.manual_seed(0)
X = torch.randn(B, T, H, dtype=torch.float64)
TOKENS = torch.randint(0, V, (B, T))
W0 = torch.randn(V, H, dtype=torch.float64) * 0.5
MASK = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [0, 0, 0, 0, 0], [1, 1, 0, 0, 0]], dtype=torch.float64)
ADV = torch.tensor([1.3, -0.8, 0.5, -1.1], dtype=torch.float64)


def policy(w):
    logits = X @ w.T
    logp = torch.log_softmax(logits, -1).gather(-1, TOKENS[..., None]).squeeze(-1)
    return logits, logp


def _logp_of(w):
    with torch.no_grad():
        return policy(w)[1]


def _old(scale, seed=1):
    g = torch.Generator().manual_seed(seed)
    return _logp_of(W0 + torch.randn(V, H, generator=g, dtype=torch.float64) * scale)


TOTALS = aggregation_totals(MASK)


def objective(w, name, params, agg, old, ref, sampler, kl_coef=0.1, ent_coef=0.01):
    logits, logp = policy(w)
    loss, _ = POLICY_LOSSES[name](logp, old, ADV, MASK, params)
    if sampler is not None:
        loss = loss * tis_weights(old, sampler, MASK, cap=1.5)[0]
    loss = loss + kl_loss_term(KL_ESTIMATORS["k3"](logp, ref), MASK, kl_coef)
    loss = loss + entropy_loss_term(entropy_from_logits(logits), MASK, ent_coef)
    return AGGREGATIONS[agg](loss, MASK, *TOTALS, MAX_LEN)


CASES = [
    ("clip", LossParams(), 0.3),
    ("clip", LossParams(clip_low=0.2, clip_high=0.28, dual_clip=1.2), 0.6),
    ("gspo", LossParams(), 1e-4),  # GSPO's own tiny range, near on-policy
    ("gspo", LossParams(), 0.3),  # off-policy: one sequence clipped (no gradient), the others not
]


@pytest.mark.parametrize("agg", sorted(AGGREGATIONS))
@pytest.mark.parametrize("name,params,scale", CASES)
def test_gradcheck(name, params, scale, agg):
    old, ref, sampler = _old(scale, 1), _old(0.3, 2), _old(0.3, 3)
    if name == "gspo":
        # Token TIS weights are not constant along a sequence, so they would turn GSPO's token form into a
        # gradient that is no longer the derivative of its value; GSPO is checked without them.
        sampler = None
    w = W0.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda w: objective(w, name, params, agg, old, ref, sampler), (w,), eps=1e-6, atol=1e-6, rtol=1e-4
    )


def _central_diff(f, w, h=1e-6):
    g = torch.zeros_like(w)
    for i in range(w.numel()):
        e = torch.zeros_like(w).view(-1)
        e[i] = h
        e = e.view_as(w)
        g.view(-1)[i] = (f(w + e) - f(w - e)) / (2 * h)
    return g


def _autograd(f, w):
    w = w.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(f(w), w)
    return g


@pytest.mark.parametrize("params,scale", [(LossParams(), 1e-4), (LossParams(), 0.3)])
def test_gspo_token_form_reproduces_the_sequence_objective(params, scale):
    """GSPO per-token loss aggregated by seq_mean_token_mean == GSPO's sequence objective (value and gradient)."""
    old = _old(scale)

    def token_form(w):
        loss, _ = POLICY_LOSSES["gspo"](policy(w)[1], old, ADV, MASK, params)
        return AGGREGATIONS["seq_mean_token_mean"](loss, MASK, *TOTALS, MAX_LEN)

    def sequence_objective(w):  # written out: J = mean over non-empty sequences of -min(s A, clip(s) A)
        logp = policy(w)[1]
        terms = []
        for i in range(B):
            n = MASK[i].sum()
            if n == 0:
                continue
            s = torch.exp(((logp[i] - old[i]) * MASK[i]).sum() / n)
            clipped = s.clamp(1 - params.seq_clip_low, 1 + params.seq_clip_high)
            terms.append(-torch.minimum(s * ADV[i], clipped * ADV[i]))
        return torch.stack(terms).mean()

    torch.testing.assert_close(token_form(W0), sequence_objective(W0))
    if scale > 0.1:
        _, m = POLICY_LOSSES["gspo"](_logp_of(W0), old, ADV, MASK, params)
        assert 0 < m["clip_frac"][:, 0].sum() < B - 1  # both regimes exercised
    g = _autograd(token_form, W0)
    torch.testing.assert_close(g, _autograd(sequence_objective, W0))
    torch.testing.assert_close(g, _central_diff(sequence_objective, W0), atol=1e-7, rtol=1e-5)
    assert g.abs().sum() > 0


@pytest.mark.parametrize("agg", sorted(AGGREGATIONS))
@pytest.mark.parametrize("clip_low", [1.0, 0.2])  # the paper's upper bound only; verl's both bounds
def test_cispo_gradient_is_weighted_reinforce(agg, clip_low):
    """CISPO's gradient = gradient of sum_t sg(clip(ratio, 1 - eps_low, 1 + eps_high)) * A * logp_t, weights frozen
    at W0."""
    params = LossParams(clip_low=clip_low, clip_high=0.1)
    old = _old(0.4)
    w_frozen = torch.exp(_logp_of(W0) - old).clamp(max=1.1)
    assert (w_frozen == 1.1).any() and (w_frozen < 1.1).any()  # both regimes exercised
    if clip_low < 1:
        assert (w_frozen < 1 - clip_low).any()  # the lower bound too
        w_frozen = w_frozen.clamp(min=1 - clip_low)

    def cispo(w):
        loss, _ = POLICY_LOSSES["cispo"](policy(w)[1], old, ADV, MASK, params)
        return AGGREGATIONS[agg](loss, MASK, *TOTALS, MAX_LEN)

    def reference(w):
        return AGGREGATIONS[agg](-w_frozen * ADV[:, None] * policy(w)[1] * MASK, MASK, *TOTALS, MAX_LEN)

    torch.testing.assert_close(_autograd(cispo, W0), _central_diff(reference, W0), atol=1e-7, rtol=1e-5)


# The KL term's gradient convention, exactly: on a small categorical pi = softmax(theta) sampled at theta_old, the
# expected gradient of a token's KL term, sum_x pi_old(x) d/dtheta term(x) at theta = theta_old, against autograd of
# an exact expectation. k3 alone (DeepSeekMath, verl) has E[grad k3] = grad KL(ref || pi), the forward KL; times the
# ratio pi / pi_old (TRL's use_bias_correction_kl), E_old[grad (r k)] = grad E_pi[k], which for an unbiased
# estimator (k1, k3) is grad KL(pi || ref), the reverse KL the penalty is named after.
THETA = torch.tensor([0.3, -1.2, 0.8, 0.0, 2.1], dtype=torch.float64)
REF_THETA = torch.tensor([0.9, -0.4, 0.1, 0.5, 1.0], dtype=torch.float64)


def _forward_kl(theta):  # KL(ref || pi)
    ref = torch.log_softmax(REF_THETA, -1)
    return (ref.exp() * (ref - torch.log_softmax(theta, -1))).sum()


def _reverse_kl(theta):  # KL(pi || ref)
    logp = torch.log_softmax(theta, -1)
    return (logp.exp() * (logp - torch.log_softmax(REF_THETA, -1))).sum()


def _k2_expectation(theta):  # E_pi[k2]: not a KL
    logp = torch.log_softmax(theta, -1)
    return (logp.exp() * 0.5 * (logp - torch.log_softmax(REF_THETA, -1)) ** 2).sum()


def _zero(theta):
    return (theta * 0).sum()


def _expected_kl_term_gradient(estimator: str, correction: bool) -> torch.Tensor:
    theta = THETA.clone().requires_grad_(True)
    logp = torch.log_softmax(theta, -1)[None]  # every category x as one "token" [1, V]
    ref = torch.log_softmax(REF_THETA, -1)[None]
    spec = LossSpec(kl_coef=1.0, kl_estimator=estimator, kl_ratio_correction=correction)
    zero_adv = torch.zeros(1, dtype=torch.float64)  # the policy loss then adds nothing, value or gradient
    term, _ = token_loss(spec, logp, zero_adv, torch.ones_like(logp), ref_logp=ref)  # old_logp None: theta = theta_old
    (g,) = torch.autograd.grad((logp.detach().exp() * term).sum(), theta)
    return g


@pytest.mark.parametrize("estimator, correction, exact", [
    ("k3", False, _forward_kl), ("k3", True, _reverse_kl),
    ("k1", False, _zero), ("k1", True, _reverse_kl),
    ("k2", False, _reverse_kl), ("k2", True, _k2_expectation),
])
def test_kl_term_gradient_convention(estimator, correction, exact):
    want = _autograd(exact, THETA)
    assert exact is _zero or want.abs().max() > 1e-2  # a gradient worth comparing
    torch.testing.assert_close(_expected_kl_term_gradient(estimator, correction), want, atol=1e-8, rtol=0)
