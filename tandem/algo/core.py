"""GRPO's math as pure tensor functions, each registered by name: advantages, policy losses, KL, aggregation.

Shapes: `B` sequences, `T` completion tokens (padded, with `mask` 1 on real tokens). A new variant is one
function here plus its test; the trainer selects functions by the names in `AlgoConfig`.

Besides the four registries, this module holds the pure helpers of the GRPO family's training tricks
(the trainer calls them; each is a few lines of tensor code, tested on its own):

- `kl_reward_penalty`: KL as a reward penalty (instead of a loss term).
- `token_loss` (with its `LossSpec`): the per-token loss one update trains on, policy loss x TIS weight + KL term
  + entropy term, and the conventions of each (the KL gradient's among them: see its section).
- `entropy_loss_term`, `kl_loss_term`, `entropy_from_logprobs`: the extra per-token terms and the entropy.
- `nonzero_variance_groups`, `first_k_groups`: DAPO's dynamic sampling.
- `overlong_penalty`, `truncation_mask`: DAPO's overlong reward shaping and overlong filtering.
- `tis_weights`: truncated importance sampling against the sampler's logprobs (Yao et al. 2025).
- `IS_MASKS` (a fifth registry): masked importance sampling, IcePop's token-level band and MIS's sequence-level one.
- `aggregation_totals`: the mini-batch totals every aggregation divides by.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from tandem.plugins import Registry


@dataclass(frozen=True)
class Advantage:
    """A registered advantage estimator: called as its function; `needs_groups` when its baseline is the group's
    (a group of one then has advantage 0 whatever its reward, and a config that makes every group one is refused)."""

    name: str
    fn: Callable[..., Tensor]
    needs_groups: bool = False

    def __call__(self, rewards: Tensor, groups: Tensor, lengths: Tensor, eps: float = 1e-6) -> Tensor:
        return self.fn(rewards, groups, lengths=lengths, eps=eps)


ADVANTAGES: Registry[Advantage] = Registry("advantage", Advantage)
POLICY_LOSSES: Registry[Callable[..., tuple[Tensor, dict[str, Tensor]]]] = Registry("policy loss")
KL_ESTIMATORS: Registry[Callable[[Tensor, Tensor], Tensor]] = Registry("KL estimator")
AGGREGATIONS: Registry[Callable[..., Tensor]] = Registry("loss aggregation")
IS_MASKS: Registry[Callable[..., tuple[Tensor, Tensor]]] = Registry("importance-sampling mask")
register_advantage, register_policy_loss = ADVANTAGES.register, POLICY_LOSSES.register
register_kl, register_aggregation = KL_ESTIMATORS.register, AGGREGATIONS.register
register_is_mask = IS_MASKS.register

# exp() of a log-ratio beyond this overflows float16/bfloat16 ranges or explodes a gradient; clamp first.
_MAX_LOG_RATIO = 20.0


# ---------------------------------------------------------------------------------------------- advantages
# Signature: (rewards[N], groups[N] long, lengths[N], eps) -> advantages[N]. `groups` labels which prompt a sample
# answers; `lengths` counts the tokens each sample trains on (0 for one that trains on none), read only by the
# estimators that weigh samples by their tokens (REINFORCE++'s whitening). Statistics are taken in float64 and the
# result is cast back to the rewards' dtype.
#
# A group of one is its own baseline: its centred reward is 0 whatever its reward, so it learns nothing from it
# (advantage 0 under grpo, dr_grpo, grpo_batch_std and rloo). verl takes a lone sample's baseline as 0 instead, so
# its raw reward is its advantage; tandem does not, because one sample says nothing about how hard its prompt is
# (a config whose every group is one sample is refused; see `Config._algo_checks`).


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


def _safe_div(x: Tensor, d: Tensor) -> Tensor:
    """x / d, and 0 where d == 0 (a zero-spread group with eps = 0 has x == 0 too): never NaN."""
    return torch.where(d > 0, x / torch.where(d > 0, d, torch.ones_like(d)), torch.zeros_like(x))


def _batch_std(x: Tensor) -> Tensor:
    """Unbiased std over all samples; 0 (not NaN) for a batch of one."""
    return x.std() if x.numel() > 1 else torch.zeros((), dtype=x.dtype)


def _whiten_samples(x: Tensor, eps: float) -> Tensor:
    """(x - mean(x)) / (std(x) + eps) over samples, each sample counting once."""
    return _safe_div(x - x.mean(), _batch_std(x) + eps)


def _whiten_tokens(x: Tensor, lengths: Tensor, eps: float) -> Tensor:
    """(x - mean) / (std + eps) with the mean and (unbiased) std over tokens, each sample's value repeated for each
    of its tokens: verl's `masked_whiten` of per-token returns that all equal their sequence's value. No token at
    all: zeros."""
    if lengths.shape != x.shape:
        raise ValueError(f"lengths: shape {tuple(lengths.shape)} does not match rewards {tuple(x.shape)}; pass one "
                         "token count per sample (the tokens it trains on)")
    n = lengths.double()
    total = n.sum()
    if total == 0:
        return torch.zeros_like(x)
    mean = (n * x).sum() / total
    var = (n * (x - mean) ** 2).sum() / (total - 1) if total > 1 else torch.zeros((), dtype=x.dtype)
    return _safe_div(x - mean, var.sqrt() + eps)


@register_advantage("grpo", needs_groups=True)
def grpo_advantages(rewards: Tensor, groups: Tensor, lengths: Tensor, eps: float = 1e-6) -> Tensor:
    """GRPO (Shao et al. 2024, DeepSeekMath): (r - mean(group)) / (std(group) + eps)."""
    mean, std, _ = _group_stats(rewards, groups)
    return _safe_div(rewards.double() - mean, std + eps).to(rewards.dtype)


@register_advantage("dr_grpo", needs_groups=True)
def dr_grpo_advantages(rewards: Tensor, groups: Tensor, lengths: Tensor, eps: float = 1e-6) -> Tensor:
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"): r - mean(group).

    No division by the group std, which up-weights too-easy and too-hard prompts (a difficulty bias).
    """
    mean, _, _ = _group_stats(rewards, groups)
    return (rewards.double() - mean).to(rewards.dtype)


