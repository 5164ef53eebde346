"""The whole config: its sections, what they decide together (the completion length limit, where the old logprobs
come from), and the cross-field checks run on every validation: settings each valid alone that cannot run together,
refused naming the fields and the fix, before any model loads."""
from __future__ import annotations

from pydantic import Field, model_validator

from tandem.config.algo import (GROUP_BASELINES, REGISTERED, AlgoConfig, BatchConfig, LoraConfig, OldLogprobs,
                                OptimConfig)
from tandem.config.base import ConfigError, Section, suggest
from tandem.config.placement import PlacementConfig
from tandem.config.rollout import EnvConfig, RolloutConfig
from tandem.config.run import DataConfig, ModelConfig, RunConfig
from tandem.config.scoring import VERDICT_DIGITS, EvalConfig, RewardPoolConfig, RewardSpec, template_fields


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
        """The settings that must agree with each other (`check` below); the first problem found is raised."""
        check(self)
        return self


def check(cfg: Config) -> None:
    """Raise ConfigError naming the first setting that contradicts another: the algorithm's, the lengths against
    their budgets and the data, the engine's, the placement's."""
    _algo(cfg)
    _length(cfg)
    _engine(cfg)
    _placement(cfg)


def _algo(cfg: Config) -> None:
    """The algorithm's settings: registered names, and combinations that would train on nothing or ignore a
    field."""
    a = cfg.algo
    for field, table in REGISTERED.items():
        value = getattr(a, field)
        if value not in table:
            raise ConfigError(f"algo.{field}: {value!r} is not registered{suggest(value, table)}; "
                              f"choose one of: {', '.join(sorted(table))}")
    if cfg.batch.group_size < 2 and a.advantage in GROUP_BASELINES:
        raise ConfigError(
            f"batch.group_size: {cfg.batch.group_size} leaves every GRPO advantage at 0 (a group of one has no "
            "relative reward); use group_size >= 2, or algo.advantage: reinforce_pp (no group baseline)")
    if a.is_mask != "none" and a.tis_cap is not None:
        raise ConfigError(f"algo.is_mask: {a.is_mask} with algo.tis_cap: {a.tis_cap}: both weigh the loss by "
                          "pi_old / pi_sampler, one capping it, one masking outside a band; set one of them")
    low, high = a.is_mask_band
    if not 0 < low <= 1 <= high:
        raise ConfigError(f"algo.is_mask_band: [{low}, {high}] must hold 1 with 0 < low <= 1 <= high (a ratio "
                          "of 1, a token sampled by the trainer's own policy, is always kept)")
    if a.kl_in_reward and a.kl_coef == 0:
        raise ConfigError("algo.kl_in_reward: true needs algo.kl_coef > 0 (the penalty's weight)")
    if a.kl_ratio_correction and (a.kl_coef == 0 or a.kl_in_reward):
        why = "algo.kl_coef is 0" if a.kl_coef == 0 else "algo.kl_in_reward puts the KL in the reward"
        raise ConfigError(f"algo.kl_ratio_correction: true needs a KL term in the loss ({why}), else it does "
                          "nothing; set algo.kl_coef > 0 with algo.kl_in_reward: false, or drop it")

def _length(cfg: Config) -> None:
    """Batch arithmetic, sequence lengths against their budgets, and the data and rewards a run needs."""
    b = cfg.batch
    if b.prompts_per_step % b.mini_batches:
        raise ConfigError(
            f"batch.mini_batches: {b.mini_batches} does not divide batch.prompts_per_step={b.prompts_per_step} "
            "(a group is never split across optimizer steps); pick a divisor of prompts_per_step")
    longest = cfg.data.max_prompt_tokens + cfg.max_completion_tokens
    limit = "env.max_tokens (or env.max_turns x rollout.max_new_tokens)" if cfg.env.name else "rollout.max_new_tokens"
    if b.micro_batch_tokens < longest:
        raise ConfigError(
            f"batch.micro_batch_tokens: {b.micro_batch_tokens} cannot hold one sequence of up to "
            f"data.max_prompt_tokens + {limit} = {longest} tokens; set it to at least {longest}")
    v = cfg.rollout.vllm
    if cfg.rollout.engine == "vllm" and v.max_model_len and v.max_model_len < longest:
        raise ConfigError(f"rollout.vllm.max_model_len: {v.max_model_len} is below data.max_prompt_tokens + "
                          f"{limit} = {longest}; raise it or set 0 (the model's limit)")
    if cfg.algo.overlong_buffer > cfg.max_completion_tokens:
        raise ConfigError(f"algo.overlong_buffer: {cfg.algo.overlong_buffer} exceeds {limit}="
                          f"{cfg.max_completion_tokens}; the ramp must fit inside the length limit")
    _data(cfg)
    if not cfg.rewards:
        raise ConfigError("rewards: empty; name at least one reward function")
    _rewards(cfg)


