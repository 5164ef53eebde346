"""Attention confined to each row of a padding-free sequence (rows end to end): its cost follows the rows' lengths."""
from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from tandem.architectures import ModelProfile

# The attention implementation of a model whose profile packs (`use`): inside a padding-free forward (`rows`) each
# row attends to itself only, with no mask built over the whole sequence; anywhere else (padded forwards, the
# prompt-once layout, generation with a KV cache) it is transformers' sdpa, mask and all.
ATTENTION = "tandem_rows"

_local = threading.local()  # the rows of the padding-free forward running now: one per thread, as a forward is


@contextlib.contextmanager
def rows(lengths: torch.Tensor | list[int]):
    """Inside: the forward runs a sequence of rows of these lengths end to end (`Packed.lengths`), so attention stays
    within each. Autograd's backward needs no context (nothing here recomputes attention; activation checkpointing,
    which would, tandem does not run)."""
    _local.lengths = lengths.tolist() if torch.is_tensor(lengths) else list(lengths)  # one copy to the host
    try:
        yield
    finally:
        _local.lengths = None


def running() -> list[int] | None:
    """The row lengths of the padding-free forward running now in this thread (`rows`), None outside one."""
    return getattr(_local, "lengths", None)


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, lengths: list[int], scale: float | None,
           window: int | None = None, dropout: float = 0.0) -> torch.Tensor:
    """Causal attention within each row: q [1, heads, N, d], k and v [1, kv heads, N, d] (GQA: heads a multiple of
    kv heads), the rows `lengths` end to end (summing to N); `window`: a query sees only its last `window` positions
    (itself included, transformers' sliding_window). Returns [1, heads, N, d]. Cost and memory follow the sum of
    the rows' squared lengths (at most 4 times it: `_buckets`), not N squared."""
    if sum(lengths) != query.shape[2] or query.shape[0] != 1:
        raise ValueError(f"row attention: rows of {sum(lengths)} positions in all for a query of shape "
                         f"{tuple(query.shape)} (one sequence of them expected)")
    if query.is_cuda and _flash_fits(query, dropout):
        return _flash(query, key, value, lengths, scale, window)
    starts = torch.tensor([0, *lengths[:-1]], device=query.device).cumsum(0)
    sizes = torch.tensor(lengths, device=query.device)
    outs, places = [], []
    for rows in _buckets(lengths):
        width = lengths[rows[0]]
        j = torch.arange(width, device=query.device)
        real = j[None, :] < sizes[rows, None]  # [rows, width]
        # each row right-padded to the bucket's width: a real query never reaches its padding (causal), and the
        # padding's queries, which read real positions (the first of the sequence), are dropped
        at = torch.where(real, starts[rows, None] + j[None, :], 0)
        q, k, v = (x[0][:, at].transpose(0, 1) for x in (query, key, value))  # [rows, heads, width, d]
        mask = None
        if window is not None and width > window:
            mask = (j[None, :] <= j[:, None]) & (j[:, None] - j[None, :] < window)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scale,
                                             is_causal=mask is None, enable_gqa=q.shape[1] != k.shape[1])
        outs.append(out.transpose(1, 2)[real])  # [real positions, heads, d]
        places.append(at[real])
    order = torch.cat(places).argsort()  # back to the sequence's order
    return torch.cat(outs)[order].permute(1, 0, 2)[None]


def _buckets(lengths: list[int]) -> list[list[int]]:
    """The rows grouped for one batched attention each, longest first: a row joins the current group while it is at
    least half the group's longest, so padding it to that costs at most 4 times its own attention, and there are
    at most log2(longest / shortest) + 1 groups (a Python loop over rows, on CPU, costs more than that padding)."""
    out: list[list[int]] = []
    for r in sorted(range(len(lengths)), key=lambda r: -lengths[r]):
        if out and 2 * lengths[r] >= lengths[out[-1][0]]:
            out[-1].append(r)
        else:
            out.append([r])
    return out


def _flash_fits(query: torch.Tensor, dropout: float) -> bool:
    """Whether PyTorch's varlen flash kernel runs this: CUDA, half precision, no dropout, and a torch that has it."""
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return query.dtype in (torch.float16, torch.bfloat16) and dropout == 0.0


def _flash(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, lengths: list[int], scale: float | None,
           window: int | None) -> torch.Tensor:
    """`attend` by PyTorch's varlen flash kernel (CUDA only, so never run by the CPU tests: bench/gpu_check.py's
    varlen check compares it with the CPU path). Its window counts the positions before the query, hence the
    one less than transformers' sliding_window."""
    from torch.nn.attention.varlen import varlen_attn

    cu = torch.tensor([0, *lengths], device=query.device).cumsum(0).to(torch.int32)
    q, k, v = (x[0].transpose(0, 1).contiguous() for x in (query, key, value))  # [N, heads, d]
    longest = max(lengths)
    out = varlen_attn(q, k, v, cu, cu, longest, longest, scale=scale,
                      window_size=(-1 if window is None else window - 1, 0), enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(0, 1)[None]


def _attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
               sliding_window: int | None = None, softcap: float | None = None, **kwargs):
    """transformers' attention interface (sdpa's conventions: out [b, n, heads, d]): the row attention inside a
    padding-free forward (`rows`), sdpa elsewhere."""
    lengths = running()
    if lengths is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      sliding_window=sliding_window, softcap=softcap, **kwargs)
    if softcap is not None or kwargs.get("s_aux") is not None:
        raise NotImplementedError("row attention: attention logit soft-capping and attention sinks are not covered "
                                  "(such a model's profile must not pack: Support.no_packing)")
    out = attend(query, key, value, lengths, scaling, sliding_window, dropout if module.training else 0.0)
    return out.transpose(1, 2).contiguous(), None


def _mask(*args, **kwargs):
    """transformers' mask interface for ATTENTION: none inside a padding-free forward (the rows are given), sdpa's
    mask elsewhere."""
    if running() is not None:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, **kwargs)


def register() -> None:
    """ATTENTION known to transformers (its attention and its mask); idempotent."""
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(ATTENTION, _attention)
    AttentionMaskInterface.register(ATTENTION, _mask)


def use(model: torch.nn.Module, model_profile: ModelProfile) -> None:
    """Make the language model of `model` attend by rows inside a padding-free forward, where its profile packs and it
    runs sdpa (its other parts, a vision tower, keep theirs)."""
    language = model.get_submodule(model_profile.language_model)
    if not model_profile.packs or language.config._attn_implementation != "sdpa":
        return
    register()
    language.set_attn_implementation(ATTENTION)
