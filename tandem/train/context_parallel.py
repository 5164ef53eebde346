"""Context parallel (Ulysses): a padding-free micro-batch's sequence split over the cp ranks, attention over the whole
sequence by heads, and each rank's per-token results summed into the micro-batch's [rows, T] ones."""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F


if TYPE_CHECKING:
    from tandem.train.batch import Packed

# The attention implementation a context-parallel model runs with (`use`). No mask function is registered for it:
# transformers builds no mask for an attention it has none for (masking_utils' `_preprocess_mask_arguments`), and
# the one it would build from this rank's chunk is wrong anyway: `_attend` builds its own over the whole sequence.
ATTENTION = "tandem_ulysses"


class _AllToAll(torch.autograd.Function):
    """Ulysses' exchange: [b, heads, n/cp, d] (every head, this rank's chunk of the sequence) to [b, heads/cp, n, d]
    (this rank's heads, the whole sequence) when `to_heads`, the reverse when not. Each is the other's backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, to_heads: bool, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.to_heads, ctx.group = to_heads, group
        return _exchange(x, to_heads, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad.contiguous(), not ctx.to_heads, ctx.group), None, None


def _exchange(x: torch.Tensor, to_heads: bool, group: dist.ProcessGroup) -> torch.Tensor:
    cp = dist.get_world_size(group)
    b, h, n, d = x.shape
    if to_heads:  # send head block r of my chunk to rank r; receive my head block of every rank's chunk, in order
        send = x.reshape(b, cp, h // cp, n, d).transpose(0, 1).contiguous()
    else:  # send chunk r of my heads' sequence to rank r; receive every head block of my chunk, in order
        send = x.reshape(b, h, cp, n // cp, d).permute(2, 0, 1, 3, 4).contiguous()
    got = torch.empty_like(send)
    dist.all_to_all_single(got, send, group=group)
    if to_heads:  # [cp (sequence chunk), b, h/cp, n, d] -> [b, h/cp, cp * n, d]
        return got.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * n, d)
    return got.transpose(0, 1).reshape(b, cp * h, n // cp, d)  # [cp (head block), b, h, n/cp, d]


class _SumOverRanks(torch.autograd.Function):
    """The sum over `group` of tensors that are zero wherever another rank's is not (each rank's logprobs at the
    tokens it scores). Backward is the identity: every rank computes the same loss from the sum, so the gradient
    of its own part is the sum's gradient as this rank has it (an all-reduce there would count it cp times)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


@dataclass
class _Sequence:
    """What the attention of the forward running now needs beyond this rank's q, k, v: the group and which row
    each position of the whole (padded) sequence belongs to."""

    group: dist.ProcessGroup
    segments: torch.Tensor  # [N] the row of each position; the padding at the end is a row of its own
    masks: dict[int | None, torch.Tensor]  # by sliding window: [N, N] True where a query may attend to a key


_local = threading.local()  # the forward running now (`_running`): one per thread, as a forward is


@contextlib.contextmanager
def _running(sequence: _Sequence):
    _local.sequence = sequence
    try:
        yield
    finally:
        _local.sequence = None


def _mask(sequence: _Sequence, window: int | None) -> torch.Tensor:
    """Causal within each row, nothing across rows (and within `window` of the query where a layer slides)."""
    if window not in sequence.masks:
        seg = sequence.segments
        i = torch.arange(seg.numel(), device=seg.device)
        allowed = (seg[:, None] == seg[None, :]) & (i[None, :] <= i[:, None])
        if window is not None:
            allowed &= i[:, None] - i[None, :] < window
        sequence.masks[window] = allowed
    return sequence.masks[window]