# RewardSpec's fields that only some rewards read, by the reward that reads them
READ_BY = {"path": ("model", "judge"), "normalize": ("model",), "batch_tokens": ("model",),
           "template": ("judge",), "verdict": ("judge",), "engine": ("judge",), "max_new_tokens": ("judge",),
           "score_range": ("judge",)}


def _rewards(cfg: Config) -> None:
    """A reward model and a judge need their path; a field only another reward reads is refused. (What the path
    holds is checked where models are loaded, still before any loads: tandem.train.reward_model.check,
    tandem.rollout.judge.check.)"""
    for i, spec in enumerate(cfg.rewards):
        if spec.name in ("model", "judge") and not spec.path:
            what = ("a reward model; set it to a local sequence-classification checkpoint with one output (a folder "
                    "with config.json, *.safetensors and its tokenizer)") if spec.name == "model" else \
                "a generative judge; set it to a local causal-LM folder"
            raise ConfigError(f"rewards[{i}].path: empty, but name: {spec.name} scores with {what}")
        fields = type(spec).model_fields
        given = [f for f, names in READ_BY.items() if spec.name not in names and getattr(spec, f) != fields[f].default]
        if given:
            readers = sorted({n for f in given for n in READ_BY[f]})
            raise ConfigError(f"rewards[{i}]: {', '.join(f'{f}: {getattr(spec, f)!r}' for f in given)} is read only "
                              f"by name: {' or '.join(readers)}, and this reward is {spec.name!r}; remove "
                              f"{'it' if len(given) == 1 else 'them'}, or set name: {readers[0]}")
        if spec.name in ("model", "judge") and spec.kwargs:
            own = ", ".join(f for f, names in READ_BY.items() if spec.name in names)
            raise ConfigError(f"rewards[{i}].kwargs: {sorted(spec.kwargs)}: name: {spec.name} takes no kwargs; its "
                              f"settings are the fields {own}")
        if spec.name == "judge":
            _judge(i, spec)


def _judge(i: int, spec) -> None:
    """A judge's template (field names only: which fields the rows have is checked when the data loads,
    tandem.rollout.judge.check_fields) and the range its verdicts are read in."""
    template_fields(spec.template, f"rewards[{i}].template")
    low, high = spec.score_range
    shown = f"rewards[{i}].score_range: [{low}, {high}]"
    if spec.verdict != "score" and spec.score_range != type(spec).model_fields["score_range"].default:
        raise ConfigError(f"{shown} is read by verdict: score only, and this judge's verdict is {spec.verdict!r} "
                          "(a completion scores 1 or 0); remove it, or set verdict: score")
    if not low < high:
        raise ConfigError(f"{shown} must hold low < high: the lowest and the highest score the template asks for")
    if max(abs(low), abs(high)) >= 10 ** VERDICT_DIGITS:
        raise ConfigError(f"{shown} holds scores a verdict cannot write: a <score> number has at most "
                          f"{VERDICT_DIGITS} digits before its point; use a range within ±{10 ** VERDICT_DIGITS - 1}")


def _data(cfg: Config) -> None:
    """The data settings a task reads: a path for gsm8k and jsonl; none of the split and subset settings for the
    built-in tasks, which generate their own training and held-out prompts. (Whether the data has the splits and
    subsets named is checked where it is opened, before any model loads: tandem.data.rows.)"""
    d = cfg.data
    if d.task in ("gsm8k", "jsonl") and not d.path:
        raise ConfigError(f"data.path: empty, but data.task={d.task!r} reads data; set data.path (a file, a "
                          "dataset folder or a Hugging Face dataset id)")
    if d.task in ("arithmetic", "multiply", "long_tail"):
        given = [f"data.{f}: {getattr(d, f)}" for f in ("split", "subset", "eval_split", "eval_subset")
                 if getattr(d, f) != type(d).model_fields[f].default]
        if given:
            raise ConfigError(f"{', '.join(given)}: data.task={d.task} generates its own training and held-out "
                              "prompts and reads no dataset; remove them, or set data.task to gsm8k or jsonl")
    if d.eval_subset and not d.eval_path:
        raise ConfigError(f"data.eval_subset: {d.eval_subset}, but data.eval_path is empty: the held-out split "
                          "then comes from data.path, whose subset is data.subset; set data.eval_path, or remove "
                          "data.eval_subset")


