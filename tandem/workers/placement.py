"""Placement: the controller's one view of its workers, colocated hybrids or split trainers and samplers."""
from __future__ import annotations

import dataclasses
import functools
import uuid
from dataclasses import dataclass, field
from typing import Protocol

import torch

from tandem.architectures import ModelProfile
from tandem.config import Config, ConfigError
from tandem.rollout import ModelPrompt, Rollout, Samples, Sampling
from tandem.workers.balance import balance
from tandem.workers.group import LocalWorkerGroup, Mapped, Pending, WorkerGroup
from tandem.workers.hybrid import HybridWorker
from tandem.workers.rollout import RolloutWorker
from tandem.workers.stream import StreamGroup, StreamReport
from tandem.workers.train import TrainWorker


class Trainer(Protocol):
    """What the placement calls on every worker that trains: `TrainWorker` (split) and `HybridWorker` (colocated)."""

    def prepare(self, samples: Samples) -> torch.Tensor | None: ...

    def train(self, advantages: torch.Tensor) -> dict[str, float]: ...

    def save(self, folder: str) -> None: ...

    def restore(self, folder: str) -> None: ...


class Sampler(Protocol):
    """What the placement calls on every worker that samples: `RolloutWorker` (split) and `HybridWorker`."""

    def generate(self, prompts: list[ModelPrompt], sampling: Sampling, min_version: int = 0) -> Rollout: ...

    def stream_add(self, groups: list[StreamGroup], sampling: Sampling) -> None: ...

    def stream_take(self, timeout: float) -> StreamReport: ...


def merge_shares(parts: list[Rollout], shares: list[list[int]], num_prompts: int) -> Rollout:
    """The samplers' shares of one call as one rollout in prompt order (group = the prompt's index in the call)."""
    rows: list[tuple[int, int]] = []  # (the call's prompt index, part), a share's prompt index mapped to the call's
    for k, (share, part) in enumerate(zip(shares, parts)):
        rows += [(share[g], k) for g in part.samples.group.tolist()]
    flat = [c for part in parts for c in part.samples.completions]
    order = sorted(range(len(rows)), key=lambda i: rows[i][0])  # stable: a group's samples keep their order
    busy = [p for p in parts if p.samples.completions or p.seconds]
    return Rollout(Samples([flat[i] for i in order], [rows[i][0] for i in order], num_prompts),
                   min((p.version for p in busy), default=0), max((p.seconds for p in parts), default=0.0),
                   sum(p.idle_seconds for p in parts), max((p.load_seconds for p in parts), default=0.0))


def _seeded(sampling: Sampling, share: list[int], shares: int) -> Sampling:
    """`sampling` for a share of the prompts, each prompt seeded as in the whole batch (vLLM's seed + i * n), so
    the samples do not depend on how many engines share the prompts. One engine takes the call as it is."""
    if sampling.max_tokens:
        sampling = dataclasses.replace(sampling, max_tokens=tuple(sampling.max_tokens[i] for i in share))
    if sampling.seed is None or shares == 1:
        return sampling
    return dataclasses.replace(sampling, seeds=tuple(int(sampling.seed) + i * sampling.n for i in share))


@dataclass
class Synced:
    """A weight sync in flight: trainers -> samplers, or inside each hybrid worker; `get` waits for its stats."""

    parts: list[Pending]  # the senders' call first (its stats are reported), then the receivers'

    def get(self) -> dict:
        for receivers in self.parts[1:]:  # first: they fail at once if a sender dies (the report names the death)
            receivers.get()
        # The senders' seconds: a receiver starts waiting as soon as the sync is queued, before the update ends.
        senders = self.parts[0].get()
        return dict(senders[0], seconds=max(s["seconds"] for s in senders))