@register_advantage("grpo_batch_std", needs_groups=True)
def grpo_batch_std_advantages(rewards: Tensor, groups: Tensor, lengths: Tensor, eps: float = 1e-6) -> Tensor:
    """Group mean, batch std (Liu et al. 2025, "Tricks or Traps?", Lite PPO): (r - mean(group)) / (std(batch) + eps).

    The std of all rewards in the step scales every group alike, so low-variance groups are not blown up.
    """
    mean, _, _ = _group_stats(rewards, groups)
    r = rewards.double()
    return _safe_div(r - mean, _batch_std(r) + eps).to(rewards.dtype)


@register_advantage("rloo", needs_groups=True)
def rloo_advantages(rewards: Tensor, groups: Tensor, lengths: Tensor, eps: float = 1e-6) -> Tensor:
    """RLOO (Ahmadian et al. 2024, "Back to Basics"): r_i - mean_{j != i in group} r_j = n/(n-1) (r_i - mean(group)).

    A group of one has no other sample to form a baseline: its advantage is 0.
    """
    mean, _, n = _group_stats(rewards, groups)
    n = n.double()
    scale = torch.where(n > 1, n / (n - 1).clamp(min=1), torch.zeros_like(n))
    return (scale * (rewards.double() - mean)).to(rewards.dtype)


@register_advantage("reinforce_pp")
def reinforce_pp_advantages(rewards: Tensor, groups: Tensor, lengths: Tensor, eps: float = 1e-6) -> Tensor:
    """REINFORCE++ (Hu 2025): the returns whitened over the batch's tokens. Groups are ignored.

    With outcome rewards (no KL in the per-token reward, no discount) every token's return is its sequence's
    reward, so whitening the returns over tokens, as the paper and verl do, is (r - mean) / (std + eps) with the
    mean and std over tokens: a sample counts once per token it trains on, so long answers set the scale.
    `reinforce_pp_sample` counts each sample once.
    """
    return _whiten_tokens(rewards.double(), lengths, eps).to(rewards.dtype)


