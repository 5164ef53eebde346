"""GRPO's math as pure tensor functions, each registered by name: advantages, policy losses, KL, aggregation.

Shapes: `B` sequences, `T` completion tokens (padded, with `mask` 1 on real tokens). A new variant is one
function here plus its test; the trainer selects functions by the names in `AlgoConfig`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

ADVANTAGES: dict[str, Callable[..., Tensor]] = {}
POLICY_LOSSES: dict[str, Callable[..., tuple[Tensor, dict[str, Tensor]]]] = {}
KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {}
AGGREGATIONS: dict[str, Callable[..., Tensor]] = {}


def _register(table: dict, name: str):
    def deco(fn):
        if name in table:
            raise ValueError(f"{name!r} is registered twice")
        table[name] = fn
        return fn

    return deco


def register_advantage(name: str):
    return _register(ADVANTAGES, name)


def register_policy_loss(name: str):
    return _register(POLICY_LOSSES, name)


def register_kl(name: str):
    return _register(KL_ESTIMATORS, name)


def register_aggregation(name: str):
    return _register(AGGREGATIONS, name)


# ---------------------------------------------------------------------------------------------- advantages
# Signature: (rewards[N], groups[N] long, eps) -> advantages[N]. `groups` labels which prompt a sample answers.


def _group_stats(rewards: Tensor, groups: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sample group mean, group (unbiased) std and group size, broadcast back to each sample."""
    _, inv, counts = torch.unique(groups, return_inverse=True, return_counts=True)
    r = rewards.double()
    sums = torch.zeros(len(counts), dtype=r.dtype).index_add_(0, inv, r)
    means = sums / counts
    sq = torch.zeros(len(counts), dtype=r.dtype).index_add_(0, inv, (r - means[inv]) ** 2)
    # A group of one has no spread: std 0 (its advantage is 0 under GRPO), never NaN.
    var = torch.where(counts > 1, sq / (counts - 1).clamp(min=1), torch.zeros_like(sq))
    return means[inv], var.sqrt()[inv], counts[inv]


@register_advantage("grpo")
def grpo_advantages(rewards: Tensor, groups: Tensor, eps: float = 1e-6) -> Tensor:
    """GRPO (Shao et al. 2024, DeepSeekMath): (r - mean(group)) / (std(group) + eps)."""
    mean, std, _ = _group_stats(rewards, groups)
    return ((rewards.double() - mean) / (std + eps)).to(rewards.dtype)


# ---------------------------------------------------------------------------------------------- KL estimators
# Signature: (logp[B,T], ref_logp[B,T]) -> per-token estimate of KL(pi || ref) [B,T] (Schulman, "Approximating KL").


@register_kl("k1")
def kl_k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k1 = log pi - log ref: unbiased, high variance, can be negative."""
    return logp - ref_logp


@register_kl("k2")
def kl_k2(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k2 = (log pi - log ref)^2 / 2: biased, low variance, its gradient is the true KL gradient."""
    return 0.5 * (logp - ref_logp) ** 2


@register_kl("k3")
def kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k3 = exp(ref - pi) - (ref - pi) - 1: unbiased and non-negative (GRPO's choice). Clamped against overflow."""
    d = (ref_logp - logp).clamp(-20.0, 20.0)
    return torch.exp(d) - d - 1.0


# ---------------------------------------------------------------------------------------------- policy losses


@dataclass(frozen=True)
class LossParams:
    """The knobs every policy loss may read (from AlgoConfig)."""

    clip_low: float = 0.2
    clip_high: float = 0.2


# Signature: (logp[B,T], old_logp[B,T], advantages[B], mask[B,T], params) -> (per-token loss [B,T], metrics).
# Metrics are per-token tensors [B,T] (masked means are taken by the caller, over the whole step).


@register_policy_loss("clip")
def clipped_surrogate(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, params: LossParams
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate with separate low/high bounds (DAPO's clip-higher when clip_high > clip_low).

    loss = -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A), ratio = exp(logp - old_logp).
    """
    log_ratio = (logp - old_logp).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - params.clip_low, 1.0 + params.clip_high) * adv
    loss = -torch.minimum(unclipped, clipped)
    clip_frac = (clipped < unclipped).to(logp.dtype)  # tokens where the clip bound was active
    return loss * mask, {"clip_frac": clip_frac.detach(), "ratio": ratio.detach()}


# ---------------------------------------------------------------------------------------------- aggregation
# A step's sequences are split into micro-batches (a token budget); each micro-batch adds its share of the
# mini-batch loss, so the sum over micro-batches equals the loss over the whole mini-batch however it is split.
# Signature: (loss[B,T], mask[B,T], total_tokens, total_seqs, max_len) -> scalar share.


@register_aggregation("token_mean")
def token_mean(loss: Tensor, mask: Tensor, total_tokens: int, total_seqs: int, max_len: int) -> Tensor:
    """Every token weighs the same across the mini-batch (DAPO; long answers weigh more)."""
    return (loss * mask).sum() / max(total_tokens, 1)


@register_aggregation("seq_mean_token_mean")
def seq_mean_token_mean(loss: Tensor, mask: Tensor, total_tokens: int, total_seqs: int, max_len: int) -> Tensor:
    """Mean over tokens of each sequence, then over sequences (original GRPO)."""
    per_seq = (loss * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    return per_seq.sum() / max(total_seqs, 1)


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Per-position entropy of the categorical distribution given by `logits` [..., V]."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)