def _stream(cfg: Config) -> None:
    """Where placement.schedule: stream runs: split placement or one process."""
    pl = cfg.placement
    if pl.mode == "colocate" and pl.backend == "ray":
        raise ConfigError("placement.schedule: stream runs in split placement or in one process "
                          "(placement.backend: local); colocated Ray workers time-slice their devices, so there "
                          "is nothing to stream into; use placement.mode: split")


def _stream_only_fields(cfg: Config) -> None:
    """The rollout fields only placement.schedule: stream reads: set to anything but their defaults under another
    schedule, they would do nothing (the defaults pass: a resolved config, `tandem config`'s, holds them all)."""
    fields = type(cfg.rollout).model_fields
    given = [f for f in ("max_in_flight", "partial", "in_flight_weights")
             if getattr(cfg.rollout, f) != fields[f].default]
    if given:
        settings = ", ".join(f"rollout.{f}: {getattr(cfg.rollout, f)}" for f in given)
        raise ConfigError(f"{settings}: only placement.schedule: stream reads {'it' if len(given) == 1 else 'them'}"
                          f" (its requests in flight), and this run's schedule is {cfg.placement.schedule}, where "
                          f"{'it does' if len(given) == 1 else 'they do'} nothing; remove "
                          f"{'it' if len(given) == 1 else 'them'}, or set placement.schedule: stream")

def _engine(cfg: Config) -> None:
    """Settings that only one engine has."""
    r = cfg.rollout
    if r.tensor_parallel > 1 and r.engine != "vllm":
        raise ConfigError(f"rollout.tensor_parallel: {r.tensor_parallel} needs rollout.engine: vllm (the "
                          f"{r.engine} engine has no tensor parallel); set rollout.tensor_parallel=1")


def _model_workers(cfg: Config) -> None:
    """placement.reward_workers and teacher_workers: Ray workers for models in the loop, only where there is one."""
    pl = cfg.placement
    for field, what, wanted in (
            ("reward_workers", "a reward model or a judge (rewards: name: model or name: judge)",
             any(s.name in ("model", "judge") for s in cfg.rewards)),
            ("teacher_workers", "a distillation teacher (algo.distill.teacher)", bool(cfg.algo.distill.teacher))):
        n = getattr(pl, field)
        if n and pl.backend != "ray":
            raise ConfigError(f"placement.{field}: {n} starts Ray workers: it needs placement.backend: ray; or set "
                              f"placement.{field}=0 to run {what} in this process")
        if n and not wanted:
            raise ConfigError(f"placement.{field}: {n} reserves workers for {what}, and the config has none; set "
                              f"placement.{field}=0")


def _context_parallel(cfg: Config, trainers: int) -> None:
    """What placement.context_parallel needs beside the model (whose heads and layers `tandem.architectures` checks)."""
    pl = cfg.placement
    cp = pl.context_parallel
    if cp == 1:
        return
    field = "workers" if pl.mode == "colocate" else "train_workers"
    if trainers % (cp * pl.tensor_parallel):
        raise ConfigError(f"placement.context_parallel: {cp} x tensor_parallel: {pl.tensor_parallel} does not divide "
                          f"placement.{field}={trainers}; training workers form a dp x cp x tp mesh")
    if not cfg.batch.padding_free:
        raise ConfigError(f"placement.context_parallel: {cp} splits each micro-batch's rows laid end to end; set "
                          "batch.padding_free: true")
    if pl.expert_parallel > 1:
        raise ConfigError(f"placement.context_parallel: {cp} with placement.expert_parallel: {pl.expert_parallel}: "
                          "context parallel runs dense models only so far; set one of them to 1")
    if cfg.lora.enabled:
        raise ConfigError(f"placement.context_parallel: {cp} with lora.enabled is not tested yet; set "
                          "placement.context_parallel: 1 (FSDP shards the base weights) or lora.enabled: false")