@dataclass
class Placement:
    """What the controller calls, however the workers are placed (built by `build`).

    Calls return at once with a Pending: each worker runs its calls in the order they were submitted, so the
    controller can queue a step's update and weight sync and go on to score the next step's samples meanwhile.
    """

    trainers: WorkerGroup
    samplers: WorkerGroup  # the same group as `trainers` when colocated
    split: bool
    expected_completion_tokens: float = 0.0  # running estimate used to balance prompts over samplers
    groups: list = field(default_factory=list)  # every group started, to shut down
    version: int = 0  # the newest policy version sent to the engines (maybe still on its way)
    engine_tp: int = 1  # workers per rollout engine (vLLM tensor parallel over colocated workers)
    leftovers: list[str] = field(default_factory=list)  # the engines' shared-memory files, removed at shutdown
    reward_hosts: dict[int, WorkerGroup] = field(default_factory=dict)  # placement.reward_workers: rewards[i]'s
    teachers: WorkerGroup | None = None  # placement.teacher_workers: the distillation teacher's

    def submit_generate(self, prompts: list[ModelPrompt], sampling: Sampling) -> Pending[Rollout]:
        """Spread prompts over the samplers so they finish together: balanced by expected tokens, not count.
        The samplers use the newest weights sent so far, waiting for them if they are still on their way. A
        vision-language model's prompts travel with their images; each completion comes back holding its prompt's."""
        expect = self.expected_completion_tokens or sampling.max_new_tokens
        costs = [sampling.n * (len(p.ids) + expect) for p in prompts]
        engines = self.samplers.size // self.engine_tp
        # an engine over engine_tp workers takes one share, the same on each of them
        shares = [s for s in balance(costs, engines) for _ in range(self.engine_tp)]
        per_worker = [([prompts[i] for i in s], _seeded(sampling, s, engines), self.version) for s in shares]
        pending = self.samplers.submit_each(Sampler.generate, per_worker)
        return Mapped(pending, lambda parts: merge_shares(parts, shares, len(prompts)))

    def generate(self, prompts: list[ModelPrompt], sampling: Sampling) -> Rollout:
        return self.submit_generate(prompts, sampling).get()

    def stream_add(self, groups: list[list[StreamGroup]], sampling: Sampling) -> None:
        """placement.schedule: stream: more groups for each sampler (`groups[k]` for sampler k) to sample."""
        self.samplers.call_each(Sampler.stream_add, [(g, sampling) for g in groups])

    def stream_take(self, timeout: float) -> list[StreamReport]:
        """Each sampler's groups finished since its last take (each waits up to `timeout` seconds for one)."""
        return self.samplers.call(Sampler.stream_take, timeout)

    def observe_lengths(self, lengths: torch.Tensor) -> None:
        mean = float(lengths.float().mean())
        e = self.expected_completion_tokens
        self.expected_completion_tokens = mean if not e else 0.7 * e + 0.3 * mean

    def prepare(self, samples: Samples) -> Pending:
        """Lay out the step and score its logprobs; `get()[0]` is the KL penalty per row ([N] tensor; with
        algo.kl_in_reward, else None). The group's workers share one copy of `samples` (see the worker group)."""
        return self.trainers.submit(Trainer.prepare, samples)

    def train(self, advantages: torch.Tensor) -> Pending:
        """Update on the prepared step with these advantages, one per row of its samples; `get()[0]` is its stats."""
        return self.trainers.submit(Trainer.train, advantages)

    def sync_weights(self, version: int) -> Synced:
        """New policy weights to every engine: inside each hybrid worker, or trainers -> samplers (no disk)."""
        self.version = version
        if not self.split:
            return Synced([self.trainers.submit(HybridWorker.sync_weights, version)])
        sent = self.trainers.submit(TrainWorker.send_weights, version)
        got = self.samplers.submit_side(RolloutWorker.receive_weights, version)  # runs while a generate works
        return Synced([sent, got])

    def teacher_logprobs(self, samples: Samples) -> tuple[Samples, float]:
        """With placement.teacher_workers: `samples` with the teacher's logprob of every sampled token, and the
        teacher's seconds (`tandem.workers.models.teacher_logprobs`)."""
        from tandem.workers.models import teacher_logprobs

        return teacher_logprobs(self.teachers, samples)

    def save(self, folder: str) -> None:
        self.trainers.call(Trainer.save, folder)

    def restore(self, folder: str, version: int) -> None:
        """The trainers as checkpoint `folder` holds them (a resume at policy `version`), and their weights to
        every engine."""
        self.trainers.call(Trainer.restore, folder)
        self.sync_weights(version).get()

    def shutdown(self) -> None:
        try:
            for g in self.groups:
                g.shutdown()
        finally:  # after the workers are gone: a killed one leaves its segments behind
            from tandem.rollout.vllm.process import remove_segments

            remove_segments(self.leftovers)