@register_advantage("reinforce_pp_sample")
def reinforce_pp_sample_advantages(rewards: Tensor, groups: Tensor, lengths: Tensor, eps: float = 1e-6) -> Tensor:
    """REINFORCE++'s global normalization over samples, (r - mean(batch)) / (std(batch) + eps), each sample counting
    once whatever its length (tandem's `reinforce_pp` before token whitening). Groups and lengths are ignored."""
    return _whiten_samples(rewards.double(), eps).to(rewards.dtype)


@register_advantage("reinforce_pp_baseline", needs_groups=True)
def reinforce_pp_baseline_advantages(rewards: Tensor, groups: Tensor, lengths: Tensor, eps: float = 1e-6) -> Tensor:
    """REINFORCE++-baseline (Hu 2025): x = r - mean(group), then x whitened over the batch's tokens, as verl does.

    The group mean removes each prompt's difficulty; the whitening sets one scale for the step, each sample
    counting once per token it trains on. A group of one has x = 0 (see the section's comment).
    """
    mean, _, _ = _group_stats(rewards, groups)
    return _whiten_tokens(rewards.double() - mean, lengths, eps).to(rewards.dtype)


@register_advantage("reinforce_pp_baseline_sample", needs_groups=True)
def reinforce_pp_baseline_sample_advantages(rewards: Tensor, groups: Tensor, lengths: Tensor,
                                            eps: float = 1e-6) -> Tensor:
    """REINFORCE++-baseline with the whitening over samples: x = r - mean(group), then (x - mean(x)) / (std(x) +
    eps), each sample counting once whatever its length. Lengths are ignored."""
    mean, _, _ = _group_stats(rewards, groups)
    return _whiten_samples(rewards.double() - mean, eps).to(rewards.dtype)


# ---------------------------------------------------------------------------------------------- KL estimators
# Signature: (logp[B,T], ref_logp[B,T]) -> per-token estimate of KL(pi || ref) [B,T] (Schulman, "Approximating KL").
# "Unbiased" is about the value, under samples from pi. As a loss term each one's expected gradient differs (tested:
# tests/algo/test_algo_gradients.py): k1's is 0, k2's is grad KL(pi || ref), k3's is grad KL(ref || pi); times
# the ratio pi / pi_old (`kl_ratio_correction`), k1's and k3's become grad KL(pi || ref). See `token_loss`.


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
    d = (ref_logp - logp).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return torch.exp(d) - d - 1.0


def kl_reward_penalty(kl: Tensor, mask: Tensor, coef: float) -> Tensor:
    """KL as a reward penalty (InstructGPT, Ouyang et al. 2022; verl's `use_kl_in_reward`): coef * sum_t kl[b,t].

    Returns the per-sequence penalty [B], detached, to *subtract* from the rewards before advantages are
    computed. The sum over tokens (not the mean) is the sequence-level KL(pi || ref) estimate. Fully masked
    rows give 0.
    """
    return (coef * (kl * mask).sum(-1)).detach()


def distill_advantages(old_logp: Tensor, teacher_logp: Tensor, mask: Tensor, coef: float) -> Tensor:
    """On-policy distillation's per-token advantage [B,T] (algo.distill): coef * (log pi_teacher - log pi_old) at each
    sampled token, 0 off the mask. At a token the policy sampled, log pi_old - log pi_teacher is the one-sample (k1)
    estimate of the reverse KL(pi_old || pi_teacher) there; as an advantage its negative raises the tokens the teacher
    likes more than the policy does, and the policy gradient of its expectation is that of the reverse KL (Thinking
    Machines' on-policy distillation; GKD with reverse KL, Agarwal et al. 2024). Detached: the teacher is a target."""
    return (coef * (teacher_logp - old_logp) * mask).detach()


