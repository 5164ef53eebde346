"""The policy (and frozen reference): token logprobs, the GRPO loss step with AdamW and an LR schedule."""
from __future__ import annotations

import math
from collections import defaultdict

import torch

from tandem.algo import (
    AGGREGATIONS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    LossParams,
    entropy_loss_term,
    kl_loss_term,
    kl_reward_penalty,
    tis_weights,
)
from tandem.config import AlgoConfig, OptimConfig
from tandem.modeling import load_causal_lm
from tandem.train.batch import MicroBatch


def lr_lambda(cfg: OptimConfig, total_steps: int):
    """Multiplier of the peak LR at optimizer step s: linear warm-up, then constant or cosine to min_lr_ratio."""

    def f(s: int) -> float:
        if cfg.warmup_steps and s < cfg.warmup_steps:
            return (s + 1) / cfg.warmup_steps
        if cfg.schedule == "constant":
            return 1.0
        span = max(total_steps - cfg.warmup_steps, 1)
        progress = min((s - cfg.warmup_steps) / span, 1.0)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def token_logprobs(model, mb: MicroBatch, temperature: float, with_entropy: bool = False, entropy_grad: bool = False):
    """log pi(target) for the completion tokens of `mb` [b, T], and their entropies when asked (with a
    gradient only when an entropy bonus needs one)."""
    T = mb.width
    out = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids,
                use_cache=False, logits_to_keep=T + 1)
    logits = out.logits[:, :-1, :].float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, mb.targets.unsqueeze(-1)).squeeze(-1)
    # Columns left of a short row's completion may be padding; keep them finite so masked sums stay clean.
    logp = torch.where(mb.mask > 0, logp, torch.zeros_like(logp))
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = torch.where(mb.mask > 0, -(logp_all.exp() * logp_all).sum(-1), torch.zeros_like(logp))
    return logp, entropy


