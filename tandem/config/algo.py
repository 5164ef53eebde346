"""The config's `batch`, `algo`, `optim` and `lora` sections: what one step trains on and how the policy learns
from it, with the names of the registered algorithms a config may choose."""
from __future__ import annotations

from enum import Enum
from typing import Literal

from pydantic import Field

from tandem.config.base import Section

# The names tandem.algo registers its functions under (ADVANTAGES, POLICY_LOSSES, AGGREGATIONS, KL_ESTIMATORS), by
# the field that names one: the registries hold torch functions, and checking a config imports no torch.
# tests/algo/test_algo_names.py holds these equal to the registries.
REGISTERED: dict[str, tuple[str, ...]] = {
    "advantage": ("grpo", "dr_grpo", "grpo_batch_std", "rloo", "reinforce_pp", "reinforce_pp_sample",
                  "reinforce_pp_baseline", "reinforce_pp_baseline_sample"),
    "policy_loss": ("clip", "gspo", "cispo"),
    "loss_agg": ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"),
    "kl_estimator": ("k1", "k2", "k3"),
}
# The advantages whose baseline is the group's (their `needs_groups` in tandem.algo): a group of one gets 0.
GROUP_BASELINES = ("grpo", "dr_grpo", "grpo_batch_std", "rloo", "reinforce_pp_baseline", "reinforce_pp_baseline_sample")


class OldLogprobs(str, Enum):
    """Where the clipped ratio's old-policy logprobs come from; decided once from the config (`Config.old_logprobs`)."""

    CURRENT = "current"  # the update's own forward, detached: one update on fresh samples (mu 1, one mini-batch)
    RECOMPUTED = "recomputed"  # a forward before the update: several updates, KL in the reward, or TIS under async
    SAMPLER = "sampler"  # the sampler's own logprobs: stale samples (async) without TIS, the behaviour policy


class BatchConfig(Section):
    """Batch size is said once: prompts_per_step x group_size completions per step."""

    prompts_per_step: int = Field(32, ge=1, description="Distinct prompts sampled per step.")
    group_size: int = Field(8, ge=1, description="Completions sampled per prompt (the GRPO group, G).")
    mini_batches: int = Field(
        1, ge=1, description="Optimizer steps per pass over the step's batch; prompts_per_step must divide evenly "
        "(a group is never split).",
    )
    micro_batch_tokens: int = Field(
        8192, ge=1, description="Token budget of one forward/backward (prompt + completion tokens: padding-free "
        "(batch.padding_free), the real tokens only; padded, after padding inside the micro-batch; where the trainer "
        "runs each prompt once, Qwen2/Llama/Qwen3.5 trained by one process with no FSDP or TP mesh, a prompt counts "
        "once for all its rows there). Bounds memory; does not change the result.",
    )
    padding_free: bool = Field(
        True, description="Run each micro-batch padding-free: its rows end to end in one sequence, each attending "
        "only to itself, the LM head on the completion tokens only, so no position is spent on padding and "
        "micro_batch_tokens counts real tokens. The same logprobs and gradients as padded, to float rounding. "
        "Architectures whose transformers code cannot keep the rows apart (Qwen3.5 and Qwen3.5-MoE: Gated DeltaNet "
        "layers; gpt-oss; any outside the model zoo) run padded whatever this says (the model's profile decides: "
        "tandem.architectures). Where the trainer runs each prompt once (see micro_batch_tokens), a micro-batch "
        "runs prompt-once where that is fewer positions, padding-free otherwise. Turn off to compare with the "
        "padded layout, or for attention code of your own that ignores the positions.",
    )


class DistillConfig(Section):
    """On-policy distillation (Agarwal et al. 2024's GKD with reverse KL; Thinking Machines' on-policy distillation):
    the policy samples, a teacher scores every sampled token, and each token's advantage gains
    coef * (log pi_teacher - log pi_old), the negative of the per-token reverse KL(policy || teacher) at that
    token. Its expectation over the policy's samples is the reverse KL, which this advantage lowers."""

    teacher: str = Field(
        "", description="The teacher: a causal-LM checkpoint folder sharing the policy's tokenizer (refused before "
        "models load otherwise, naming both). Empty = no distillation. `tandem demo` reads `demo:grpo` as the "
        "demo's own GRPO-trained model (examples/distill.yaml). It loads beside the policy, sharded as the "
        "reference is, and with placement.offload is on the device only while it scores (the logprobs phase).",
    )
    coef: float = Field(
        1.0, gt=0.0, description="Weight of the teacher's per-token term in the advantage. Distillation alone: "
        "give every reward weight 0 (the first reward is still what eval/accuracy and train/accuracy count); "
        "with the task reward: GRPO's per-completion advantage plus this per-token term.",
    )


