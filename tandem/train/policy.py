"""The policy (and its frozen reference and distillation teacher): its models, the GRPO loss step with AdamW and an LR
schedule, offload and checkpoints; the logprob functions it calls are `tandem.train.logprobs`."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from tandem import moe
from tandem.util import residency
from tandem.algo import (
    AGGREGATIONS,
    KL_ESTIMATORS,
    LossSpec,
    aggregation_totals,
    distill_advantages,
    kl_reward_penalty,
    token_loss,
)
from tandem.config import AlgoConfig, LoraConfig, OldLogprobs, OptimConfig
from tandem.architectures import ModelProfile, profile
from tandem.modeling import load_causal_lm
from tandem.train.batch import MicroBatch, dummy_micro_batch
from tandem.train.logprobs import forward_positions, route_stats, routed_logprobs
from tandem.train.offload import Offloader
from tandem.train.stats import StepStats

# What `Policy.to_host` / `to_device` move, each a group of tensors: the policy's weights, gradients and optimizer
# state, and the frozen models beside it.
GROUPS = ("params", "grads", "optim", "ref", "teacher")
# The per-token metrics of `token_loss` as the step's stats name them.
_REPORTED_AS = {"ratio": "ratio_mean", "tis_capped": "tis_capped_frac", "is_masked": "is_masked_frac"}


@dataclass
class PreparedStep:
    """A step laid out for `Policy.update`, built once by `Policy.prepare`: this rank's mini-batches (old and reference
    logprobs filled in where the step needs them), the statistics gathered so far, and the KL penalties."""

    mini_batches: list[list[MicroBatch]]
    stats: StepStats
    penalties: torch.Tensor | None  # [rows] coef * sum_t KL of each row (algo.kl_in_reward), else None
    first_pass_done: bool  # prepare ran the sampling policy's forward: its entropy and mismatch are in `stats`
    times: dict[str, float] = field(default_factory=dict)  # the worker's timings of this step, reported with it


def _totals(mbs: list[MicroBatch]) -> tuple[int, int]:
    """A mini-batch's (tokens, sequences) on this rank: `aggregation_totals` of each micro-batch, added."""
    parts = [aggregation_totals(mb.mask) for mb in mbs]
    return sum(t for t, _ in parts), sum(s for _, s in parts)


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


def frozen_vision(vision: dict[str, torch.nn.Parameter], freeze: bool) -> frozenset[str]:
    """A vision-language model's vision side (`ModelProfile.vision_side`, by name), frozen when `freeze`
    (model.freeze_vision): the names of its weights that do not train, which a weight sync sends once."""
    for p in vision.values() if freeze else ():
        p.requires_grad_(False)
    return frozenset(n for n, p in vision.items() if not p.requires_grad)


def adamw(params: list[torch.nn.Parameter], optim: OptimConfig) -> torch.optim.AdamW:
    """AdamW over `params`, fused where it can be: one kernel over all parameters instead of ~10 Python-dispatched
    ops per tensor (CPU and CUDA); it takes FSDP's DTensor parameters as well (their local shards are what it
    updates)."""
    fused = all(p.device.type in ("cpu", "cuda") and p.dtype.is_floating_point for p in params)
    return torch.optim.AdamW(params, lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps,
                             weight_decay=optim.weight_decay, fused=fused or None)