def build(cfg: Config, model: ModelProfile) -> Placement:
    """Start the workers the config asks for and connect the weight path between them; `model`: the policy's
    profile, which every worker is given (resolved once for the run)."""
    pl = cfg.placement
    if pl.backend == "local":
        group = LocalWorkerGroup(functools.partial(HybridWorker, cfg, model=model), 1)
        return Placement(group, group, split=False, groups=[group])
    from tandem.workers.ray.group import GroupSpec, start_groups

    res = dict(cpus_per_worker=pl.cpus_per_worker, gpus_per_worker=pl.gpus_per_worker)
    if pl.mode == "colocate":
        # vLLM names a TP engine's shared memory after this (the same on every rank, unique to the run): a killed
        # run's leftovers then never collide with the next start
        shm_ident = f"tandem-{uuid.uuid4().hex[:12]}"
        worker = functools.partial(HybridWorker, cfg, shm_ident=shm_ident, model=model)
        owners, models = _model_specs(cfg)
        group, *extra = start_groups([GroupSpec("hybrid", worker, pl.workers, **res, resources=pl.train_resources,
                                                resources_from="placement.train_resources"), *models],
                                     address=pl.ray_address or None, call_timeout_s=pl.call_timeout_s or None)
        tp = cfg.rollout.tensor_parallel if cfg.rollout.engine == "vllm" else 1
        placement = Placement(group, group, split=False, groups=[group, *extra], engine_tp=tp)
        try:
            _attach_models(placement, owners, extra)
            placement.leftovers = sorted({f for fs in group.call(HybridWorker.shared_memory_segments) for f in fs})
            group.call(HybridWorker.sync_weights, 0)  # plans the in-group reshard once, and checks it, before any step
        except BaseException:
            placement.shutdown()
            raise
        return placement
    # The samplers join no torch world (a vLLM engine would adopt it and hang on collectives the trainers never
    # make); weights reach them over a channel of their own, for every engine alike.
    owners, models = _model_specs(cfg)
    trainers, samplers, *extra = start_groups(
        [GroupSpec("trainers", functools.partial(TrainWorker, cfg, model=model), pl.train_workers, **res,
                   resources=pl.train_resources, resources_from="placement.train_resources"),
         GroupSpec("samplers", functools.partial(RolloutWorker, cfg, model=model), pl.rollout_workers, **res,
                   join_world=False, resources=pl.rollout_resources, resources_from="placement.rollout_resources"),
         *models],
        address=pl.ray_address or None, call_timeout_s=pl.call_timeout_s or None)
    placement = Placement(trainers, samplers, split=True, groups=[trainers, samplers, *extra])
    try:
        _attach_models(placement, owners, extra)
        from tandem.sync.planner import plan_to_replicas

        address, size = trainers.free_address(0), pl.train_workers + pl.rollout_workers
        opened = [trainers.submit(TrainWorker.open_weight_channel, address, size),
                  samplers.submit(RolloutWorker.open_weight_channel, address, size)]  # a rendezvous: all at once
        for pending in opened:
            pending.get()
        # by the engines' names and shapes (an MoE's experts one by one), so the samplers check what they load
        sync_plan = plan_to_replicas(trainers.call(TrainWorker.sampler_layout)[0], samplers.global_ranks)
        trainers.call(TrainWorker.set_sync_plan, sync_plan)
        samplers.call(RolloutWorker.set_sync_plan, sync_plan)
    except BaseException:
        placement.shutdown()
        raise
    return placement


def _model_specs(cfg: Config) -> tuple[list[int | None], list]:
    """The groups of the models in the loop that run on workers of their own, after the policy's (they join no torch
    world: each works alone), and whose each is: placement.reward_workers for each model-backed reward (its index in
    `rewards`), then placement.teacher_workers for the distillation teacher (None)."""
    from tandem.workers.models import MODEL_REWARDS, RewardHost, TeacherWorker
    from tandem.workers.ray.group import GroupSpec

    pl = cfg.placement
    res = dict(cpus_per_worker=pl.cpus_per_worker, gpus_per_worker=pl.gpus_per_worker, join_world=False)
    owners: list[int | None] = [i for i, spec in enumerate(cfg.rewards)
                                if pl.reward_workers and spec.name in MODEL_REWARDS]
    specs = [GroupSpec(f"reward{i}-{cfg.rewards[i].name}", functools.partial(RewardHost, cfg, i), pl.reward_workers,
                       **res) for i in owners]
    if pl.teacher_workers:
        owners.append(None)
        specs.append(GroupSpec("teacher", functools.partial(TeacherWorker, cfg), pl.teacher_workers, **res))
    return owners, specs


def _attach_models(placement: Placement, owners: list[int | None], groups: list) -> None:
    """The groups `_model_specs` asked for, started, named on the placement."""
    for owner, group in zip(owners, groups, strict=True):
        if owner is None:
            placement.teachers = group
        else:
            placement.reward_hosts[owner] = group


def check_devices(cfg: Config) -> None:
    """Refuse, before any model loads, a placement this machine's devices cannot run (ConfigError)."""
    r, pl = cfg.rollout, cfg.placement
    if r.engine == "vllm" and r.tensor_parallel > 1 and pl.backend == "local":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus < r.tensor_parallel:
            # vLLM on CPU binds each of its own TP ranks to a NUMA node ("Not enough allowed NUMA nodes", after
            # the model has loaded); a TP engine over colocated Ray workers runs on any CPU.
            raise ConfigError(
                f"rollout.tensor_parallel: {r.tensor_parallel} with placement.backend: local starts vLLM's own "
                f"tensor-parallel processes, one per GPU, and this machine has {gpus}; on CPU an engine spans "
                f"colocated Ray workers instead: placement.backend=ray placement.workers={r.tensor_parallel} (a "
                "multiple of rollout.tensor_parallel), or rollout.tensor_parallel=1")
