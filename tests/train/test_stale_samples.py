"""Asynchronous sampling's loss: the ratio is taken against the sampler's logprobs (the behaviour policy)."""
from __future__ import annotations

import pytest
import torch

from tandem.config import AlgoConfig, OldLogprobs, OptimConfig
from tandem.rollout.base import Completion, Samples
from tandem.train.batch import make_micro_batches
from tandem.train.logprobs import token_logprobs
from tandem.train.policy import Policy


def _batch(policy: Policy, shift: float):
    """Completions whose sampler logprobs are the current policy's minus `shift`: a sampler that was behind."""
    g = torch.Generator().manual_seed(0)
    comps = [Completion(torch.randint(5, 200, (4,), generator=g).tolist(),
                        torch.randint(5, 200, (3,), generator=g).tolist(), [0.0] * 3, "", "stop", i // 4)
             for i in range(8)]
    mbs = make_micro_batches(Samples.of_call(comps), 4096, 0)
    with torch.no_grad():
        for mb in mbs:
            logp, _ = token_logprobs(policy.model, mb, 1.0)
            mb.sampler_logprobs = (logp - shift) * mb.mask
    return [mbs]


@pytest.mark.parametrize("tis_cap", [None, 2.0])
def test_stale_samples_use_the_sampler_as_behaviour_policy(tiny_model, tis_cap):
    algo = AlgoConfig(clip_low=0.2, clip_high=0.2, tis_cap=tis_cap)
    fresh = Policy(str(tiny_model), "float32", False, algo, OptimConfig(lr=1e-3), 10, 1.0, 3)
    # what Config.old_logprobs resolves for asynchronous sampling (tests/core/test_config_and_inputs.py)
    source = OldLogprobs.SAMPLER if tis_cap is None else OldLogprobs.RECOMPUTED
    stale = Policy(str(tiny_model), "float32", False, algo, OptimConfig(lr=1e-3), 10, 1.0, 3, old_logprobs=source)
    for policy in (fresh, stale):
        mini = _batch(policy, 0.5)
        policy.stats = policy.update(policy.prepare(mini, 8), torch.ones(8))
    # trained on its own (recomputed) logprobs the ratio is 1; the sampler's differ, which TIS alone corrects
    assert fresh.stats["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert fresh.stats["logprob_diff"] == pytest.approx(0.5, abs=1e-5)
    if tis_cap is None:
        # against the stale sampler the ratio is e^0.5 = 1.65 on every token: all clipped (A > 0, 1.65 > 1.2)
        assert stale.stats["ratio_mean"] == pytest.approx(torch.e ** 0.5, rel=1e-4)
        assert stale.stats["clip_frac"] == pytest.approx(1.0)
        assert stale.stats["logprob_diff"] == pytest.approx(0.5, abs=1e-5)  # measured in the update's first pass
    else:
        # decoupled: old logprobs recomputed (ratio 1), the sampler gap goes into the capped importance weight
        assert stale.stats["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
        assert stale.stats["tis_capped_frac"] == pytest.approx(0.0)


def test_dual_clip_fraction_is_reported(tiny_model):
    """A sampler one nat behind on every token (ratio e = 2.72 > dual clip 1.5) with negative advantages: the dual
    clip binds on every token, and the step's stats say so."""
    policy = Policy(str(tiny_model), "float32", False, AlgoConfig(dual_clip=1.5), OptimConfig(lr=1e-3), 10, 1.0, 3,
                    old_logprobs=OldLogprobs.SAMPLER)
    stats = policy.update(policy.prepare(_batch(policy, 1.0), 8), -torch.ones(8))
    assert stats["dual_clip_frac"] == pytest.approx(1.0)
    assert stats["ratio_mean"] == pytest.approx(torch.e, rel=1e-4)
