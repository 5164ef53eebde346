"""Loss aggregation: reference formulas, and micro-batch shares summing to the mini-batch loss."""
import random

import pytest
import torch

from tandem.algo import AGGREGATIONS, aggregation_totals


def _ref(name, loss, mask, max_len):
    rows = [(sum(l * m for l, m in zip(lr, mr)), sum(mr)) for lr, mr in zip(loss, mask)]
    n_seq = sum(1 for _, n in rows if n > 0)
    n_tok = sum(n for _, n in rows)
    if name == "token_mean":
        return sum(s for s, _ in rows) / max(n_tok, 1)
    if name == "seq_mean_token_mean":
        return sum(s / n for s, n in rows if n > 0) / max(n_seq, 1)
    if name == "seq_mean_token_sum":
        return sum(s for s, _ in rows) / max(n_seq, 1)
    if name == "seq_mean_token_sum_norm":
        return sum(s for s, _ in rows) / max_len / max(n_seq, 1)
    raise KeyError(name)


def _batch(seed, b=9, t=7):
    g = torch.Generator().manual_seed(seed)
    loss = torch.randn(b, t, generator=g, dtype=torch.float64)
    lengths = torch.randint(0, t + 1, (b,), generator=g)
    lengths[0] = 0  # a fully masked row
    mask = (torch.arange(t)[None, :] < lengths[:, None]).double()
    return loss, mask


def test_every_aggregation_has_a_reference():
    for name in AGGREGATIONS:
        _ref(name, [[0.0]], [[1.0]], 1)


@pytest.mark.parametrize("name", sorted(AGGREGATIONS))
def test_matches_reference(name):
    loss, mask = _batch(1)
    tok, seq = aggregation_totals(mask)
    got = AGGREGATIONS[name](loss, mask, tok, seq, 16)
    assert torch.isfinite(got)
    torch.testing.assert_close(got, torch.tensor(_ref(name, loss.tolist(), mask.tolist(), 16), dtype=torch.float64))


@pytest.mark.parametrize("name", sorted(AGGREGATIONS))
@pytest.mark.parametrize("seed", range(5))
def test_micro_batch_shares_sum_to_the_mini_batch_loss(name, seed):
    loss, mask = _batch(seed)
    tok, seq = aggregation_totals(mask)
    full = AGGREGATIONS[name](loss, mask, tok, seq, 16)
    rng = random.Random(seed)
    order = list(range(loss.shape[0]))
    rng.shuffle(order)
    cuts = sorted(rng.sample(range(1, len(order)), rng.randint(1, 4)))
    total = torch.zeros((), dtype=torch.float64)
    for lo, hi in zip([0] + cuts, cuts + [len(order)]):
        idx = torch.tensor(order[lo:hi])
        width = int(mask[idx].sum(-1).max().item()) or 1  # each micro-batch padded only to its own longest row
        total = total + AGGREGATIONS[name](loss[idx, :width], mask[idx, :width], tok, seq, 16)
    torch.testing.assert_close(total, full)


@pytest.mark.parametrize("name", sorted(AGGREGATIONS))
def test_all_masked_is_zero_not_nan(name):
    loss, mask = torch.randn(3, 4), torch.zeros(3, 4)
    tok, seq = aggregation_totals(mask)
    assert AGGREGATIONS[name](loss, mask, tok, seq, 4) == 0