class Policy:
    """Owns the trainable model, its optimizer and schedule, the reference model when KL is on, and the teacher when
    algo.distill names one.

    `mesh`: a ("dp", "cp", "tp") DeviceMesh from `parallel.build_mesh` (None = one process, no wrapping);
    `expert_parallel`: EP groups of that many dp ranks share each MoE layer's experts (`parallel.parallelize`).

    With a mesh, each dp rank trains on its own rows of every mini-batch (tp and cp peers get the same rows), the
    normalizers and the stats are reduced over dp, and gradients are summed over dp (and over cp, whose ranks each
    run a chunk of every micro-batch's sequence and end with the same whole logprobs, so the same loss and stats),
    so the update equals the single-process update of the whole mini-batch.

    `old_logprobs`: where the ratio's old-policy logprobs come from (`Config.old_logprobs` decides it for a run).
    RECOMPUTED, a forward before the update, is right for any batch; CURRENT spares that forward for one update on
    fresh samples; SAMPLER takes the sampler's logprobs as the behaviour policy (stale samples, asynchronous
    sampling without TIS). With `algo.tis_cap` the truncated importance weight pi_old / pi_sampler corrects for
    what lies between sampler and old policy (decoupled PPO).

    `lora` (enabled): only adapters train (PEFT; `seed` initializes them); the reference is the same model with
    its adapters switched off, so no second copy is loaded.

    `teacher_on_workers` (placement.teacher_workers): the distillation teacher runs on workers of its own, and its
    logprobs arrive with the samples (`Completion.teacher_logprobs`); none is loaded here.

    `model_profile`: the policy's profile (tandem.architectures; resolved from `model_path` when not given).

    `padding_free` (batch.padding_free): run micro-batches laid out padding-free (`MicroBatch.packed`) so, where the
    profile packs (`padding_free` then says what this policy runs, and so how its micro-batches are laid out); a
    teacher runs them so where its own profile packs too.

    `freeze_vision` (model.freeze_vision): a vision-language model's vision side (`ModelProfile.vision_side`) gets
    no gradients and no optimizer state. `frozen` names its weights wherever it does not train (frozen, or under
    LoRA, which adapts the language model only): weights that never change, which a weight sync sends once.
    """

    def __init__(self, model_path: str, dtype: str, trust_remote_code: bool, algo: AlgoConfig, optim: OptimConfig,
                 total_optimizer_steps: int, temperature: float, max_completion_tokens: int, mesh=None,
                 device: str | None = None, old_logprobs: OldLogprobs = OldLogprobs.RECOMPUTED,
                 lora: LoraConfig | None = None, seed: int = 0, expert_parallel: int = 1,
                 teacher_on_workers: bool = False, freeze_vision: bool = True,
                 model_profile: ModelProfile | None = None, padding_free: bool = True):
        from tandem.train.parallel import parallelize

        self.algo, self.optim_cfg = algo, optim
        self.temperature = temperature if temperature > 0 else 1.0
        self.max_completion_tokens = max_completion_tokens  # Dr.GRPO's constant normalizer (seq_mean_token_sum_norm)
        self.old_logprobs = OldLogprobs(old_logprobs)
        self.mesh = mesh if mesh is not None and mesh.size() > 1 else None
        self.profile = model_profile or profile(model_path)
        self.teacher_profile = profile(algo.distill.teacher) if algo.distill.teacher else None
        self.model = self._attending(load_causal_lm(model_path, dtype, trust_remote_code))
        self.lora = None  # the PeftModel around self.model when adapters train (self.model's layers are its)
        if lora is not None and lora.enabled:
            from tandem.train import lora as lora_lib

            self.lora = lora_lib.wrap(self.model, lora, self.profile, seed)
        self.frozen = frozen_vision(self.profile.vision_side(self.model), freeze_vision)
        if device is not None:
            self.model.to(device)
        self.model.train()
        # see logprobs.token_logprobs: FSDP's hooks want one forward per backward
        self.share_prompts = self.mesh is None and bool(self.profile.prompts_once)
        self.padding_free = padding_free and self.profile.packs
        self.teacher_packs = padding_free and self.teacher_profile is not None and self.teacher_profile.packs
        self.expert_parallel = expert_parallel if self.mesh is not None else 1
        # fused weights' row orders, parameters with partial gradients
        self.tp = parallelize(self.model, self.mesh, self.profile, self.expert_parallel)
        self.uses_ref = algo.kl_coef > 0
        # the reference: none without KL (a model's memory and a forward per step, only when used), nor with LoRA
        # (the policy with its adapters off is the reference)
        self.ref = self._frozen(model_path, self.profile, dtype, trust_remote_code, device) \
            if self.uses_ref and self.lora is None else None
        self.distilling = bool(algo.distill.teacher)
        self.teacher = self._frozen(algo.distill.teacher, self.teacher_profile, dtype, trust_remote_code, device) \
            if self.distilling and not teacher_on_workers else None
        self._watch_routers(algo)
        self.device = next(self.model.parameters()).device
        for p in self._tensors("params") + self._tensors("ref") + self._tensors("teacher"):
            residency.ensure_resizable(p)  # offload frees storages in place; a memory-mapped one cannot be
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = adamw(self.params, optim)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(optim, total_optimizer_steps))
        self.loss_spec = LossSpec.from_algo(algo)
        self.offloader = Offloader(self.device)
        for group in GROUPS:
            self.offloader.register(group, lambda g=group: self._tensors(g))

    def _frozen(self, model_path: str, model_profile: ModelProfile, dtype: str, trust_remote_code: bool,
                device: str | None):
        """A frozen model beside the policy (the reference, the teacher), sharded as the policy is."""
        from tandem.train.parallel import parallelize

        model = self._attending(load_causal_lm(model_path, dtype, trust_remote_code)).eval().requires_grad_(False)
        if device is not None:
            model.to(device)
        parallelize(model, self.mesh, model_profile, self.expert_parallel)
        return model

    def _attending(self, model):
        """`model`, attending by Ulysses under context parallel (`tandem.train.context_parallel`)."""
        if self.cp_size > 1:
            from tandem.train import context_parallel

            context_parallel.use(model)
        return model

    def _logprobs(self, model, routing: "moe.Routing | None", mb: MicroBatch, replay: bool = False,
                  logits: bool = False, **kw) -> tuple[torch.Tensor, torch.Tensor | None, "moe.Record | None"]:
        """`routed_logprobs` of `model` at the policy's temperature; under context parallel, this rank's chunk of the
        padding-free sequence and the results over the whole of it (dense models only: an MoE is refused with it)."""
        if self.cp_size > 1:
            kw["context_group"] = self.mesh["cp"].get_group()
        return routed_logprobs(model, routing, mb, self.temperature, replay, logits, **kw)

    def _watch_routers(self, algo: AlgoConfig) -> None:
        """An MoE's router hooks (`tandem.moe.Routing`) on the policy, the reference and the teacher, and the
        load-balancing loss's weight: `algo.router_aux_coef`, or the model config's where that is None. Dense: none
        of it."""
        self.routing = self.profile.routing(self.model)
        self.ref_routing = self.routing  # LoRA: the reference is the same model, adapters off
        if self.ref is not None:
            self.ref_routing = self.profile.routing(self.ref)
        self.teacher_routing = self.teacher_profile.routing(self.teacher) if self.teacher is not None else None
        coef = algo.router_aux_coef
        if coef is None:
            coef = float(getattr(self.model.config, "router_aux_loss_coef", 0.0) or 0.0)
        self.aux_coef = coef if self.routing is not None else 0.0

    # ------------------------------------------------------------------ data parallel layout

    @property
    def dp_rank(self) -> int:
        return self.mesh["dp"].get_local_rank() if self.mesh is not None else 0

    @property
    def dp_size(self) -> int:
        return self.mesh["dp"].size() if self.mesh is not None else 1

    @property
    def cp_size(self) -> int:
        """Context-parallel ranks sharing each micro-batch's sequence (`tandem.train.context_parallel`)."""
        return self.mesh["cp"].size() if self.mesh is not None else 1

    @property
    def _dp_group(self):
        """The data-parallel process group; None when this process trains alone (nothing to reduce)."""
        return self.mesh["dp"].get_group() if self.mesh is not None and self.dp_size > 1 else None

    def _dp_reduce(self, t: torch.Tensor, op=None) -> torch.Tensor:
        if self._dp_group is not None:
            import torch.distributed as dist

            dist.all_reduce(t, op=op or dist.ReduceOp.SUM, group=self._dp_group)
        return t

    def _pad_counts(self, counts: list[int]) -> list[int]:
        """How many passes each mini-batch needs on every rank: the max over dp of each one's micro-batch count."""
        if self.mesh is None:
            return counts
        import torch.distributed as dist

        n = self._dp_reduce(torch.tensor([len(counts), -len(counts)], dtype=torch.float64), dist.ReduceOp.MAX)
        if int(n[0]) != -int(n[1]):
            raise ValueError(f"data-parallel ranks hold different numbers of mini-batches ({-int(n[1])}..{int(n[0])}); "
                             "every rank needs the same count (an empty one is fine)")
        c = self._dp_reduce(torch.tensor(counts, dtype=torch.float64), dist.ReduceOp.MAX)
        return [int(x) for x in c.tolist()]

    def _padded(self, mbs: list[MicroBatch], n: int) -> list[MicroBatch]:
        return list(mbs) + [dummy_micro_batch() for _ in range(n - len(mbs))]

    # ------------------------------------------------------------------ offload

    def _tensors(self, group: str) -> list[torch.Tensor]:
        if group == "params":
            return list(self.model.parameters())
        if group == "ref":
            return list(self.ref.parameters()) if self.ref is not None else []
        if group == "teacher":
            return list(self.teacher.parameters()) if self.teacher is not None else []
        if group == "grads":
            return [p.grad for p in self.model.parameters() if p.grad is not None]
        if group == "optim":
            return [v for st in self.optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
        raise ValueError(f"offload: unknown group {group!r}; groups are {', '.join(GROUPS)}")

    def to_host(self, *groups: str) -> int:
        """Move these groups (`GROUPS`) to host memory; their device storage is freed."""
        return self.offloader.to_host(*groups)

    def to_device(self, *groups: str) -> int:
        """Bring groups moved to the host back to the device (the same tensor objects, contents restored)."""
        return self.offloader.to_device(*groups)

    def residency(self) -> dict[str, int]:
        """Device bytes per group (`GROUPS`) now."""
        return self.offloader.resident_bytes()

    def named_weights(self):
        """(HF name, tensor) of every weight an engine samples with (with LoRA, each adapted one merged); with a mesh
        these are DTensor shards (tandem.sync reshards them), a fused weight under TP in block order (its DTensor's
        global rows are the Hugging Face rows `self.tp.row_orders[name]`: pass that to `layout_from_dtensors`)."""
        if self.lora is not None:
            from tandem.train.lora import merged_weights

            return merged_weights(self.model)
        return ((n, p.detach()) for n, p in self.model.named_parameters())

    def adapter_weights(self) -> dict[str, torch.Tensor]:
        """With LoRA, the adapter's tensors by wire name (`tandem.train.lora`): all a sampler holding the base needs."""
        from tandem.train.lora import adapter_weights

        return adapter_weights(self.model)

    @torch.no_grad()
    def prepare(self, mini_batches: list[list[MicroBatch]], rows: int) -> "PreparedStep":
        """The step laid out for `update`: old-policy logprobs where the source is a forward before the update or
        the sampler's, reference logprobs when KL is on, the teacher's when distilling, and with `kl_in_reward` each
        row's penalty coef * sum_t KL ([rows], of every dp rank's rows: each rank fills its own, the rest are summed
        in)."""
        stats, teacher_s = StepStats(), 0.0
        penalties = torch.zeros(rows) if self.algo.kl_in_reward else None
        local = [mb for mbs in mini_batches for mb in mbs]
        (n,) = self._pad_counts([len(local)])
        for mb in self._padded(local, n):
            mb.to(self.device)
            if self.teacher is not None:  # first: the first-pass stats compare the policy with it
                start = time.perf_counter()
                mb.teacher_logprobs = self._logprobs(
                    self.teacher, self.teacher_routing, mb,
                    share_prompts=self.mesh is None and bool(self.teacher_profile.prompts_once),
                    packed=self.teacher_packs)[0]
                teacher_s += time.perf_counter() - start
            elif self.distilling and mb.teacher_logprobs is None:
                raise RuntimeError("algo.distill: the teacher runs on placement.teacher_workers, and this step's "
                                   "samples came without its logprobs (Completion.teacher_logprobs)")
            if self.old_logprobs is OldLogprobs.SAMPLER:
                mb.old_logprobs = mb.sampler_logprobs  # first-pass stats come from the update's first forward
            elif self.old_logprobs is OldLogprobs.RECOMPUTED:
                mb.old_logprobs, ent, record = self._logprobs(
                    self.model, self.routing, mb, self.algo.router_replay, with_entropy=True,
                    share_prompts=self.share_prompts, packed=self.padding_free)
                self._first_pass_stats(mb, mb.old_logprobs, ent, stats, record)
            if self.uses_ref:
                mb.ref_logprobs = self._ref_logprobs(mb)
            if penalties is not None:
                kl = KL_ESTIMATORS[self.algo.kl_estimator](mb.old_logprobs, mb.ref_logprobs)
                if mb.rows:
                    penalties[mb.rows] = kl_reward_penalty(kl, mb.mask, self.algo.kl_coef).cpu()
                stats.add("kl", float((kl * mb.mask).sum()), mb.tokens)
        if penalties is not None:
            self._dp_reduce(penalties)
        return PreparedStep(mini_batches, stats, penalties,
                            first_pass_done=self.old_logprobs is OldLogprobs.RECOMPUTED,
                            times={"time/teacher": teacher_s} if self.teacher is not None else {})

    def _ref_logprobs(self, mb: MicroBatch) -> torch.Tensor:
        replay = self.algo.router_replay  # the reference on the same routes: its KL compares weights, not routings
        if self.lora is None:
            return self._logprobs(self.ref, self.ref_routing, mb, replay, share_prompts=self.share_prompts,
                                  packed=self.padding_free)[0]
        with self.lora.disable_adapter():  # the base model is the reference: its weights, no adapters
            return self._logprobs(self.model, self.routing, mb, replay, share_prompts=self.share_prompts,
                                  packed=self.padding_free)[0]

    def _first_pass_stats(self, mb: MicroBatch, logp: torch.Tensor, entropy: torch.Tensor, stats: StepStats,
                          record: "moe.Record | None") -> None:
        """Stats of the policy that sampled the batch: entropy, trainer-vs-sampler logprob mismatch, and for an MoE
        its routing (`route_stats`)."""
        if record is not None:
            route_stats(mb, record, stats, self.routing.num_experts, self.padding_free)
        diff = (logp.detach() - mb.sampler_logprobs).abs() * mb.mask
        if self.distilling:  # k1's estimate of the reverse KL(policy || teacher), per token (every rank)
            stats.add("distill/reverse_kl", float(((logp.detach() - mb.teacher_logprobs) * mb.mask).sum()), mb.tokens)
        stats.add("entropy", float(entropy.sum()), mb.tokens)
        stats.add("logprob_diff", float(diff.sum()), mb.tokens)
        stats.max("logprob_diff", float(diff.max()) if diff.numel() else 0.0)

    def update(self, step: "PreparedStep", advantages: torch.Tensor,
               check_sampler: Callable[[float, float], None] | None = None) -> dict[str, float]:
        """mu passes over the prepared step, one optimizer step per mini-batch; `advantages` has one entry per row of
        the step's samples. Returns token-weighted stats, the same on every dp rank (each passes its own rows and
        the same number of mini-batches, some maybe empty).

        `check_sampler(mean, max)` sees the trainer-vs-sampler logprob difference of the batch (over all dp ranks)
        before the first optimizer step, so that it can stop a step whose samples are wrong before they are
        trained on (the caller passes none for stale samples, whose difference includes the policy's own drift).
        """
        minis, stats = step.mini_batches, step.stats
        totals = torch.tensor([_totals(mbs) for mbs in minis], dtype=torch.float64).view(-1, 2)
        passes_per_mini = self._pad_counts([len(mbs) for mbs in minis])
        self._dp_reduce(totals)  # each mini-batch's normalizers count all its rows, on every rank
        if check_sampler is not None and step.first_pass_done:
            self._check_sampler(stats, check_sampler)
            check_sampler = None
        clip = self.optim_cfg.grad_clip if self.optim_cfg.grad_clip > 0 else float("inf")
        grad_norms, losses = [], []
        for epoch in range(self.algo.mu):
            for j, mbs in enumerate(minis):
                first_pass = epoch == 0 and not step.first_pass_done
                losses.append(sum(self._pass(mb, advantages, int(totals[j, 0]), int(totals[j, 1]), stats, first_pass)
                                  for mb in self._padded(mbs, passes_per_mini[j])))
                if check_sampler is not None:  # on-policy: one mini-batch, its forwards done, nothing stepped yet
                    self._check_sampler(stats, check_sampler)
                    check_sampler = None
                if self.tp.partial_grads:  # complete them before the norm sees them
                    from tandem.train.parallel import sum_partial_grads

                    sum_partial_grads(self.model, self.tp)
                grad_norms.append(self._clip(clip))
                self.optimizer.step()
                self.scheduler.step()
                self.optimizer.zero_grad(set_to_none=True)
        return self._report(losses, grad_norms, stats)

    def _pass(self, mb: MicroBatch, advantages: torch.Tensor, total_tokens: int, total_seqs: int, stats: StepStats,
              first_pass: bool) -> float:
        """One micro-batch's forward and backward: its share of its mini-batch's loss (returned)."""
        a = self.algo
        mb.to(self.device)
        logp, ent, record = self._logprobs(
            self.model, self.routing, mb, a.router_replay, logits=self.aux_coef > 0,
            with_entropy=first_pass or a.entropy_coef > 0, entropy_grad=a.entropy_coef > 0,
            share_prompts=self.share_prompts, packed=self.padding_free)
        if first_pass:
            self._first_pass_stats(mb, logp, ent.detach(), stats, record)
        adv = mb.advantages(advantages)
        if self.distilling:  # per token: the row's advantage plus the teacher's term at each token
            old = mb.old_logprobs if mb.old_logprobs is not None else logp.detach()
            adv = adv.unsqueeze(-1) + distill_advantages(old, mb.teacher_logprobs, mb.mask, a.distill.coef)
        loss_tok, metrics = token_loss(self.loss_spec, logp, adv, mb.mask,
                                       old_logp=mb.old_logprobs, sampler_logp=mb.sampler_logprobs,
                                       ref_logp=mb.ref_logprobs, entropy=ent)
        loss = AGGREGATIONS[a.loss_agg](loss_tok, mb.mask, total_tokens, total_seqs, self.max_completion_tokens)
        if self.aux_coef > 0:  # each micro-batch's share of the mini-batch's tokens, as token_mean weighs it
            real = mb.attention_mask.flatten()[forward_positions(mb, self.padding_free)]  # the record's rows
            aux = moe.load_balancing_loss(record, real, self.routing.num_experts)
            loss = loss + self.aux_coef * aux * (mb.tokens / max(total_tokens, 1))
            stats.add("moe/aux_loss", float(aux.detach()) * mb.tokens, mb.tokens)
        # FSDP averages gradients over the ranks it shards over, but each rank's loss is already its share of the
        # global loss (global normalizers), and each cp rank's backward gives its chunk's part of its dp rank's
        # gradient: scale by dp x cp so they add up. (Its divide factor would do the same via PREMUL_SUM, which gloo
        # lacks.)
        shards = self.dp_size * self.cp_size
        (loss * shards if shards > 1 else loss).backward()
        for name, per_token in metrics.items():
            stats.add(name, float((per_token * mb.mask).sum()), mb.tokens)
        return float(loss.detach())

    def _report(self, losses: list[float], grad_norms: list[float], stats: StepStats) -> dict[str, float]:
        """The step's stats over every dp rank; `loss` is the mean of each optimizer step's (global) loss."""
        losses = self._dp_reduce(torch.tensor(losses, dtype=torch.float64)).tolist()
        stats = stats.reduced(self._dp_group)
        self.last_losses = losses  # each optimizer step's loss (the global loss with a mesh)
        out = {"loss": sum(losses) / len(losses), "grad_norm": sum(grad_norms) / len(grad_norms),
               "lr": self.scheduler.get_last_lr()[0], "entropy": stats.mean("entropy"),
               "logprob_diff": stats.mean("logprob_diff"), "logprob_diff_max": stats.maxima.get("logprob_diff", 0.0)}
        out.update({_REPORTED_AS.get(name, name): stats.mean(name) for name in stats.sums
                    if name not in ("entropy", "logprob_diff")})
        if not self.algo.router_replay or not stats.counts["moe/route_mismatch"]:
            out.pop("moe/route_mismatch_unreplayed", None)  # without replay, the same as moe/route_mismatch
        if "moe/route_mismatch" in out and not stats.counts["moe/route_mismatch"]:
            del out["moe/route_mismatch"]  # no row came with routes (a vLLM sampler): nothing to compare
        if "moe/expert_counts" in stats.tallies:
            out.update(moe.load_metrics(stats.tallies["moe/expert_counts"], self.routing.top_k))
        return out

    def _check_sampler(self, stats: StepStats, check: Callable[[float, float], None]) -> None:
        """The batch's mean and max |trainer - sampler| logprob over every dp rank, handed to `check`."""
        everywhere = stats.reduced(self._dp_group)
        check(everywhere.mean("logprob_diff"), everywhere.maxima.get("logprob_diff", 0.0))

    def _clip(self, max_norm: float) -> float:
        if self.mesh is None:
            return float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
        from tandem.train.parallel import clip_grad_norm

        return clip_grad_norm(self.params, max_norm)

    # ------------------------------------------------------------------ checkpoints

    def _layout(self) -> dict[str, int]:
        if self.mesh is None:
            return {"dp": 1, "tp": 1, "dp_rank": 0, "tp_rank": 0}
        ep = {"ep": self.expert_parallel} if self.expert_parallel > 1 else {}  # experts' optimizer shards
        cp = {"cp": self.cp_size, "cp_rank": self.mesh["cp"].get_local_rank()} if self.cp_size > 1 else {}
        return {"dp": self.dp_size, "tp": self.mesh["tp"].size(), "dp_rank": self.dp_rank,
                "tp_rank": self.mesh["tp"].get_local_rank(), **ep, **cp}

    def state_dict(self) -> dict:
        """Optimizer and schedule state of this rank: with a mesh, its own shards (plain tensors, no collective).

        Resuming needs the same (dp, tp) layout and each rank loading its own file; `load_state_dict` checks.
        """
        opt = self.optimizer.state_dict()
        opt["state"] = {i: {k: residency.local(v).clone() if hasattr(v, "_local_tensor") else v for k, v in st.items()}
                        for i, st in opt["state"].items()}
        return {"optimizer": opt, "scheduler": self.scheduler.state_dict(), "layout": self._layout()}

    def load_state_dict(self, state: dict) -> None:
        saved, now = state.get("layout", {"dp": 1, "tp": 1, "dp_rank": 0, "tp_rank": 0}), self._layout()
        if saved != now:
            raise ValueError(f"optimizer state was saved with layout {saved}, this rank has {now}: resuming needs the "
                             "same number of training workers (placement.workers, or placement.train_workers when "
                             "split), placement.tensor_parallel, placement.context_parallel and "
                             "placement.expert_parallel, each rank its own file (the model weights load at any "
                             "layout; only the optimizer's shards do not)")
        opt = dict(state["optimizer"])
        if self.mesh is not None:
            from torch.distributed.tensor import DTensor

            # Re-wrap each saved shard as a DTensor laid out like its parameter, as the optimizer holds them.
            wrapped = {}
            for i, st in opt["state"].items():
                p = self.params[int(i)]
                wrapped[i] = {k: DTensor.from_local(v, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                                    stride=p.stride())
                              if isinstance(p, DTensor) and torch.is_tensor(v) and v.shape == p.to_local().shape
                              and k != "step" else v for k, v in st.items()}
            opt["state"] = wrapped
        self.optimizer.load_state_dict(opt)
        self.scheduler.load_state_dict(state["scheduler"])

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The policy's full weights as CPU tensors with HF names (tied names included, as `state_dict` has them).

        With a mesh this is a collective (every rank calls it) and every rank gets the full dict.
        """
        if self.mesh is None:
            return {k: v.detach().cpu() for k, v in self.model.state_dict().items()}
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        from tandem.train.parallel import hf_name

        sd = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))
        full = {hf_name(k): v.detach().cpu() for k, v in sd.items()}
        for name, order in self.tp.row_orders.items():  # stored row i is the Hugging Face row order[i]
            full[name] = torch.empty_like(full[name]).index_copy_(0, order, full[name])
        return full

    def load_full_state_dict(self, weights: dict[str, torch.Tensor]) -> None:
        """Load full HF weights (every rank passes the whole dict) into the model, sharded or not.

        A tied name absent from `weights` (HF checkpoints store a tied LM head once) is fine; any other missing or
        unexpected name is an error.
        """
        tied = self._tied_names()
        if self.mesh is None:
            missing, unexpected = self.model.load_state_dict(weights, strict=False)
        else:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            # a copy: set_model_state_dict replaces the dict's values with sharded ones, in place; fused weights
            # in the block order they are stored in
            weights = {k: v[self.tp.row_orders[k]] if k in self.tp.row_orders else v for k, v in weights.items()}
            missing, unexpected = set_model_state_dict(self.model, weights,
                                                       options=StateDictOptions(full_state_dict=True, strict=False))
        missing = [k for k in missing if k not in tied]
        if missing or unexpected:
            raise ValueError(f"load_full_state_dict: missing {missing}, unexpected {list(unexpected)}")

    def full_adapter(self) -> dict[str, torch.Tensor]:
        """With LoRA, the whole adapter as CPU tensors by wire name; with a mesh a collective (every rank calls it)."""
        return {n: (t.full_tensor() if hasattr(t, "_local_tensor") else t).cpu()
                for n, t in self.adapter_weights().items()}

    @torch.no_grad()
    def load_adapter(self, tensors: dict[str, torch.Tensor]) -> None:
        """Set the adapter from whole tensors by wire name (every rank passes all of them); names and shapes must
        be exactly this model's."""
        own = self.adapter_weights()
        missing, unexpected = sorted(set(own) - set(tensors)), sorted(set(tensors) - set(own))
        wrong = [n for n in set(own) & set(tensors) if tuple(own[n].shape) != tuple(tensors[n].shape)]
        if missing or unexpected or wrong:
            raise ValueError(f"the saved adapter is not this run's (lora.rank / lora.target_modules changed?): "
                             f"missing {missing[:4]}, unexpected {unexpected[:4]}, other shape {sorted(wrong)[:4]}")
        for name, p in own.items():
            value = tensors[name].to(p.dtype)
            if hasattr(p, "_local_tensor"):
                from torch.distributed.tensor import distribute_tensor

                value = distribute_tensor(value.to(p.device), p.device_mesh, p.placements).to_local()
                p = p.to_local()
            p.copy_(value)

    def _tied_names(self) -> set[str]:
        """Names that alias an earlier parameter (a tied LM head)."""
        first: dict[int, str] = {}
        tied = set()
        for n, p in self.model.named_parameters(remove_duplicate=False):
            if id(p) in first:
                tied.add(n)
            first.setdefault(id(p), n)
        return tied
