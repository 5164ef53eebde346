"""Models in the loop beside the policy: reward models and judges (in the controller's process or on Ray workers of
their own, `placement.reward_workers`) and a distillation teacher on workers of its own (`placement.teacher_workers`).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Mapping

import torch

from tandem.architectures import profile
from tandem.config import Config
from tandem.modeling import load_causal_lm, load_tokenizer
from tandem.rollout import judge
from tandem.samples import Samples
from tandem.train import reward_model
from tandem.train.batch import make_micro_batches
from tandem.train.logprobs import routed_logprobs
from tandem.workers.balance import balance
from tandem.workers.group import WorkerContext, WorkerGroup

MODEL_REWARDS = (reward_model.NAME, judge.NAME)  # the rewards a model computes: they may run on workers of their own


def reward_builders(cfg: Config, device: str) -> dict[str, Callable[[Any], Callable[..., Any]]]:
    """What builds each model-backed reward from its config spec, on `device` (`RewardScorer`'s `builders`): a
    reward model offloaded between scorings as colocated workers offload (placement.offload), a judge on an engine
    of its own (or a vLLM server it starts); both in the policy's dtype."""
    m = cfg.model

    def build_judge(spec: Any) -> judge.Judge:
        return judge.make_judge(spec, dtype=m.dtype, seed=cfg.run.seed, device=device,
                                kv_cache_bytes=cfg.rollout.vllm.kv_cache_mb << 20,
                                trust_remote_code=m.trust_remote_code)

    return {reward_model.NAME: reward_model.builder(device, m.dtype, cfg.placement.offloads(device),
                                                    m.trust_remote_code),
            judge.NAME: build_judge}


class RewardHost:
    """One Ray worker of a model-backed reward (`cfg.rewards[index]`), built as the controller would build it on
    this worker's device, scoring its share of each call. A reward model's scores come back raw: `normalize` is
    applied by `RemoteReward` over the whole call (a z-score over one share would be another normalization)."""

    def __init__(self, cfg: Config, index: int, ctx: WorkerContext | None = None):
        ctx = ctx or WorkerContext()
        spec = cfg.rewards[index]
        if spec.name == reward_model.NAME:
            spec = spec.model_copy(update={"normalize": "none"})
        self.reward = reward_builders(cfg, ctx.device)[spec.name](spec)

    def score(self, completions: list[str], prompts: list[str], rows: list[Mapping],
              key: str) -> tuple[list[Any], dict[str, float]]:
        """This share's scores (an exception in the place of a sample that failed) and the reward's metrics, named
        with the scorer's `key`."""
        if not completions:
            return [], {}
        return self.reward(completions, prompts, rows), self.reward.metrics(key)

    def close(self) -> None:
        self.reward.close()


class RemoteReward:
    """The controller's side of a model-backed reward on workers of its own: a batched reward for `RewardScorer`
    that shares each call out over the workers in contiguous runs of samples (a GRPO group's rows are adjacent, so a
    judge still sees a group's prompt once), and merges their scores and metrics. Built with the scorer, before any
    worker starts; `attach` connects it once the placement has started its workers. A worker that dies fails the
    whole call: every sample scores 0 and is counted, and reward_pool.max_error_rate stops the run."""

    def __init__(self, spec: Any):
        self.normalize = spec.normalize if spec.name == reward_model.NAME else "none"
        self.group: WorkerGroup | None = None
        self.key = spec.name
        self._metrics: dict[str, float] = {}

    def attach(self, group: WorkerGroup, key: str) -> None:
        """Score on `group` (RewardHost workers); `key` is the reward's metric name in the scorer."""
        self.group, self.key = group, key

    def __call__(self, completions: list[str], prompts: list[str], rows: list[Mapping]) -> list[Any]:
        if self.group is None:
            raise RuntimeError(f"reward {self.key!r} on placement.reward_workers was called before its workers started")
        n = len(completions)
        cuts = [n * k // self.group.size for k in range(self.group.size + 1)]
        parts = self.group.call_each(RewardHost.score, [
            (completions[a:b], prompts[a:b], rows[a:b], self.key) for a, b in zip(cuts, cuts[1:])])
        self._metrics = merge_metrics([m for _, m in parts])
        return reward_model.normalized([s for scores, _ in parts for s in scores], self.normalize)

    def metrics(self, key: str) -> dict[str, float]:
        return dict(self._metrics)

    def close(self) -> None:
        """Nothing here: the placement stops the workers."""


SUMMED = ("/samples", "/unreadable", "/batches")  # counts over a call: each worker counted its share


def merge_metrics(parts: list[dict[str, float]]) -> dict[str, float]:
    """The workers' figures for one call as one: time and memory are the slowest (largest) worker's, as is the
    largest forward (`batch_tokens`); counts are summed; the rest (means over a share) are averaged over the workers
    that reported them."""
    out: dict[str, float] = {}
    for key in dict.fromkeys(k for p in parts for k in p):
        values = [p[key] for p in parts if key in p]
        if key.startswith(("time/", "memory/")) or key.endswith("/batch_tokens"):
            out[key] = max(values)
        elif key.endswith(SUMMED):
            out[key] = sum(values)
        else:
            out[key] = sum(values) / len(values)
    return out


class TeacherWorker:
    """One Ray worker of a distillation teacher (`placement.teacher_workers`): the teacher's logprob of every
    sampled token of its share of a step, at the sampling temperature, laid out as the trainers lay out their
    micro-batches (the prompt-once layout where its architecture allows, padding-free where it packs and
    batch.padding_free is on)."""

    def __init__(self, cfg: Config, ctx: WorkerContext | None = None):
        ctx = ctx or WorkerContext()
        m = cfg.model
        self.device = torch.device(ctx.device)
        self.teacher = load_causal_lm(cfg.algo.distill.teacher, m.dtype, m.trust_remote_code).eval()
        self.teacher.requires_grad_(False).to(self.device)
        teacher_profile = profile(cfg.algo.distill.teacher)
        self.routing = teacher_profile.routing(self.teacher)
        self.pad_id = load_tokenizer(m.path, m.trust_remote_code).pad_token_id  # the policy's: checked the same
        t = cfg.rollout.temperature
        self.temperature = t if t > 0 else 1.0  # as the policy scores (Policy.temperature)
        self.budget = cfg.batch.micro_batch_tokens
        self.share_prompts = bool(teacher_profile.prompts_once)
        self.padding_free = cfg.batch.padding_free and teacher_profile.packs

    @torch.no_grad()
    def logprobs(self, samples: Samples) -> tuple[list[list[float]], float]:
        """Each row's teacher logprobs, one per completion token, and the seconds they took."""
        start = time.perf_counter()
        out: list[list[float]] = [[] for _ in range(len(samples))]
        for mb in make_micro_batches(samples, self.budget, self.pad_id, by_prompt=self.share_prompts,
                                     packed=self.padding_free):
            mb.to(self.device)
            logp = routed_logprobs(self.teacher, self.routing, mb, self.temperature, share_prompts=self.share_prompts,
                                   packed=self.padding_free)[0].float().cpu()
            for k, i in enumerate(mb.rows):  # right-aligned: a row's completion is its last tokens
                width = len(samples.completions[i].completion_ids)
                out[i] = logp[k, logp.shape[1] - width:].tolist()
        return out, time.perf_counter() - start


def teacher_logprobs(teachers: WorkerGroup, samples: Samples) -> tuple[Samples, float]:
    """`samples` with every completion's `teacher_logprobs` scored on the teacher workers, each taking whole
    groups (balanced by tokens), and the slowest worker's seconds."""
    groups = samples.group.tolist()
    costs = [0] * samples.num_groups
    for g, length in zip(groups, samples.sequence_lengths):
        costs[g] += length
    shares = balance(costs, teachers.size)
    owner = {g: k for k, share in enumerate(shares) for g in share}
    rows = [[i for i, g in enumerate(groups) if owner[g] == k] for k in range(len(shares))]
    parts = teachers.call_each(TeacherWorker.logprobs, [(samples.select(r),) for r in rows])
    scored = list(samples.completions)
    for share, (logprobs, _) in zip(rows, parts):
        for i, lp in zip(share, logprobs):
            scored[i] = dataclasses.replace(scored[i], teacher_logprobs=lp)
    return Samples(scored, samples.group, samples.num_groups), max(s for _, s in parts)