def _attend(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
            sliding_window: int | None = None, softcap: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention interface (sdpa's conventions: q, k, v [b, heads, n/cp, d] of this rank's chunk,
    out [b, n/cp, heads, d]) over the whole sequence: heads exchanged for sequence, attention, and back."""
    sequence = getattr(_local, "sequence", None)
    if sequence is None:
        raise RuntimeError(f"attention {ATTENTION!r} runs inside a context-parallel forward only "
                           "(tandem.train.context_parallel.forward)")
    if softcap is not None or kwargs.get("s_aux") is not None:
        raise NotImplementedError("context parallel: attention logit soft-capping and attention sinks are not "
                                  "covered yet")
    cp = dist.get_world_size(sequence.group)
    heads, kv = query.shape[1], key.shape[1]
    if kv % cp:  # fewer kv heads than ranks (GQA): each rank gets its query heads' copy of them
        key, value = (x.repeat_interleave(heads // kv, dim=1) for x in (key, value))
    q, k, v = (_AllToAll.apply(x.contiguous(), True, sequence.group) for x in (query, key, value))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=_mask(sequence, sliding_window), scale=scaling,
                                         dropout_p=dropout if module.training else 0.0,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return _AllToAll.apply(out, False, sequence.group).transpose(1, 2).contiguous(), None


def use(model: torch.nn.Module) -> None:
    """Make `model` attend by Ulysses (registered with transformers once, here)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, _attend)
    model.set_attn_implementation(ATTENTION)


@dataclass
class Chunk:
    """This rank's share of a packed micro-batch: its contiguous 1/cp of the sequence (padded at the end to a
    multiple of cp) and the kept logits within it."""

    ids: torch.Tensor  # [1, n] (n = padded N / cp)
    positions: torch.Tensor  # [..., 1, n] each row's own positions, as `Packed.positions`
    keep: torch.Tensor  # [k] positions within the chunk whose logits predict a completion token
    at: torch.Tensor  # [k] where each one's token goes in the [b, T] tensors, flattened (global: `Packed.at`'s)
    segments: torch.Tensor  # [N padded] the row of every position of the whole sequence (the padding: row b)


def split(p: Packed, rank: int, cp: int) -> Chunk:
    """Rank `rank`'s chunk of `p`. A chunk's last logit predicts the next chunk's first token: that target is found
    by `at` (global), so the rank holding the logit scores it, whichever rank holds the token."""
    N = p.ids.shape[-1]
    pad = -N % cp
    n = (N + pad) // cp
    rows = torch.arange(len(p.lengths), device=p.lengths.device)
    segments = torch.cat([rows.repeat_interleave(p.lengths), rows.new_full((pad,), len(p.lengths))])
    ids = F.pad(p.ids, (0, pad))
    # the padding runs at positions 0.. of its own (a row of its own: no row attends to it, nor it to any)
    positions = torch.cat([p.positions, torch.arange(pad, device=p.positions.device).expand(
        *p.positions.shape[:-1], pad)], dim=-1)
    start = rank * n
    mine = (p.keep >= start) & (p.keep < start + n)
    return Chunk(ids[..., start:start + n], positions[..., start:start + n], p.keep[mine] - start, p.at[mine],
                 segments)


def forward(model, p: Packed, group: dist.ProcessGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of the padding-free forward of `p`: its chunk (`split`) run with attention reaching the
    other chunks (`_attend`). Returns the logits it keeps [1, k, vocab] and where their tokens go (`Packed.at`'s):
    `tandem.train.logprobs` scores them and sums the [b, T] results over the group (`summed`)."""
    chunk = split(p, dist.get_rank(group), dist.get_world_size(group))
    with _running(_Sequence(group, chunk.segments, {})):
        out = model(input_ids=chunk.ids, position_ids=chunk.positions, attention_mask=None, use_cache=False,
                    logits_to_keep=chunk.keep)
    return out.logits, chunk.at


def summed(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The sum over `group` of per-token tensors each rank filled at the tokens it scored (zeros elsewhere): the
    whole micro-batch's, the same on every rank, so the loss is too; each rank's backward then gives its chunk's
    part of the gradient (FSDP sums them)."""
    return _SumOverRanks.apply(x, group)