class AlgoConfig(Section):
    advantage: str = Field(
        "grpo", description="Advantage estimator (tandem.algo.ADVANTAGES): `grpo` (DeepSeekMath: (r - group mean) / "
        "(group std + eps)), `dr_grpo` (Dr.GRPO: no std division), `grpo_batch_std` (batch std), `rloo` "
        "(leave-one-out baseline), `reinforce_pp` (REINFORCE++: rewards whitened over the batch's tokens, as the "
        "paper and verl; a sample counts once per token it trains on), `reinforce_pp_sample` (the same whitening over "
        "samples, each counting once), `reinforce_pp_baseline` (group mean removed, then whitened over tokens, as "
        "verl), `reinforce_pp_baseline_sample` (... then whitened over samples). A group of one is its own baseline: "
        "its reward does not move its advantage (0 under grpo, dr_grpo, grpo_batch_std, rloo; verl uses the raw "
        "reward there).",
    )
    policy_loss: str = Field(
        "clip", description="Policy loss (tandem.algo.POLICY_LOSSES): `clip` (PPO clipped surrogate, DAPO "
        "clip-higher via clip_high), `gspo` (GSPO sequence-level ratio), `cispo` (CISPO clipped-weight REINFORCE).",
    )
    loss_agg: str = Field(
        "token_mean", description="Loss aggregation (tandem.algo.AGGREGATIONS): `token_mean` (DAPO), "
        "`seq_mean_token_mean` (original GRPO), `seq_mean_token_sum`, `seq_mean_token_sum_norm` (Dr.GRPO).",
    )
    clip_low: float = Field(
        0.2, ge=0.0, description="Lower clip: ratio >= 1 - clip_low, in `clip` and in `cispo`'s weight (as verl). "
        "A value >= 1 means no lower bound (a ratio is > 0): the CISPO paper's upper-only weight is clip_low >= 1 "
        "(verl's example sets 10).",
    )
    clip_high: float = Field(
        0.2, ge=0.0, description="Upper clip: ratio <= 1 + clip_high. DAPO's clip-higher uses 0.28.",
    )
    kl_coef: float = Field(
        0.0, ge=0.0, description="Weight of KL(policy || reference) in the loss. 0 = no reference model is loaded.",
    )
    kl_estimator: str = Field("k3", description="KL estimator (tandem.algo.KL_ESTIMATORS): k1, k2 or k3 (GRPO's).")
    kl_ratio_correction: bool = Field(
        False, description="Multiply the KL term's estimate by the importance ratio pi / pi_old (with its gradient), "
        "as TRL's use_bias_correction_kl (its default) and DeepSeek-V3.2: k3's gradient then is that of the reverse "
        "KL(policy || reference). Off (the default): k3's sampled gradient is that of the forward KL(reference || "
        "policy), as in DeepSeekMath's GRPO and verl's default, the recipes tandem's presets follow. Needs a KL term "
        "in the loss (kl_coef > 0, kl_in_reward false).",
    )
    adv_eps: float = Field(
        1e-6, gt=0.0, description="Added to the group std so equal rewards give advantage 0, not NaN.",
    )
    mu: int = Field(1, ge=1, description="Policy updates per batch (GRPO's mu) against the stored old logprobs.")
    dual_clip: float | None = Field(
        None, gt=1.0, description="Dual clip (Ye et al. 2020): for A < 0 a token's loss is at most -c*A, so a huge "
        "ratio on a bad token cannot blow up. None = off. Used by `clip`.",
    )
    gspo_clip_low: float = Field(3e-4, ge=0.0, description="GSPO's clip range below 1 for its sequence-level ratio.")
    gspo_clip_high: float = Field(4e-4, ge=0.0, description="GSPO's clip range above 1 for its sequence-level ratio.")
    kl_in_reward: bool = Field(
        False, description="Subtract kl_coef * sum_t KL from each completion's reward (InstructGPT style) instead of "
        "adding a KL loss term.",
    )
    entropy_coef: float = Field(
        0.0, ge=0.0, description="Weight of an entropy bonus in the loss; 0 = off (entropy is still a metric).",
    )
    tis_cap: float | None = Field(
        None, gt=0.0, description="Truncated importance sampling (Yao et al. 2025): weight each token's loss by "
        "min(pi_old / pi_sampler, cap) to correct sampler/trainer mismatch (vLLM numerics, async). None = off; "
        "2.0 is common.",
    )
    is_mask: Literal["none", "token", "sequence"] = Field(
        "none", description="Masked importance sampling (tandem.algo.IS_MASKS), an alternative to tis_cap: weigh "
        "each token's loss by the ratio r = pi_old / pi_sampler, but drop what leaves `is_mask_band` from the loss "
        "instead of capping it. `token`: IcePop, each token by its own ratio, masked outside the band. `sequence`: "
        "MIS, each sequence by its geometric-mean ratio, masked whole outside the band. For samples whose policy is "
        "far from the trainer's (placement.schedule: stream under rollout.partial: resume mixes versions within a "
        "sequence; vLLM numerics). `is_masked_frac` reports the share masked. none = off.",
    )
    is_mask_band: tuple[float, float] = Field(
        (0.5, 2.0), description="The ratios [low, high] is_mask keeps (low <= 1 <= high). The default is symmetric "
        "in log space (a factor of 2 either way); IcePop's paper uses [0.5, 5].",
    )
    dynamic_sampling: bool = Field(
        False, description="DAPO dynamic sampling: drop groups whose rewards are all equal (zero advantage) and "
        "sample more prompts until prompts_per_step groups survive.",
    )
    max_sampling_rounds: int = Field(
        4, ge=1, description="Cap on rollout rounds per step under dynamic_sampling; then train on the groups that "
        "survived, or, where none did, on the last round's groups as they are (all their advantages are 0 under a "
        "group baseline: the step trains on the KL and entropy terms only).",
    )
    overlong_buffer: int = Field(
        0, ge=0, description="DAPO soft overlong punishment: the reward ramps down over the last N tokens before "
        "rollout.max_new_tokens (multi-turn: before a conversation's token limit, env.max_tokens); 0 = off.",
    )
    overlong_penalty: float = Field(1.0, ge=0.0, description="The penalty reached at the length limit.")
    mask_truncated: bool = Field(False, description="DAPO overlong filtering: truncated completions give no gradient.")
    router_replay: bool = Field(
        False, description="Mixture of experts: the trainer's forwards (old, reference, current policy) send each "
        "token to the experts the sampler's routers chose for it (`Completion.routes`; recorded by the hf engine "
        "only), with the gradient through the chosen experts' gate weights, so that a router flip between sampler "
        "and trainer numerics does not change which experts a token's logprob comes from. Off by default: it "
        "trains a routing the current router may no longer pick; `moe/route_mismatch` (without it) shows whether it is "
        "needed, `moe/route_mismatch_unreplayed` (with it) what it overrides. Rows without routes route on their own.",
    )
    distill: DistillConfig = Field(
        default_factory=DistillConfig, description="On-policy distillation from a teacher model (off while "
        "distill.teacher is empty).",
    )
    router_aux_coef: float | None = Field(
        None, ge=0.0, description="Mixture of experts: weight of the Switch load-balancing loss of each policy "
        "forward, added to the policy loss and reported as `moe/aux_loss`. None = the model config's "
        "`router_aux_loss_coef` (what the model was trained with, 0.001 for Qwen3-MoE and Mixtral); 0 = off. As in "
        "transformers (and Megatron's default), it balances each forward's tokens, so it depends on how a batch is "
        "cut into micro-batches and ranks: with it on, a sharded update differs from one process's by that term "
        "(2.5e-4 relative in the loss on a tiny Qwen3-MoE under FSDP 2); the exactness tests set 0.",
    )


