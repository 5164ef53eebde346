"""Every metric a run can log: its name or pattern, unit, meaning, and the runs that log it (the metrics reference)."""
from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass

EVERY_RUN = "every run"

# What measures the machine rather than the run: wall times, throughputs and memory. The rest of a row is the same
# for the same config and seed on the same machine (docs/architecture.md), which resume tests and
# scripts/same_metrics.py compare.
MACHINE_MEASURED = ("time/", "tokens_per_s", "rollout/tokens_per_s", "memory/")


def without_machine(rows: list[dict]) -> list[dict]:
    """Metrics rows without their `MACHINE_MEASURED` keys: what two runs of the same config must log alike."""
    return [{k: v for k, v in r.items() if not k.startswith(MACHINE_MEASURED)} for r in rows]


@dataclass(frozen=True)
class Metric:
    """One metric, or a family of them: in `name` each `<placeholder>` stands for what `PLACEHOLDERS` says."""

    name: str
    unit: str
    meaning: str  # what it is, how it is computed, what a user reads it for
    written: str = EVERY_RUN  # which runs write it: every run, or the setting (and event) that makes a run write it
    demos: bool = True  # a run of the demo, the tools demo or the MoE demo writes it (tests/run/test_metric_names.py)
    event: bool = False  # written only at the steps where something happens (`written` says what), so maybe by a demo

    def pattern(self, values: Mapping[str, Collection[str]] | None = None) -> re.Pattern:
        """`name` as a regular expression: a placeholder matches its `PLACEHOLDERS` expression, or one of
        `values[placeholder]` where given (a run's reward names, say)."""
        values = values or {}

        def part(placeholder: str) -> str:
            given = values.get(placeholder)
            return "(?:" + "|".join(map(re.escape, given)) + ")" if given else PLACEHOLDERS[placeholder][0]

        pieces = re.split(r"<(\w+)>", self.name)  # text, placeholder, text, ...
        return re.compile("".join(part(p) if i % 2 else re.escape(p) for i, p in enumerate(pieces)))


# Each placeholder: the regular expression of its values, and what it stands for.
PLACEHOLDERS: dict[str, tuple[str, str]] = {
    "reward": (r"[^/]+", "a reward function's name as `rewards:` lists it (a registered name or a plugin's "
                         "`module:function`; a name listed twice: `<name>_2` the second time), or `env` for an "
                         "environment's own reward (`env.name`)"),
    "kind": (r"[a-z_]+", "how a reward failed on a sample: `raised` (an exception or sys.exit), `bad_value` (not a "
                         "number finite in float32, alone or weighted and summed into its sample's total), "
                         "`timeout` (past `reward_pool.timeout_s`), `crashed` (its worker process died), `pool` "
                         "(the worker pool failed), `budget` (not scored within `reward_pool.step_budget_s`)"),
    "error": (r"[a-z_]+", "how a tool call failed (`tandem.rollout.tools.base.ERRORS`): `bad_call`, `timeout`, "
                          "`crashed`, `too_long`"),
    "phase": (r"[a-z]+", "a colocated worker's phase: `generate`, `logprobs`, `update`, `sync`"),
    "k": (r"[0-9]+", "`eval.k`, the samples per prompt; `pass@` is logged at 1 and 2 too"),
    "metric": (r".+", "a name of the group Evaluation (`eval/...`)"),
}

