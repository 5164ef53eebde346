"""Other frameworks' names for tandem's fields, and the hint an unknown key gets: the field another framework's name
means, else the nearest valid key."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from tandem.config.base import suggest
from tandem.config.schema import Config

# Other frameworks' names for tandem's fields (TRL's GRPOConfig and transformers' TrainingArguments, verl's and
# OpenRLHF's options), by the key's last part (or its dotted path, where a section gives it another meaning): a user
# who brings a config from one of them is told the field. (name -> (tandem's field, who calls it so))
KNOWN_ALIASES = {
    "learning_rate": ("optim.lr", "TRL/transformers"), "actor_learning_rate": ("optim.lr", "OpenRLHF"),
    "max_grad_norm": ("optim.grad_clip", "TRL/transformers"), "grad_clip": ("optim.grad_clip", "verl"),
    "adam_epsilon": ("optim.eps", "transformers"), "lr_scheduler_type": ("optim.schedule", "transformers"),
    "num_generations": ("batch.group_size", "TRL"), "n_samples_per_prompt": ("batch.group_size", "OpenRLHF"),
    "n": ("batch.group_size", "verl (rollout.n)"), "train_batch_size": ("batch.prompts_per_step", "verl"),
    "rollout_batch_size": ("batch.prompts_per_step", "OpenRLHF"),
    "beta": ("algo.kl_coef", "TRL"), "kl_loss_coef": ("algo.kl_coef", "verl"),
    "init_kl_coef": ("algo.kl_coef", "OpenRLHF"),
    "kl_loss_type": ("algo.kl_estimator", "verl"), "kl_estimator_type": ("algo.kl_estimator", "OpenRLHF"),
    "epsilon": ("algo.clip_low", "TRL"), "epsilon_high": ("algo.clip_high", "TRL"),
    "clip_ratio": ("algo.clip_low and algo.clip_high", "verl"), "clip_ratio_low": ("algo.clip_low", "verl"),
    "clip_ratio_high": ("algo.clip_high", "verl"), "eps_clip": ("algo.clip_low and algo.clip_high", "OpenRLHF"),
    "num_iterations": ("algo.mu", "TRL"), "ppo_epochs": ("algo.mu", "verl"), "loss_type": ("algo.loss_agg", "TRL"),
    "loss_agg_mode": ("algo.loss_agg", "verl"), "adv_estimator": ("algo.advantage", "verl"),
    "entropy_coeff": ("algo.entropy_coef", "verl"), "mask_truncated_completions": ("algo.mask_truncated", "TRL"),
    "max_completion_length": ("rollout.max_new_tokens", "TRL"), "response_length": ("rollout.max_new_tokens", "verl"),
    "generate_max_len": ("rollout.max_new_tokens", "OpenRLHF"),
    "max_prompt_length": ("data.max_prompt_tokens", "TRL/verl"),
    "prompt_max_len": ("data.max_prompt_tokens", "OpenRLHF"), "use_vllm": ("rollout.engine", "TRL"),
    "vllm_mode": ("rollout.vllm.mode", "TRL"), "tensor_model_parallel_size": ("rollout.tensor_parallel", "verl"),
    "vllm_tensor_parallel_size": ("rollout.tensor_parallel", "TRL/OpenRLHF"),
    "ulysses_sequence_parallel_size": ("placement.context_parallel", "verl"),
    "context_parallel_size": ("placement.context_parallel", "Megatron"),
    "max_steps": ("run.steps", "TRL/transformers"), "total_training_steps": ("run.steps", "verl"),
    "save_steps": ("run.save_every", "TRL/transformers"), "save_freq": ("run.save_every", "verl"),
    "eval_steps": ("run.eval_every", "TRL/transformers"), "test_freq": ("run.eval_every", "verl"),
    "model_name_or_path": ("model.path", "TRL/transformers"), "pretrain": ("model.path", "OpenRLHF"),
    "torch_dtype": ("model.dtype", "transformers"), "lora_rank": ("lora.rank", "verl/OpenRLHF"),
    "lora_r": ("lora.rank", "PEFT"), "lora_alpha": ("lora.alpha", "PEFT/verl"),
    "lora_dropout": ("lora.dropout", "PEFT"), "use_peft": ("lora.enabled", "TRL"),
    "optim.epsilon": ("optim.eps", "AdamW"),  # in the optimizer's section it is AdamW's, not TRL's clip
    "run.tensorboard": ("run.report_to", "earlier tandem"),
    "run_name": ("run.name", "TRL/transformers"), "logger": ("run.report_to", "verl (trainer.logger)"),
}


def unknown_key_hint(key: str, section: str, options) -> str:
    """A hint for an unknown `key` in dotted `section`: another framework's name for a tandem field
    (KNOWN_ALIASES), else the nearest valid key there."""
    alias = KNOWN_ALIASES.get(f"{section}.{key}") or KNOWN_ALIASES.get(key)
    if alias is None:
        return suggest(key, options)
    target, who = alias
    target_section, _, field = target.rpartition(".")
    if target_section == section and field in options:
        return f"; did you mean {field!r}? ({key!r} in {who})"
    return f"; tandem calls it {target} ({key!r} in {who})"


def section_fields(path: tuple) -> list[str]:
    """Valid keys at a dotted location of the config (for 'did you mean')."""
    model: Any = Config
    for part in path:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part)
        if field is None:
            return []
        ann = field.annotation
        inner = getattr(ann, "__args__", None)
        if inner and isinstance(inner[0], type) and issubclass(inner[0], BaseModel):
            ann = inner[0]
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return []
        model = ann
    return list(model.model_fields)