class Policy:
    """Owns the trainable model, its optimizer and schedule, and the reference model when KL is on."""

    def __init__(self, model_path: str, dtype: str, trust_remote_code: bool, algo: AlgoConfig, optim: OptimConfig,
                 total_optimizer_steps: int, temperature: float, max_new_tokens: int):
        self.algo, self.optim_cfg = algo, optim
        self.temperature = temperature if temperature > 0 else 1.0
        self.max_new_tokens = max_new_tokens
        self.model = load_causal_lm(model_path, dtype, trust_remote_code)
        self.model.train()
        self.ref = None
        if algo.kl_coef > 0:  # the reference costs a model's memory and a forward per step: only when used
            self.ref = load_causal_lm(model_path, dtype, trust_remote_code).eval().requires_grad_(False)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        # fused: one kernel over all parameters instead of ~10 Python-dispatched ops per tensor (CPU and CUDA)
        fused = all(p.device.type in ("cpu", "cuda") and p.dtype.is_floating_point for p in self.params)
        self.optimizer = torch.optim.AdamW(self.params, lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps,
                                           weight_decay=optim.weight_decay, fused=fused or None)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(optim, total_optimizer_steps))
        self.loss_params = LossParams(clip_low=algo.clip_low, clip_high=algo.clip_high, dual_clip=algo.dual_clip,
                                      seq_clip_low=algo.gspo_clip_low, seq_clip_high=algo.gspo_clip_high)

    def named_weights(self):
        return ((n, p.detach()) for n, p in self.model.named_parameters())

    def on_policy(self, n_mini_batches: int) -> bool:
        """True when the only update is the first: its own forward, detached, is the old policy's logprobs."""
        return self.algo.mu == 1 and n_mini_batches == 1 and not self.algo.kl_in_reward

    @torch.no_grad()
    def prepare(self, mini_batches: list[list[MicroBatch]]) -> tuple[dict[str, float], list[float]]:
        """Old-policy logprobs (when updates go off-policy) and reference logprobs (when KL is on).

        Returns stats sums and, with `kl_in_reward`, each sequence's penalty coef * sum_t KL (by row index).
        """
        sums: dict[str, float] = defaultdict(float)
        old = not self.on_policy(len(mini_batches))
        penalties: dict[int, float] = {}
        for mb in (mb for mbs in mini_batches for mb in mbs):
            if old:
                mb.old_logprobs, ent = token_logprobs(self.model, mb, self.temperature, with_entropy=True)
                self._first_pass_stats(mb, mb.old_logprobs, ent, sums)
            if self.ref is not None:
                mb.ref_logprobs, _ = token_logprobs(self.ref, mb, self.temperature)
            if self.algo.kl_in_reward:
                kl = KL_ESTIMATORS[self.algo.kl_estimator](mb.old_logprobs, mb.ref_logprobs)
                for row, pen in zip(mb.rows, kl_reward_penalty(kl, mb.mask, self.algo.kl_coef).tolist()):
                    penalties[row] = pen
                sums["kl"] += float((kl * mb.mask).sum())
        return sums, [penalties[i] for i in sorted(penalties)]

    @staticmethod
    def _first_pass_stats(mb: MicroBatch, logp: torch.Tensor, entropy: torch.Tensor, sums: dict) -> None:
        """Stats of the policy that sampled the batch: entropy, and trainer-vs-sampler logprob mismatch."""
        diff = (logp.detach() - mb.sampler_logprobs).abs() * mb.mask
        sums["entropy"] += float(entropy.sum())
        sums["logprob_diff"] += float(diff.sum())
        sums["logprob_diff_max"] = max(sums["logprob_diff_max"], float(diff.max()) if diff.numel() else 0.0)

    def update(self, mini_batches: list[list[MicroBatch]], sums: dict[str, float]) -> dict[str, float]:
        """mu passes over the step's batch, one optimizer step per mini-batch; returns token-weighted stats."""
        a = self.algo
        on_policy = self.on_policy(len(mini_batches))
        sums = defaultdict(float, sums)
        tokens = sum(mb.tokens for mbs in mini_batches for mb in mbs)
        loss_fn, agg = POLICY_LOSSES[a.policy_loss], AGGREGATIONS[a.loss_agg]
        kl_fn = KL_ESTIMATORS[a.kl_estimator]
        kl_in_loss = self.ref is not None and not a.kl_in_reward
        grad_norms, losses = [], []
        for epoch in range(a.mu):
            for mbs in mini_batches:
                total_tokens = sum(mb.tokens for mb in mbs)
                total_seqs = sum(int((mb.mask.sum(-1) > 0).sum()) for mb in mbs)
                step_loss = 0.0
                for mb in mbs:
                    need_entropy = on_policy or a.entropy_coef > 0
                    logp, ent = token_logprobs(self.model, mb, self.temperature, with_entropy=need_entropy,
                                               entropy_grad=a.entropy_coef > 0)
                    if on_policy:
                        self._first_pass_stats(mb, logp, ent.detach(), sums)
                    old = logp.detach() if on_policy else mb.old_logprobs
                    loss_tok, m = loss_fn(logp, old, mb.advantages, mb.mask, self.loss_params)
                    if a.tis_cap is not None:
                        w, capped = tis_weights(old, mb.sampler_logprobs, mb.mask, a.tis_cap)
                        loss_tok = loss_tok * w
                        sums["tis_capped"] += float(capped.sum())
                    if kl_in_loss:
                        kl_tok = kl_fn(logp, mb.ref_logprobs)
                        loss_tok = loss_tok + kl_loss_term(kl_tok, mb.mask, a.kl_coef)
                        sums["kl"] += float((kl_tok.detach() * mb.mask).sum())
                    if a.entropy_coef > 0:
                        loss_tok = loss_tok + entropy_loss_term(ent, mb.mask, a.entropy_coef)
                    loss = agg(loss_tok, mb.mask, total_tokens, total_seqs, self.max_new_tokens)
                    loss.backward()
                    step_loss += float(loss.detach())
                    sums["clip_frac"] += float((m["clip_frac"] * mb.mask).sum())
                    sums["ratio"] += float((m["ratio"] * mb.mask).sum())
                clip = self.optim_cfg.grad_clip if self.optim_cfg.grad_clip > 0 else float("inf")
                grad_norms.append(float(torch.nn.utils.clip_grad_norm_(self.params, clip)))
                self.optimizer.step()
                self.scheduler.step()
                self.optimizer.zero_grad(set_to_none=True)
                losses.append(step_loss)
        passes = max(a.mu * tokens, 1)
        stats = {
            "loss": sum(losses) / len(losses),
            "grad_norm": sum(grad_norms) / len(grad_norms),
            "lr": self.scheduler.get_last_lr()[0],
            "clip_frac": sums["clip_frac"] / passes,
            "ratio_mean": sums["ratio"] / passes,
            "entropy": sums["entropy"] / max(tokens, 1),
            "logprob_diff": sums["logprob_diff"] / max(tokens, 1),
            "logprob_diff_max": sums["logprob_diff_max"],
        }
        if self.ref is not None:
            stats["kl"] = sums["kl"] / (max(tokens, 1) if a.kl_in_reward else passes)
        if a.tis_cap is not None:
            stats["tis_capped_frac"] = sums["tis_capped"] / passes
        return stats

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