# ---------------------------------------------------------------------------------------------- policy losses


@dataclass(frozen=True)
class LossParams:
    """The knobs every policy loss may read (from AlgoConfig)."""

    # ratio >= 1 - clip_low (clip, and CISPO's weight); clip_low >= 1 bounds nothing below, a ratio being > 0.
    clip_low: float = 0.2
    clip_high: float = 0.2
    # Dual clip (Ye et al. 2020): for A < 0 the token loss is at most -c * A. None = off; must be > 1.
    dual_clip: float | None = None
    # GSPO's sequence-level ratio lives much closer to 1 than a token ratio: its own, tiny clip range.
    seq_clip_low: float = 3e-4
    seq_clip_high: float = 4e-4

    def __post_init__(self) -> None:
        if self.dual_clip is not None and not self.dual_clip > 1.0:
            raise ValueError(f"dual_clip must be > 1 (or None), got {self.dual_clip}")


# Signature: (logp[B,T], old_logp[B,T], advantages[B], mask[B,T], params) -> (per-token loss [B,T], metrics).
# Metrics are per-token tensors [B,T] (masked means are taken by the caller, over the whole step).


def _token_adv(advantages: Tensor) -> Tensor:
    return advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages


@register_policy_loss("clip")
def clipped_surrogate(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, params: LossParams
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate (Schulman et al. 2017) with separate low/high bounds (DAPO's clip-higher when
    clip_high > clip_low) and optional dual clip (Ye et al. 2020, "Mastering Complex Control in MOBA Games").

    loss = -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A), ratio = exp(logp - old_logp);
    with dual clip c, for A < 0: loss = min(loss, -c * A), so a huge ratio on a bad token cannot blow up.
    """
    log_ratio = (logp - old_logp).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    adv = _token_adv(advantages)
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - params.clip_low, 1.0 + params.clip_high) * adv
    loss = -torch.minimum(unclipped, clipped)
    clip_frac = (clipped < unclipped).to(logp.dtype)  # tokens where the clip bound was active
    metrics = {"clip_frac": clip_frac.detach(), "ratio": ratio.detach()}
    if params.dual_clip is not None:
        bound = -params.dual_clip * adv
        dual = (adv < 0) & (loss > bound)
        loss = torch.where(dual, bound.expand_as(loss), loss)
        metrics["dual_clip_frac"] = dual.to(logp.dtype).detach()
    return loss * mask, metrics


@register_policy_loss("gspo")
def gspo_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, params: LossParams
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"): a clipped surrogate on the sequence ratio

    s_i = exp(mean_t (logp - old_logp)) (length-normalized), clipped to [1 - seq_clip_low, 1 + seq_clip_high].

    Token form (GSPO-token): s_{i,t} = sg(s_i) * exp(logp_t - sg(logp_t)); its value is s_i at every token and its
    gradient is s_i * grad logp_t, whose mean over the sequence's tokens is grad s_i. So aggregating these
    per-token losses with `seq_mean_token_mean` reproduces the sequence objective exactly (value and gradient).
    """
    adv = _token_adv(advantages)
    lengths = mask.sum(-1).clamp(min=1)
    seq_log_ratio = ((logp - old_logp) * mask).sum(-1) / lengths  # fully masked row: 0, not NaN
    log_s = logp - logp.detach() + seq_log_ratio.detach().unsqueeze(-1)
    s = torch.exp(log_s.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    unclipped = s * adv
    clipped = s.clamp(1.0 - params.seq_clip_low, 1.0 + params.seq_clip_high) * adv
    loss = -torch.minimum(unclipped, clipped)
    clip_frac = (clipped < unclipped).to(logp.dtype)
    return loss * mask, {"clip_frac": clip_frac.detach(), "ratio": s.detach()}


@register_policy_loss("cispo")
def cispo_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, params: LossParams
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1, 2025): REINFORCE weighted by a clipped, stop-gradient importance weight.

    grad = -sg(clip(ratio, 1 - clip_low, 1 + clip_high)) * A * grad logp_t: unlike PPO no token's gradient is
    dropped, only its weight is bounded. Both bounds apply, as in verl; the paper bounds the weight above only
    (its eps_low is effectively infinite), which is clip_low >= 1 here (verl's example sets 10).
    Written as -sg(w) * A * exp(logp - sg(logp)) so the value is -w * A (a readable loss) with that gradient.
    """
    adv = _token_adv(advantages)
    ratio = torch.exp((logp - old_logp).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)).detach()
    weight = ratio.clamp(1.0 - params.clip_low, 1.0 + params.clip_high)
    loss = -weight * adv * torch.exp(logp - logp.detach())
    return loss * mask, {"clip_frac": (weight != ratio).to(logp.dtype), "ratio": ratio}


def tis_weights(old_logp: Tensor, sampler_logp: Tensor, mask: Tensor, cap: float) -> tuple[Tensor, Tensor]:
    """Truncated importance sampling (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
    Off-Policy RL Training"): w = min(exp(old_logp - sampler_logp), cap), detached.

    The sampler (vLLM, an older policy under async) is not the trainer's policy; multiplying each token's policy
    loss by w corrects for the mismatch, and the cap bounds the variance. Returns (w [B,T], zero on padding;
    per-token indicator [B,T] of tokens whose weight was capped, to be averaged like the loss metrics).
    """
    ratio = torch.exp((old_logp - sampler_logp).detach().clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    capped = (ratio > cap) & (mask > 0)
    return ratio.clamp(max=cap) * mask, capped.to(ratio.dtype)


# ---------------------------------------------------------------------------------------------- masked IS
# Masked importance sampling: like TIS, weigh each token's policy loss by the ratio r = pi_old / pi_sampler (the
# trainer's old policy over the policy, or policies, that sampled it), but where the ratio leaves a band [low, high]
# drop the token (or the whole sequence) from the loss instead of capping its weight: a token drawn under a policy
# far from the trainer's (weights several versions old in a stream, a numerics mismatch) then pushes on nothing,
# where a capped weight would still push on it. Signature: (old_logp[B,T], sampler_logp[B,T], mask[B,T], low, high)
# -> (weight [B,T] detached, 0 on padding and on masked tokens; masked [B,T], 1 on each real token the band masked).


@register_is_mask("token")
def icepop_weights(old_logp: Tensor, sampler_logp: Tensor, mask: Tensor, low: float, high: float
                   ) -> tuple[Tensor, Tensor]:
    """IcePop (Ling team 2025, "Small leak can sink a great ship"): each token weighted by its own ratio r_t when
    low <= r_t <= high, masked (weight 0) outside: two-sided, token by token."""
    ratio = torch.exp((old_logp - sampler_logp).detach().clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    inside = (ratio >= low) & (ratio <= high)
    return torch.where(inside, ratio, torch.zeros_like(ratio)) * mask, (~inside & (mask > 0)).to(ratio.dtype)


@register_is_mask("sequence")
def sequence_masked_weights(old_logp: Tensor, sampler_logp: Tensor, mask: Tensor, low: float, high: float
                            ) -> tuple[Tensor, Tensor]:
    """Sequence-level masked importance sampling (MIS; verl's rollout_is mask mode at its geometric level): each
    sequence weighted by its geometric-mean ratio rho = exp(mean_t log r_t) over its real tokens, and masked whole
    when rho leaves [low, high]. The geometric mean keeps rho near 1 however long the sequence, where the product
    of its ratios would leave any band."""
    log_r = (old_logp - sampler_logp).detach() * mask
    rho = torch.exp((log_r.sum(-1) / mask.sum(-1).clamp(min=1)).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    inside = ((rho >= low) & (rho <= high)).unsqueeze(-1)
    weight = torch.where(inside, rho.unsqueeze(-1), torch.zeros_like(rho).unsqueeze(-1)) * mask
    return weight, (~inside & (mask > 0)).to(weight.dtype)


# ---------------------------------------------------------------------------------------------- aggregation
# A step's sequences are split into micro-batches (a token budget); each micro-batch adds its share of the
# mini-batch loss, so the sum over micro-batches equals the loss over the whole mini-batch however it is split.
# A micro-batch holds whole sequences. Signature: (loss[B,T], mask[B,T], total_tokens, total_seqs, max_len) ->
# scalar share, where total_tokens / total_seqs count the whole mini-batch (see `aggregation_totals`) and
# max_len is a constant of the run (the completion-length limit), never the batch's longest row.


def aggregation_totals(mask: Tensor) -> tuple[int, int]:
    """(total_tokens, total_seqs) of a mini-batch: unmasked tokens, and sequences with at least one of them.

    A fully masked row (e.g. a truncated completion under overlong filtering) does not count as a sequence,
    so filtering does not dilute the other sequences' weight.
    """
    return int(mask.sum().item()), int((mask.sum(-1) > 0).sum().item())


@register_aggregation("token_mean")
def token_mean(loss: Tensor, mask: Tensor, total_tokens: int, total_seqs: int, max_len: int) -> Tensor:
    """Every token weighs the same across the mini-batch (DAPO; long answers weigh more)."""
    return (loss * mask).sum() / max(total_tokens, 1)


@register_aggregation("seq_mean_token_mean")
def seq_mean_token_mean(loss: Tensor, mask: Tensor, total_tokens: int, total_seqs: int, max_len: int) -> Tensor:
    """Mean over tokens of each sequence, then over sequences (original GRPO)."""
    per_seq = (loss * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    return per_seq.sum() / max(total_seqs, 1)


@register_aggregation("seq_mean_token_sum")
def seq_mean_token_sum(loss: Tensor, mask: Tensor, total_tokens: int, total_seqs: int, max_len: int) -> Tensor:
    """Sum over tokens of each sequence, then mean over sequences (verl's `seq-mean-token-sum`)."""
    return (loss * mask).sum() / max(total_seqs, 1)


@register_aggregation("seq_mean_token_sum_norm")
def seq_mean_token_sum_norm(
    loss: Tensor, mask: Tensor, total_tokens: int, total_seqs: int, max_len: int
) -> Tensor:
    """Dr. GRPO (Liu et al. 2025): sum over tokens / max_len (a constant), then mean over sequences.

    Dividing by a constant instead of each answer's length removes GRPO's length bias (short wrong answers
    penalized harder, long wrong answers less).
    """
    return (loss * mask).sum() / (max(max_len, 1) * max(total_seqs, 1))


# ---------------------------------------------------------------------------------------------- extra loss terms
# Per-token terms [B,T] added to the policy loss *before* aggregation, so they share its weighting and its
# micro-batch split: total = policy_loss + kl_loss_term(...) + entropy_loss_term(...), then AGGREGATIONS[name].


def kl_loss_term(kl: Tensor, mask: Tensor, coef: float) -> Tensor:
    """KL as a loss term (GRPO): coef * kl per token, masked."""
    return coef * kl * mask


def entropy_loss_term(entropy: Tensor, mask: Tensor, coef: float) -> Tensor:
    """Entropy bonus (Williams & Peng 1991; PPO): -coef * entropy per token, masked (minimizing it raises entropy)."""
    return -coef * entropy * mask


def entropy_from_logprobs(logp_all: Tensor) -> Tensor:
    """Per-position entropy [...] of the categorical distribution whose log-probabilities (log-softmax output) are
    `logp_all` [..., V]: the op training runs on the log-softmax it already has."""
    return -(logp_all.exp() * logp_all).sum(-1)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Per-position entropy of the categorical distribution given by `logits` [..., V].

    Computed in at least float32 (bf16 logits lose too much in log_softmax); float64 stays float64.
    """
    x = logits if logits.dtype == torch.float64 else logits.float()
    return entropy_from_logprobs(torch.log_softmax(x, dim=-1))


# ---------------------------------------------------------------------------------------------- the per-token loss
# What one update's forward trains on, assembled in one place: policy loss x TIS weight + KL term + entropy term.
#
# The KL term's gradient is a convention (`kl_ratio_correction`). k3 as a loss term, sampled from the old policy,
# has E[grad k3] = grad KL(ref || pi), the *forward* KL, at theta = theta_old (DeepSeekMath's GRPO, verl's default;
# tandem's default, for that lineage and because it keeps a recipe's KL gradient what those recipes tuned).
# Multiplying the estimator by the importance ratio pi / pi_old (TRL's `use_bias_correction_kl`, its default;
# DeepSeek-V3.2) makes E_old[grad (ratio * k)] = grad E_pi[k], for k1 and k3 the gradient of the reverse
# KL(pi || ref) the penalty is named after. The ratio carries the gradient (its value is 1 on policy, its gradient
# is not 0) and is taken against the same old logprobs as the policy loss; the TIS weight does not touch the KL.


@dataclass(frozen=True)
class LossSpec:
    """Everything the per-token loss reads, from AlgoConfig (`LossSpec.from_algo(algo)`)."""

    policy_loss: str = "clip"  # a POLICY_LOSSES name
    params: LossParams = LossParams()
    kl_coef: float = 0.0  # 0 = no KL term in the loss (no reference, or the KL is in the reward)
    kl_estimator: str = "k3"  # a KL_ESTIMATORS name
    kl_ratio_correction: bool = False  # multiply the KL estimate by pi / pi_old (see above)
    entropy_coef: float = 0.0
    tis_cap: float | None = None
    is_mask: str = "none"  # an IS_MASKS name, or "none"
    is_mask_band: tuple[float, float] = (0.5, 2.0)  # the ratios [low, high] it keeps

    @classmethod
    def from_algo(cls, algo) -> "LossSpec":
        """The loss `algo` (an AlgoConfig) trains with; with `kl_in_reward` the KL is in the reward, not the loss."""
        return cls(
            policy_loss=algo.policy_loss,
            params=LossParams(clip_low=algo.clip_low, clip_high=algo.clip_high, dual_clip=algo.dual_clip,
                              seq_clip_low=algo.gspo_clip_low, seq_clip_high=algo.gspo_clip_high),
            kl_coef=0.0 if algo.kl_in_reward else algo.kl_coef, kl_estimator=algo.kl_estimator,
            kl_ratio_correction=algo.kl_ratio_correction, entropy_coef=algo.entropy_coef, tis_cap=algo.tis_cap,
            is_mask=algo.is_mask, is_mask_band=tuple(algo.is_mask_band),
        )


def _needed(value: Tensor | None, name: str, why: str) -> Tensor:
    if value is None:
        raise ValueError(f"token_loss: {name} is None, but {why}; pass it (or turn that term off in the spec)")
    return value


def _registered(table: dict, name: str, field: str) -> Callable:
    if name not in table:
        raise ValueError(f"LossSpec.{field}: {name!r} is not registered; choose one of: {', '.join(sorted(table))}")
    return table[name]


def token_loss(spec: LossSpec, logp: Tensor, advantages: Tensor, mask: Tensor, *, old_logp: Tensor | None = None,
               sampler_logp: Tensor | None = None, ref_logp: Tensor | None = None, entropy: Tensor | None = None
               ) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token loss [B,T] = policy loss x IS weight (TIS's, or a masked one) + KL term + entropy term; and
    per-token metrics [B,T] ("clip_frac", "ratio", "dual_clip_frac" when dual clip is on, "tis_capped" when tis_cap
    is set, "is_masked" when is_mask is, "kl" when the KL term is on: the per-token KL estimate the loss weighs by
    kl_coef), each NOT yet masked-summed: the caller sums
    (m * mask) for each key. old_logp None = on-policy: the update's own forward, detached (logp.detach()), is the
    old policy. Aggregate the loss with an AGGREGATIONS function.
    """
    loss_fn = _registered(POLICY_LOSSES, spec.policy_loss, "policy_loss")
    old = logp.detach() if old_logp is None else old_logp
    loss, metrics = loss_fn(logp, old, advantages, mask, spec.params)
    if spec.tis_cap is not None:
        w, metrics["tis_capped"] = tis_weights(old, _needed(sampler_logp, "sampler_logp", "tis_cap is set"), mask,
                                               spec.tis_cap)
        loss = loss * w
    if spec.is_mask != "none":
        mask_fn = _registered(IS_MASKS, spec.is_mask, "is_mask")
        w, metrics["is_masked"] = mask_fn(old, _needed(sampler_logp, "sampler_logp", "is_mask is set"), mask,
                                          *spec.is_mask_band)
        loss = loss * w
    if spec.kl_coef > 0:
        kl_fn = _registered(KL_ESTIMATORS, spec.kl_estimator, "kl_estimator")
        kl = kl_fn(logp, _needed(ref_logp, "ref_logp", "kl_coef > 0"))
        if spec.kl_ratio_correction:
            kl = kl * torch.exp((logp - old).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
        loss = loss + kl_loss_term(kl, mask, spec.kl_coef)
        metrics["kl"] = kl.detach()
    if spec.entropy_coef > 0:
        loss = loss + entropy_loss_term(_needed(entropy, "entropy", "entropy_coef > 0"), mask, spec.entropy_coef)
    return loss, metrics


# ---------------------------------------------------------------------------------------------- DAPO sampling tricks


def nonzero_variance_groups(rewards: Tensor, groups: Tensor) -> Tensor:
    """DAPO's dynamic sampling (Yu et al. 2025): bool mask [N], True for samples whose group's rewards are not
    all equal. An all-equal group (all right, all wrong, or a group of one) has zero advantage under GRPO and
    only dilutes the batch's gradient.
    """
    _, inv = torch.unique(groups, return_inverse=True)
    n = int(inv.max().item()) + 1 if inv.numel() else 0
    r = rewards.double()
    hi = torch.full((n,), -torch.inf, dtype=r.dtype).scatter_reduce(0, inv, r, "amax")
    lo = torch.full((n,), torch.inf, dtype=r.dtype).scatter_reduce(0, inv, r, "amin")
    return (hi > lo)[inv]


def first_k_groups(groups: Tensor, keep: Tensor, k: int) -> Tensor:
    """Indices (long, ascending) of the kept samples that belong to the first k kept groups, groups ordered by
    first appearance. Dynamic sampling accumulates rounds until k groups survive, then trims to exactly k.
    """
    idx = torch.nonzero(keep, as_tuple=False).flatten()
    chosen: set[int] = set()
    out = []
    for i in idx.tolist():
        g = int(groups[i])
        if g not in chosen:
            if len(chosen) == k:
                continue
            chosen.add(g)
        out.append(i)
    return torch.tensor(out, dtype=torch.long)


def overlong_penalty(lengths: Tensor, max_len: int, buffer: int, penalty_factor: float) -> Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025), a reward term [N] to add to the rewards:

    0 for length <= max_len - buffer; then linearly down to -penalty_factor at length = max_len; -penalty_factor
    beyond. buffer <= 0 turns the ramp into a step at max_len.
    """
    lengths = lengths.to(torch.float64)
    if buffer <= 0:
        pen = (lengths > max_len).to(torch.float64)
    else:
        pen = ((lengths - (max_len - buffer)) / buffer).clamp(0.0, 1.0)
    return (-penalty_factor * pen).to(torch.get_default_dtype())


def truncation_mask(truncated: Tensor) -> Tensor:
    """DAPO's overlong filtering: a per-sequence factor [N], 0 for truncated completions, 1 otherwise.

    Multiply it into the token mask (`mask * truncation_mask(t)[:, None]`) before `aggregation_totals`, so a
    truncated answer, whose reward says nothing about its reasoning, contributes no gradient.
    """
    return (~truncated.bool()).to(torch.get_default_dtype())