def _placement(cfg: Config) -> None:
    """Where the workers run, and what the engines and adapters need of that."""
    pl = cfg.placement
    distributed = pl.workers > 1 or pl.mode == "split"
    if distributed and pl.backend != "ray":
        what = "placement.mode: split" if pl.mode == "split" else f"placement.workers: {pl.workers}"
        raise ConfigError(f"{what} needs placement.backend: ray (the local backend runs one worker in this "
                          "process); set placement.backend=ray")
    trainers = pl.workers if pl.mode == "colocate" else pl.train_workers
    if trainers % pl.tensor_parallel:
        field = "workers" if pl.mode == "colocate" else "train_workers"
        raise ConfigError(f"placement.tensor_parallel: {pl.tensor_parallel} does not divide placement.{field}="
                          f"{trainers}; training workers form a dp x tp mesh")
    _context_parallel(cfg, trainers)
    if trainers % pl.expert_parallel:
        field = "workers" if pl.mode == "colocate" else "train_workers"
        raise ConfigError(f"placement.expert_parallel: {pl.expert_parallel} does not divide placement.{field}="
                          f"{trainers}; each group of expert_parallel training workers holds all the experts")
    if pl.expert_parallel > 1 and pl.tensor_parallel > 1:
        raise ConfigError(f"placement.expert_parallel: {pl.expert_parallel} with placement.tensor_parallel: "
                          f"{pl.tensor_parallel}: expert parallelism replaces tensor parallelism for the experts "
                          "and the two are not combined yet; set one of them to 1")
    _model_workers(cfg)
    if pl.schedule == "async" and pl.mode != "split":
        raise ConfigError("placement.schedule: async needs placement.mode: split (colocated workers time-slice "
                          "one device: there is nothing to overlap); use schedule: sync or mode: split")
    if pl.schedule == "stream":
        _stream(cfg)
    else:
        _stream_only_fields(cfg)
    r = cfg.rollout
    colocated_vllm = pl.backend == "ray" and pl.mode == "colocate" and r.engine == "vllm"
    if colocated_vllm and pl.workers % r.tensor_parallel:
        raise ConfigError(f"rollout.tensor_parallel: {r.tensor_parallel} does not divide placement.workers="
                          f"{pl.workers}; each vLLM engine spans tensor_parallel colocated workers")
    if colocated_vllm and r.vllm.mode == "server":
        raise ConfigError("rollout.vllm.mode: server inside colocated Ray workers is not supported yet; use "
                          "rollout.vllm.mode: inprocess (one in-process engine per worker)")
    if pl.mode == "split" and r.tensor_parallel > 1:
        raise ConfigError("rollout.tensor_parallel > 1 is not supported with placement.mode: split yet; use "
                          "placement.mode: colocate, or rollout.tensor_parallel=1")
    bound = cfg.rollout.max_logprob_diff
    if isinstance(bound, float) and not bound > 0:
        raise ConfigError(f"rollout.max_logprob_diff: {bound} would stop every step; use a positive bound, "
                          "'auto', or null to turn the check off")
    if cfg.lora.enabled and pl.tensor_parallel > 1:
        raise ConfigError(f"lora.enabled with placement.tensor_parallel: {pl.tensor_parallel}: tandem's TP plan "
                          "shards plain linear layers, not LoRA's wrapped ones; use placement.tensor_parallel: 1 "
                          "(FSDP shards the base weights; the adapters' state is small)")
    lora_on_experts = cfg.lora.target_parameters or not cfg.lora.target_modules  # see LoraConfig
    if cfg.lora.enabled and pl.expert_parallel > 1 and lora_on_experts:
        raise ConfigError(f"lora.enabled with placement.expert_parallel: {pl.expert_parallel} adapts the experts "
                          "(lora.target_parameters, or the architecture's default), which PEFT's adapters need "
                          "whole on every rank; name the attention alone (lora.target_modules: [q_proj, k_proj, "
                          "v_proj, o_proj], lora.target_parameters: []), or set placement.expert_parallel: 1")
    if cfg.lora.enabled and r.engine == "vllm" and cfg.lora.rank > 512:
        raise ConfigError(f"lora.rank: {cfg.lora.rank} is above 512, the largest LoRA rank vLLM serves; use a "
                          "smaller rank, or rollout.engine: hf")
    if cfg.eval.k > 1 and cfg.eval.temperature == 0:
        raise ConfigError("eval.temperature: 0 with eval.k > 1 gives k identical samples; set a temperature > 0")