# Titles and what each group is for, then its metrics. The order is the reference page's.
GROUPS: dict[str, tuple[str, tuple[Metric, ...]]] = {
    "Row": ("Every line of metrics.jsonl is one step's row.", (
        Metric("step", "count", "The step the row describes: 1 to `run.steps`; step 0 is the row of the evaluation "
               "of the starting model, written before the first step (a new run's only)."),
    )),
    "Reward": ("What the trained samples scored: the first curves to read, to see whether the policy learns.", (
        Metric("reward/mean", "score", "Mean total reward of the samples the step trains on: each reward function's "
               "score times its weight, summed, plus an environment's own reward, DAPO's overlong penalty "
               "(`algo.overlong_buffer`), minus the KL penalty with `algo.kl_in_reward`. The headline curve: it "
               "rises as the policy learns."),
        Metric("reward/std", "score", "Standard deviation of the total reward over the step's trained samples. Near "
               "0 means the samples score alike: a group baseline then gives advantages near 0 and the step "
               "teaches little (dynamic sampling, `algo.dynamic_sampling`, keeps only groups with a spread)."),
        Metric("reward/<reward>", "score", "Mean raw (unweighted) score of one reward function over the step's "
               "trained samples: which part of the total reward moves."),
        Metric("reward/<reward>/std", "score", "Standard deviation of one reward function's raw score over the "
               "step's trained samples."),
        Metric("train/accuracy", "fraction", "Share of the step's trained samples that the first reward listed "
               "scores >= 1 (correct): the training-set accuracy, at the sampling temperature."),
        Metric("reward/errors/<reward>", "count", "Samples of the step (every sampling round) on which a reward "
               "function failed, each scored 0 and logged once per function and kind with the sample. Above 0, "
               "the run trains on zeros that are no verdict: read `reward/errors/<reward>/<kind>` and the log."),
        Metric("reward/errors/<reward>/<kind>", "count", "The samples of `reward/errors/<reward>` that failed in one "
               "way: which fix a failing reward needs.", written="a step where a reward fails on a sample",
               demos=False, event=True),
        Metric("reward/error_rate/<reward>", "fraction", "Share of the step's scored samples on which a reward "
               "function failed. Over the last 3 steps it stops a run above `reward_pool.max_error_rate`."),
        Metric("time/reward_budget_used", "fraction", "The time of the step's longest scoring of a batch (a "
               "sampling round) as a share of `reward_pool.step_budget_s`: at 1 the budget ran out and the samples "
               "not scored got 0 (kind `budget`). Near 1: raise the budget or `reward_pool.workers`, or speed up "
               "the reward."),
    )),
    "Reward model": ("A reward model (`rewards: [{name: model, path: ...}]`, `tandem.train.reward_model`), each under "
                     "its reward's name, for the step's last scoring (a sampling round); its scores' mean and std "
                     "after `normalize` are `reward/<reward>` and `reward/<reward>/std`.", (
        Metric("time/reward_model/<reward>", "seconds", "Time the reward model took to score the step's samples "
               "(every round): its weights to the device and back, tokenizing, the forwards. Part of `time/reward`.",
               written="a `name: model` reward", demos=False),
        Metric("reward_model/<reward>/batches", "count", "Forwards of the last scoring: the samples packed by "
               "length into at most `batch_tokens` tokens each.", written="a `name: model` reward", demos=False),
        Metric("reward_model/<reward>/batch_rows", "rows", "Mean texts per forward.", written="a `name: model` reward",
               demos=False),
        Metric("reward_model/<reward>/batch_tokens", "tokens", "The largest forward's tokens, padding included "
               "(rows x the longest): at most `batch_tokens` unless one text is longer.",
               written="a `name: model` reward", demos=False),
        Metric("reward_model/<reward>/raw_mean", "score", "Mean of the model's raw outputs (its logits, before "
               "`normalize`) over the samples it scored; a drift up while accuracy does not rise is the policy "
               "exploiting the reward model.", written="a `name: model` reward", demos=False),
        Metric("reward_model/<reward>/raw_std", "score", "Their standard deviation.",
               written="a `name: model` reward", demos=False),
        Metric("memory/reward_model/<reward>/resident_bytes", "bytes", "The reward model's weights on the device "
               "while it scores.", written="a `name: model` reward", demos=False),
        Metric("memory/reward_model/<reward>/idle_bytes", "bytes", "Its weights left on the device between scorings: "
               "0 when it is offloaded (`placement.offload`: `auto` on a GPU, or `true`).",
               written="a `name: model` reward", demos=False),
        Metric("memory/reward_model/<reward>/peak_bytes", "bytes", "The process's peak allocated device memory "
               "while the reward model scored (policy and whatever else is resident, plus its weights and "
               "activations).", written="a `name: model` reward on a GPU", demos=False),
        Metric("memory/reward_model/<reward>/activation_bytes", "bytes", "Of that peak, what its forwards added above "
               "the memory allocated once its weights were in: its activations.",
               written="a `name: model` reward on a GPU", demos=False),
    )),
    "Judge": ("A generative judge (`rewards: [{name: judge, path: ..., template: ...}]`, `tandem.rollout.judge`), "
              "each under its reward's name, for the step's last scoring; its scores are `reward/<reward>`.", (
        Metric("time/judge/<reward>", "seconds", "Time the judge took on the step's samples (every round): "
               "rendering, its greedy generate call, reading the verdicts. Part of `time/reward`.",
               written="a `name: judge` reward", demos=False),
        Metric("judge/<reward>/samples", "count", "Samples of the last scoring (a text rendered for several is "
               "judged once).", written="a `name: judge` reward", demos=False),
        Metric("judge/<reward>/unreadable", "count", "Samples whose verdict the rule (`verdict`) could not read in "
               "the judge's output, or whose score lies outside the judge's `score_range`: each scored 0 and counted "
               "in `reward/errors/<reward>/raised` too. Rising: the judge's template, `max_new_tokens` or "
               "`score_range` does not fit it.", written="a `name: judge` reward", demos=False),
    )),
    "Advantage": ("What the policy gradient weighs each sample by (`algo.advantage`).", (
        Metric("advantage/mean", "advantage", "Mean advantage over the step's samples (reward units, or group "
               "standard deviations for `grpo`). About 0 with a group baseline; far from 0 under `reinforce_pp` "
               "or `algo.kl_in_reward` shows a skewed batch."),
        Metric("advantage/std", "advantage", "Standard deviation of the advantages over the step's samples."),
        Metric("advantage/abs_mean", "advantage", "Mean absolute advantage: how much signal the step carries. 0 "
               "when every group scored alike (nothing to learn from this batch)."),
    )),
    "Completions": ("How long the sampled completions are.", (
        Metric("completion/length_mean", "tokens", "Mean completion length of the step's trained samples (in a "
               "conversation, every token after the prompt, the environment's included)."),
        Metric("completion/length_max", "tokens", "Longest completion of the step's trained samples."),
        Metric("completion/truncated_frac", "fraction", "Share of the step's trained samples that stopped at the "
               "length limit (`rollout.max_new_tokens`, `env.max_tokens`). High: raise the limit, or use "
               "`algo.overlong_buffer` or `algo.mask_truncated`."),
    )),
    "Policy update": ("The update itself, averaged over the step's tokens (`mu` passes) and optimizer steps.", (
        Metric("loss", "scalar", "Mean of the step's optimizer steps' losses: policy loss times any importance "
               "weight, plus the KL and entropy terms and an MoE's load-balancing loss, aggregated as "
               "`algo.loss_agg` says. Its value says little about learning (advantages centre it near 0); a jump "
               "or a NaN does."),
        Metric("grad_norm", "L2 norm", "Mean over the step's optimizer steps of the gradient's global norm before "
               "clipping (`optim.grad_clip`): spikes show unstable steps."),
        Metric("lr", "scalar", "Learning rate after the step's last optimizer step (the next step's), as "
               "`optim.lr` and its schedule give it."),
        Metric("entropy", "nats", "Mean per-token entropy of the policy that sampled the batch, at "
               "`rollout.temperature`, from the trainer's first forward. Falling towards 0: the policy stops "
               "exploring (entropy collapse)."),
        Metric("logprob_diff", "nats", "Mean per-token |trainer logprob - sampler logprob| of the sampled tokens, "
               "before the update: how far the engine's numerics (and, sampled ahead, its weights' age) are from "
               "the trainer's. `rollout.max_logprob_diff` stops a run whose samples the trainer would not draw."),
        Metric("logprob_diff_max", "nats", "The largest per-token |trainer logprob - sampler logprob| of the step."),
        Metric("clip_frac", "fraction", "Share of tokens whose ratio the clip bound held (`clip`: the clipped "
               "surrogate was the smaller; `gspo`: the sequence ratio; `cispo`: the weight was clipped). 0 on "
               "policy with `algo.mu` 1 and one mini-batch; high: the steps are too large."),
        Metric("ratio_mean", "ratio", "Mean per-token ratio pi / pi_old of the current to the old policy (`gspo`: "
               "the sequence ratio). 1 on policy; drifts with `algo.mu` > 1, several mini-batches or stale samples."),
        Metric("dual_clip_frac", "fraction", "Share of tokens with a negative advantage whose loss the dual clip "
               "bounded (-c * A).", written="`algo.dual_clip` set (`clip` loss)", demos=False),
        Metric("tis_capped_frac", "fraction", "Share of tokens whose truncated importance weight pi_old / "
               "pi_sampler was capped at `algo.tis_cap`: how often the sampler/trainer mismatch is large.",
               written="`algo.tis_cap` set", demos=False),
        Metric("is_masked_frac", "fraction", "Share of tokens masked out of the loss because their ratio pi_old / "
               "pi_sampler left `algo.is_mask_band`.", written="`algo.is_mask` token or sequence", demos=False),
        Metric("kl", "nats", "Mean per-token KL estimate (`algo.kl_estimator`) of the policy from the reference "
               "model: how far training has moved the policy; `algo.kl_coef` weighs it.",
               written="`algo.kl_coef` > 0", demos=False),
        Metric("distill/reverse_kl", "nats", "On-policy distillation: mean over the sampled tokens of log pi - log "
               "pi_teacher, the one-sample estimate of the reverse KL(policy || teacher) the distillation lowers; "
               "each token's advantage gains `algo.distill.coef` times its negative. Falls as the student learns.",
               written="`algo.distill.teacher` set", demos=False),
    )),
    "Mixture of experts": ("Routing of a mixture-of-experts model's tokens (the trainer's forwards).", (
        Metric("moe/aux_loss", "scalar", "Mean Switch load-balancing loss of the update's forwards (added to the "
               "loss times `algo.router_aux_coef`): at its least, the experts per token, when the experts share the "
               "tokens evenly.",
               written="a mixture-of-experts model with `algo.router_aux_coef` > 0 (its config's, by default)"),
        Metric("moe/expert_load_max", "fraction", "The largest share of one layer's tokens that one expert "
               "received, the worst layer's (top_k / experts when balanced, 1 when every token went to it): "
               "expert collapse.", written="a mixture-of-experts model"),
        Metric("moe/load_entropy", "fraction", "Entropy of each layer's expert assignments divided by log(experts), "
               "averaged over layers: 1 balanced, 0 all on one expert.", written="a mixture-of-experts model"),
        Metric("moe/route_mismatch", "fraction", "Share of (token, layer) pairs the trainer's forward sent to other "
               "experts than the sampler did: a router flip between sampler and trainer numerics. 0 under "
               "`algo.router_replay` by construction; high without it: turn replay on.",
               written="a mixture-of-experts model sampled by the `hf` engine (its samples carry routes)"),
        Metric("moe/route_mismatch_unreplayed", "fraction", "Share of (token, layer) pairs the trainer's own "
               "routers would have sent elsewhere than the sampler did: what `algo.router_replay` overrode.",
               written="`algo.router_replay` on a mixture-of-experts model sampled by the `hf` engine",
               demos=False),
    )),
    "Rollout": ("Sampling throughput and the samples' age.", (
        Metric("rollout/tokens_per_s", "tokens/s", "Completion tokens of the step's trained samples over "
               "`time/generate`: the engine's sampling rate (a stream may train groups sampled in earlier "
               "steps, so it is absent from a step that sampled nothing).",
               written="a step with `time/generate` > 0 (every step outside a stream)"),
        Metric("tokens_per_s", "tokens/s", "Prompt and completion tokens trained on over `time/step`: the whole "
               "pipeline's rate."),
        Metric("async/staleness", "policy versions", "How many updates behind the trainer the oldest trained "
               "sample's policy was: 0 in a synchronous run, at most `placement.max_staleness` (async, stream)."),
        Metric("async/staleness_mean", "policy versions", "Mean age of the trained tokens' policies (per token, "
               "a stream's requests span several).", written="`placement.schedule: stream`", demos=False),
    )),
    "Dynamic sampling": ("DAPO's dynamic sampling (`algo.dynamic_sampling`): groups without a reward spread dropped.", (
        Metric("dynamic/kept_group_frac", "fraction", "Share of the sampled groups that had a reward spread (kept). "
               "Low: the task is too easy or too hard for the policy, and sampling rounds are wasted.",
               written="`algo.dynamic_sampling: true`", demos=False),
        Metric("dynamic/rounds", "count", "Sampling rounds the step took to fill `batch.prompts_per_step` groups "
               "with a spread (at most `algo.max_sampling_rounds`).",
               written="`algo.dynamic_sampling: true`, schedule `sync` or `async`", demos=False),
        Metric("dynamic/dropped_groups", "count", "Groups that arrived without a reward spread and were dropped.",
               written="`algo.dynamic_sampling: true`, `placement.schedule: stream`", demos=False),
        Metric("sampled/reward/<reward>", "score", "`reward/<reward>` over everything the step sampled, every "
               "round, dropped groups included.", written="`algo.dynamic_sampling: true`, schedule `sync` or "
               "`async`", demos=False),
        Metric("sampled/reward/<reward>/std", "score", "`reward/<reward>/std` over everything the step sampled.",
               written="`algo.dynamic_sampling: true`, schedule `sync` or `async`", demos=False),
        Metric("sampled/train/accuracy", "fraction", "`train/accuracy` over everything the step sampled: the "
               "policy's accuracy before the filter.", written="`algo.dynamic_sampling: true`, schedule `sync` or "
               "`async`", demos=False),
    )),
    "Stream": ("The streaming schedule (`placement.schedule: stream`): samplers decode groups continuously.", (
        Metric("stream/requests_in_flight", "count", "Requests decoding or waiting on the samplers at their last "
               "report.", written="`placement.schedule: stream`", demos=False),
        Metric("stream/tokens_in_flight", "tokens", "Tokens sampled so far by the groups not yet handed out.",
               written="`placement.schedule: stream`", demos=False),
        Metric("stream/groups_waiting", "count", "Finished groups waiting for a later step after this one took "
               "its `batch.prompts_per_step`.", written="`placement.schedule: stream`", demos=False),
        Metric("stream/restarted", "count", "Requests begun again from their prompt because the staleness bound "
               "left their first tokens behind.", written="`placement.schedule: stream`", demos=False),
        Metric("stream/expired_groups", "count", "Finished groups sent back to be sampled again because a token "
               "of theirs became older than `placement.max_staleness` while they waited.",
               written="`rollout.partial: drop` in a stream, a step where a group expires", demos=False, event=True),
        Metric("stream/stale_masked_frac", "fraction", "Share of the trained tokens masked out of the loss for "
               "being older than `placement.max_staleness` (kept as context).",
               written="`rollout.partial: resume` in a stream, a step with such tokens", demos=False, event=True),
    )),
    "Multi-turn": ("Conversations with an environment (`env.name`), over the step's trained samples.", (
        Metric("multiturn/turns_mean", "turns", "Mean model turns per conversation.", written="`env.name` set"),
        Metric("multiturn/tool_calls_mean", "calls", "Mean tool calls per conversation.", written="`env.name` set"),
        Metric("multiturn/tool_call_frac", "fraction", "Share of conversations that call a tool at least once: "
               "whether the policy learns to use its tools.", written="`env.name` set"),
        Metric("multiturn/masked_frac", "fraction", "Share of completion tokens the environment wrote (tool "
               "results), masked out of training.", written="`env.name` set"),
        Metric("multiturn/tool_errors", "count", "Tool calls of the step that failed (counted, never silent).",
               written="`env.name` set"),
        Metric("multiturn/tool_errors/<error>", "count", "The failed tool calls of one kind.",
               written="`env.name` set, a step where a tool call fails", demos=False, event=True),
    )),
    "Weight sync": ("The new weights' way from trainer to sampler after each update.", (
        Metric("sync/bytes", "bytes", "Bytes the step's weight sync moved into the engines (LoRA: the adapters "
               "only)."),
        Metric("time/sync", "seconds", "The weight sync's duration, as its sender measured it."),
    )),
    "Time": ("Where a step's seconds go; compare with `time/step` to find the slowest phase.", (
        Metric("time/step", "seconds", "From the end of the previous step's weight sync (or this step's start, if "
               "later) to the end of this one's: with steps overlapping, each second is counted once."),
        Metric("time/rollout", "seconds", "The controller's wait for the step's samples (under async or stream: "
               "the trainer's idle time waiting for them)."),
        Metric("time/generate", "seconds", "Time the engines spent sampling the step's batch (summed over rounds "
               "and, in a stream, over samplers)."),
        Metric("time/sampler_idle", "seconds", "Time the samplers waited for work before sampling (0 in one "
               "process; split placement: their idle share)."),
        Metric("time/weight_load", "seconds", "Time the samplers spent loading new weights before sampling: "
               "staged weights (split placement) or a stream's reload; 0 where the weight sync loads them."),
        Metric("time/reward", "seconds", "Time spent scoring the step's samples (every round)."),
        Metric("time/trainer_idle", "seconds", "The trainer's wait from the end of its previous work (weight sync) "
               "to this step's batch."),
        Metric("time/logprobs", "seconds", "Time computing old-policy, reference and teacher logprobs before the "
               "update."),
        Metric("time/teacher", "seconds", "The part of time/logprobs the distillation teacher's forwards took; with "
               "placement.teacher_workers, the slowest teacher worker's seconds for the step's batch (beside the "
               "previous update, outside time/logprobs).",
               written="`algo.distill.teacher` set", demos=False),
        Metric("time/update", "seconds", "Time of the update: forwards, backwards and optimizer steps."),
    )),
    "Memory": ("Device memory of a colocated worker (`placement.mode: colocate`, the default).", (
        Metric("memory/<phase>_bytes", "bytes", "Bytes of policy, gradients, optimizer state, reference, teacher and "
               "engine resident on the device (on CPU: in memory) during a phase, after `placement.offload` moved the "
               "idle parts off: the peak is the largest phase.", written="`placement.mode: colocate`"),
    )),
    "Evaluation": ("Held-out prompts (`data.eval_size`), written only in the rows of the steps evaluated: step 0, "
                   "every `run.eval_every` steps and the last.", (
        Metric("eval/accuracy", "fraction", "Share of the held-out prompts whose greedy answer the first reward "
               "scores >= 1: the run's headline result."),
        Metric("eval/reward", "score", "Mean total reward of the greedy answers."),
        Metric("eval/pass@<k>", "fraction", "Unbiased pass@k (Chen et al. 2021) of `eval.k` samples per prompt at "
               "`eval.temperature`: the chance that one of k samples is correct.",
               written="`eval.k` > 1", demos=False),
        Metric("eval/mean@<k>", "fraction", "Share of the `eval.k` samples per prompt that are correct.",
               written="`eval.k` > 1", demos=False),
        Metric("eval/reward_errors/<reward>", "count", "Evaluation samples (greedy and sampled) on which a reward "
               "function failed, scored 0."),
        Metric("eval/reward_errors/<reward>/<kind>", "count", "The failed evaluation samples of one kind.",
               written="an evaluation where a reward fails on a sample", demos=False, event=True),
        Metric("eval/tool_call_frac", "fraction", "Share of the greedy answers that call a tool.",
               written="`env.name` set"),
    )),
    "Trackers": ("Logged to the trackers of `run.report_to` only, not to metrics.jsonl.", (
        Metric("final/<metric>", "as `<metric>`", "The final evaluation's figures once more, at the last step, "
               "for a tracker's run summary.", written="`run.report_to` (the trackers only)", demos=False),
    )),
}

METRICS: tuple[Metric, ...] = tuple(m for _, metrics in GROUPS.values() for m in metrics)


def entry_of(name: str, values: Mapping[str, Collection[str]] | None = None) -> Metric | None:
    """The entry a logged name is: its own, else the first pattern it fits (`Metric.pattern`); None if none."""
    exact = {m.name: m for m in METRICS}
    if name in exact:
        return exact[name]
    return next((m for m in METRICS if "<" in m.name and m.pattern(values).fullmatch(name)), None)
