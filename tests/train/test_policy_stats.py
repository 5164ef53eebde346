"""The update's statistics: every per-token metric of the loss is reported, token-weighted over the step."""
from __future__ import annotations

import pytest
import torch

from tandem.config import AlgoConfig, OldLogprobs, OptimConfig
from tandem.rollout.base import Completion, Samples
from tandem.train.batch import make_micro_batches
from tandem.train.policy import Policy, token_logprobs


def test_dual_clip_fraction_is_reported(tiny_model):
    """A sampler one nat behind on every token (ratio e = 2.72 > dual clip 1.5) with negative advantages: the dual
    clip binds on every token, and the step says so."""
    policy = Policy(str(tiny_model), "float32", False, AlgoConfig(dual_clip=1.5), OptimConfig(lr=1e-3), 10, 1.0, 3,
                    old_logprobs=OldLogprobs.SAMPLER)
    g = torch.Generator().manual_seed(0)
    comps = [Completion(torch.randint(5, 200, (4,), generator=g).tolist(), torch.randint(5, 200, (3,), generator=g).tolist(),
                        [0.0] * 3, "", "stop", i // 2) for i in range(4)]
    mbs = make_micro_batches(Samples.of_call(comps), 4096, 0)
    with torch.no_grad():
        for mb in mbs:
            mb.sampler_logprobs = (token_logprobs(policy.model, mb, 1.0)[0] - 1.0) * mb.mask
    stats = policy.update(policy.prepare([mbs], 4), -torch.ones(4))
    assert stats["dual_clip_frac"] == pytest.approx(1.0)
    assert stats["ratio_mean"] == pytest.approx(torch.e, rel=1e-4)
