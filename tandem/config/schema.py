"""The whole config: its sections, what they decide together (the completion length limit, where the old logprobs
come from), and the cross-field checks run on every validation."""
from __future__ import annotations

from pydantic import Field, model_validator

from tandem.config.algo import AlgoConfig, BatchConfig, LoraConfig, OldLogprobs, OptimConfig
from tandem.config.base import Section
from tandem.config.checks import check
from tandem.config.placement import PlacementConfig
from tandem.config.rollout import EnvConfig, RolloutConfig
from tandem.config.run import DataConfig, ModelConfig, RunConfig
from tandem.config.scoring import EvalConfig, RewardPoolConfig, RewardSpec


class Config(Section):
    """A run's whole config: one section per concern, checked together once each is valid."""

    run: RunConfig = Field(default_factory=RunConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    batch: BatchConfig = Field(default_factory=BatchConfig)
    algo: AlgoConfig = Field(default_factory=AlgoConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig, description="LoRA adapters instead of full fine-tuning.")
    env: EnvConfig = Field(default_factory=EnvConfig, description="Multi-turn rollouts with an environment (tools).")
    rewards: list[RewardSpec] = Field(
        default_factory=lambda: [RewardSpec(name="arithmetic_exact"), RewardSpec(name="arithmetic_format", weight=0.1)],
        description="Weighted sum of reward functions; each function's mean is its own metric.",
    )
    reward_pool: RewardPoolConfig = Field(default_factory=RewardPoolConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    placement: PlacementConfig = Field(default_factory=PlacementConfig)

    @property
    def max_completion_tokens(self) -> int:
        """The longest completion a row can have: one turn's rollout.max_new_tokens, or a conversation's
        env.max_tokens."""
        e = self.env
        if not e.name:
            return self.rollout.max_new_tokens
        return e.max_tokens or e.max_turns * self.rollout.max_new_tokens

    @property
    def old_logprobs(self) -> OldLogprobs:
        """The old-logprob source this config trains with (see OldLogprobs)."""
        a = self.algo
        if self.placement.schedule in ("async", "stream"):
            corrected = a.tis_cap is not None or a.is_mask != "none"
            return OldLogprobs.RECOMPUTED if corrected else OldLogprobs.SAMPLER
        if a.mu == 1 and self.batch.mini_batches == 1 and not a.kl_in_reward:
            return OldLogprobs.CURRENT
        return OldLogprobs.RECOMPUTED

    @model_validator(mode="after")
    def _cross_field_checks(self) -> "Config":
        """The settings that must agree with each other (tandem.config.checks); the first problem found is raised."""
        check(self)
        return self