class OptimConfig(Section):
    lr: float = Field(1e-5, gt=0.0, description="Peak learning rate (AdamW). Tiny models tolerate ~1e-4..1e-3.")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW decoupled weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    eps: float = Field(1e-8, gt=0.0, description="AdamW epsilon.")
    grad_clip: float = Field(1.0, ge=0.0, description="Clip the global gradient norm to this; 0 = off.")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up optimizer steps.")
    schedule: Literal["constant", "cosine"] = Field(
        "constant", description="LR after warm-up: constant, or cosine decay to min_lr_ratio.",
    )
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0, description="Cosine floor as a fraction of lr.")


class LoraConfig(Section):
    """LoRA adapters on the policy (through PEFT): only the adapters train, and only they travel to split samplers."""

    enabled: bool = Field(
        False, description="Train LoRA adapters instead of every weight. The optimizer state and gradients shrink to "
        "the adapters' (a few MB); the reference model for KL is the base with the adapters switched off, not a "
        "second copy.")
    rank: int = Field(8, ge=1, description="Adapter rank r: each targeted weight W [out, in] learns B [out, r] @ A "
                      "[r, in]. 8 is the common default (TRL, PEFT); raise it for harder tasks.")
    alpha: float = Field(16.0, gt=0.0, description="LoRA scaling numerator: the update is (alpha / rank) * B @ A. "
                         "16 = 2 x the default rank, as PEFT's and TRL's examples use.")
    dropout: float = Field(
        0.0, ge=0.0, lt=1.0, description="Dropout on the adapters' input while training. 0 by default: with dropout "
        "the trainer's logprobs are random, so they cannot equal the sampler's (the per-step logprob check) nor the "
        "old policy's (the ratio) exactly.")
    target_modules: list[str] = Field(
        default_factory=list, description="Module names (a suffix of the full name, PEFT's rule) that get adapters. "
        "Empty = the architecture's attention and MLP projections (tandem.architectures.SUPPORT lists them; "
        "PEFT's `all-linear` for an architecture outside it) when lora.target_parameters is empty too. A name that "
        "matches no module is refused before the model loads.")
    target_parameters: list[str] = Field(
        default_factory=list, description="Parameters (a suffix of the full name) that get adapters as parameters, "
        "PEFT's `target_parameters`: an MoE's fused 3-D experts (`mlp.experts.gate_up_proj`, [experts, out, in]), "
        "which are no linear layers, each expert its own rank-r adapter. With both lists empty, the architecture's "
        "defaults: a Qwen3-MoE's or Mixtral's experts beside its attention; name lora.target_modules alone to leave "
        "the experts unadapted. Needs lora.dropout: 0 (PEFT has no dropout for them) and placement.expert_parallel: "
        "1 (the adapters see each layer's experts whole).")
