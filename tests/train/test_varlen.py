"""Attention by rows (tandem.train.varlen) against sdpa with the dense mask of the same rows: outputs and gradients,
rows of varied lengths, GQA, a sliding window; and the mask it has transformers build (none inside a padding-free
forward, sdpa's elsewhere)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.train import varlen

TOL = 1e-5  # fp32: the same sums, per row instead of over the masked whole


def _dense(q, k, v, lengths: list[int], scale: float, window: int | None) -> torch.Tensor:
    """sdpa with the [N, N] mask: causal within each row, nothing across (within `window` where given)."""
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    i = torch.arange(seg.numel())
    mask = (seg[:, None] == seg[None, :]) & (i[None, :] <= i[:, None])
    if window is not None:
        mask &= i[:, None] - i[None, :] < window
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


@pytest.mark.parametrize("kv_heads", [8, 2])
@pytest.mark.parametrize("window", [None, 4])
def test_rows_match_the_dense_mask_with_gradients(kv_heads, window):
    """Rows of 1 to 30 positions (some shorter than the window, some longer): the same output and q, k, v gradients
    as the dense mask, within TOL."""
    g = torch.Generator().manual_seed(0)
    lengths = [5, 1, 17, 9, 30, 3]
    N = sum(lengths)
    q, k, v = (torch.randn(1, h, N, 16, generator=g, requires_grad=True) for h in (8, kv_heads, kv_heads))
    rows = varlen.attend(q, k, v, lengths, 0.3, window)
    dense = _dense(q, k, v, lengths, 0.3, window)
    assert (rows - dense).abs().max() < TOL
    weights = torch.randn(rows.shape, generator=g)
    for a, b in zip(torch.autograd.grad(rows, (q, k, v), weights), torch.autograd.grad(dense, (q, k, v), weights)):
        assert (a - b).abs().max() < TOL


def test_rows_are_batched_by_length_within_a_factor_of_two():
    """The rows above run in four batched attentions (each row padded to at most twice its length), not six."""
    assert varlen._buckets([5, 1, 17, 9, 30, 3]) == [[4, 2], [3, 0], [5], [1]]


def test_a_row_seeing_its_neighbour_differs():
    """The comparison above can fail: rows told as one (the first two joined) differ from the dense mask's rows."""
    g = torch.Generator().manual_seed(1)
    lengths = [6, 6, 4]
    q, k, v = (torch.randn(1, 4, 16, 8, generator=g) for _ in range(3))
    assert (varlen.attend(q, k, v, [12, 4], None) - _dense(q, k, v, lengths, None, None)).abs().max() > 1e-2


def test_the_lengths_must_cover_the_sequence():
    q = torch.zeros(1, 2, 10, 4)
    with pytest.raises(ValueError, match="rows of 9 positions"):
        varlen.attend(q, q, q, [4, 5], None)


def test_no_mask_inside_a_padding_free_forward_and_sdpa_s_outside():
    """transformers builds its mask by the registered function: sdpa's (here a [1, 1, 4, 4] causal one, its causal
    skip off) outside `rows`, none inside."""
    kw = dict(batch_size=1, q_length=4, kv_length=4, allow_is_causal_skip=False)
    outside = varlen._mask(**kw)
    assert outside is not None and outside.shape == (1, 1, 4, 4) and bool(outside[0, 0, 0, 1]) is False
    with varlen.rows(torch.tensor([2, 2])):
        assert varlen.running() == [2, 2] and varlen._mask(**kw) is None
    assert varlen.running() is None


def test_outside_a_padding_free_forward_a_model_attends_as_sdpa(tiny_model):
    """A model given row attention (`use`) runs a padded forward (left padding, its mask) and a cached greedy
    generation exactly as with sdpa: what the padded layout, the prompt-once layout and the hf engine run."""
    from tandem.architectures import profile
    from tandem.modeling import load_causal_lm

    plain, rows = load_causal_lm(str(tiny_model)), load_causal_lm(str(tiny_model))
    varlen.use(rows, profile(tiny_model))
    assert rows.config._attn_implementation == varlen.ATTENTION and plain.config._attn_implementation == "sdpa"
    ids = torch.tensor([[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        logits = [m(input_ids=ids, attention_mask=mask).logits for m in (plain, rows)]
        assert torch.equal(*logits)
        kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert torch.equal(plain.generate(ids, **kw), rows.generate(ids, **kw))
