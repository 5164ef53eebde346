"""The rollout source: where each step's batch comes from, sampled (now, or ahead), scored, filtered and shaped."""
from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter, defaultdict, deque
from contextlib import contextmanager
from typing import Callable, Iterator

import torch

from tandem.algo import first_k_groups, nonzero_variance_groups, overlong_penalty
from tandem.config import Config
from tandem.data.sources import Prompt, PromptStream
from tandem.run.vision import VisionPrompts
from tandem.rewards import RewardScorer
from tandem.rewards.base import FLOAT32_MAX, REWARD_FAILURES, finite_score, overflows
from tandem.rollout import ModelPrompt, Rollout, Samples, Sampling
from tandem.rollout.multiturn import conversation_stats
from tandem.workers.group import Pending
from tandem.workers.placement import Placement
from tandem.workers.stream import StreamGroup, StreamReport

log = logging.getLogger("tandem.run.source")

STOP_POLL_S = 0.25  # how often a wait for samples looks for a stop request (its latency; each look is one ray.wait)


def sampling_for(cfg: Config, seed: int) -> Sampling:
    """How the run samples (rollout.*), one group of batch.group_size per prompt; evaluation replaces n and the
    temperature."""
    r = cfg.rollout
    return Sampling(n=cfg.batch.group_size, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                    max_new_tokens=r.max_new_tokens, stop=tuple(r.stop), stop_token_ids=tuple(r.stop_token_ids),
                    ignore_eos=r.ignore_eos, seed=seed)


def step_seed(cfg: Config, step: int, rnd: int) -> int:
    """The sampling seed of a step's round: a function of the run's seed and where it is, so a resume redraws it."""
    return cfg.run.seed * 1_000_003 + step * 97 + rnd


class RolloutSource:
    """Each step's batch: sampled, scored, filtered (dynamic sampling), shaped, with the step's rollout metrics.

    The schedule is `sync` (sampled now, with the weights just synced), `async` (the samplers work on the next
    `max_staleness` batches while the trainers train, at most that many policy versions behind) or `stream` (the
    samplers decode groups continuously; a step takes the first `prompts_per_step` to finish whole, scored as they
    arrive, every token within `max_staleness` versions: see `_next_streamed`). Scoring counts
    the rewards' failures (and stops a run whose reward fails on most samples). Under dynamic sampling rounds are
    sampled until `prompts_per_step` groups have a reward spread (or `max_sampling_rounds` pass). Shaping adds an
    environment's own rewards and DAPO's overlong penalty, and masks truncated rows out of training
    (`mask_truncated`). `resume_state` is where a resumed run must start the prompt stream: batches sampled
    ahead but not trained on, and groups started but not trained on, are sampled again."""

    def __init__(self, cfg: Config, stream: PromptStream, workers: Placement, scorer: RewardScorer,
                 correct_reward: str, start_step: int, check_stop: Callable[[], None],
                 vision: VisionPrompts | None = None):
        self.cfg, self.stream, self.workers, self.scorer = cfg, stream, workers, scorer
        self.vision = vision  # a vision-language model's: each step's prompts' images, as the model takes them
        self.correct_reward, self.check_stop = correct_reward, check_stop
        pl = cfg.placement
        self.depth = pl.max_staleness if pl.schedule == "async" else 0
        # batches sampled ahead: their prompts, the stream before they were taken, the rollout in flight
        self.ahead: deque[tuple[list[Prompt], dict, Pending[Rollout]]] = deque()
        self.next_step = start_step + 1
        self.streaming = pl.schedule == "stream"
        self.started: dict[int, tuple[Prompt, int]] = {}  # stream: group serial -> prompt, sampler; not yet arrived
        self.ready: list[tuple[int, Prompt, Rollout]] = []  # stream: arrived, scored, kept; oldest first
        self.serial = 0  # stream: the next group's number
        self.sampler_version = start_step  # stream: the oldest policy version the samplers hold (last reported)
        self.in_flight: dict[str, int] = {}  # stream: the requests and tokens in flight (last reported)

    def next(self, step: int) -> tuple[Rollout, dict[str, float]]:
        """Step `step`'s batch, scored and shaped (`rewards` and `scores` set), and its metrics. `reward/*` and
        `train/accuracy` describe what is trained on; under dynamic sampling `sampled/reward/*` and
        `sampled/train/accuracy` describe everything sampled, every round."""
        if self.streaming:
            return self._next_streamed(step)
        a, P = self.cfg.algo, self.cfg.batch.prompts_per_step
        stats: dict[str, float] = defaultdict(float)
        errors: Counter = Counter()  # over the step's rounds: the error-rate limit's input
        last_error: dict[str, str] = {}
        rounds = a.max_sampling_rounds if a.dynamic_sampling else 1
        batch: Rollout | None = None
        scored = 0
        for rnd in range(rounds):
            new = self._score(step, *self._take(step, rnd, stats), stats, errors, last_error)
            scored += len(new.samples)
            batch = new if batch is None else batch.concat(new)
            if not a.dynamic_sampling:
                break
            keep = nonzero_variance_groups(batch.rewards, batch.samples.group)
            kept_groups = len(set(batch.samples.group[keep].tolist()))
            if kept_groups >= P or rnd == rounds - 1:
                stats.update({"dynamic/kept_group_frac": kept_groups / batch.samples.num_groups,
                              "dynamic/rounds": rnd + 1, **self._reward_stats(batch, "sampled/")})
                rows = first_k_groups(batch.samples.group, keep, P).tolist()
                # nothing has a reward spread: train on the last round rather than on nothing
                batch = batch.select(rows or list(range(len(batch.samples) - len(new.samples), len(batch.samples))))
                break
        stats.update(self.scorer.error_limit.observe(scored, dict(errors), last_error))  # raises: stop before training
        stats.update(self._reward_stats(batch))
        return self._shape(batch, stats), stats

    def _take(self, step: int, rnd: int, stats: dict) -> tuple[list[Prompt], Rollout]:
        """A round's prompts and their rollout: sampled now (sync), or the oldest batch sampled ahead (async)."""
        if not self.depth:
            with _timed(stats, "time/rollout"):
                prompts, _, pending = self._submit(step, rnd)
                return prompts, self._wait(pending)
        while len(self.ahead) <= self.depth:  # the batch for this step plus `depth` ahead: the sampler never waits
            self.ahead.append(self._submit(self.next_step, 0))
            self.next_step += 1
        prompts, _, pending = self.ahead.popleft()
        with _timed(stats, "time/rollout"):  # under async this is the trainer's idle time waiting for samples
            return prompts, self._wait(pending)

    def _submit(self, step: int, rnd: int) -> tuple[list[Prompt], dict, Pending[Rollout]]:
        state = self.stream.state_dict()
        prompts = self.stream.take(self.cfg.batch.prompts_per_step)
        sampling = sampling_for(self.cfg, step_seed(self.cfg, step, rnd))
        if any("max_new_tokens" in p.row for p in prompts):
            sampling = dataclasses.replace(sampling, max_tokens=tuple(self._limit(p) for p in prompts))
        return prompts, state, self.workers.submit_generate(self.model_prompts(prompts), sampling)

    def model_prompts(self, prompts: list[Prompt]) -> list[ModelPrompt]:
        """The rows' prompts as the engines sample them: their ids, with a vision-language model's images."""
        return [ModelPrompt(p.ids, None if self.vision is None else self.vision.images(p)) for p in prompts]

    def _limit(self, prompt: Prompt) -> int:
        """A prompt's completion limit: its row's `max_new_tokens`, at most rollout.max_new_tokens."""
        most = self.cfg.rollout.max_new_tokens
        return max(1, min(int(prompt.row.get("max_new_tokens", most)), most))

    def _wait(self, pending: Pending[Rollout]) -> Rollout:
        """The samples, unless a stop is asked for first: a step still sampling is what a stop drops."""
        while True:
            self.check_stop()
            try:
                return pending.get(timeout=STOP_POLL_S)
            except TimeoutError:
                pass

    def _score(self, step: int, prompts: list[Prompt], rollout: Rollout, stats: dict, errors: Counter,
               last_error: dict) -> Rollout:
        """A round's rollout scored: its rewards and each function's scores; its timings, staleness and reward
        errors go into `stats`."""
        staleness = (step - 1) - rollout.version  # the trainer is at version step - 1 before this update
        stats["async/staleness"] = max(stats["async/staleness"], staleness)
        stats["time/sampler_idle"] += rollout.idle_seconds
        stats["time/weight_load"] += rollout.load_seconds
        stats["time/generate"] += rollout.seconds
        if staleness > self.cfg.placement.max_staleness:  # cannot happen with the schedule above; never train on it
            raise RuntimeError(f"step {step}: a batch sampled by policy version {rollout.version} is {staleness} "
                               f"versions old, over placement.max_staleness={self.cfg.placement.max_staleness}")
        return self._rewarded(prompts, rollout, stats, errors, last_error)

    def _rewarded(self, prompts: list[Prompt], rollout: Rollout, stats: dict, errors: Counter,
                  last_error: dict) -> Rollout:
        """`rollout` (its groups: indices into `prompts`) with its rewards and each function's scores; the reward
        errors go into `stats`, `errors` and `last_error`."""
        with _timed(stats, "time/reward"):
            rows = [prompts[g].row for g in rollout.samples.group.tolist()]
            res = self.scorer.score([c.text for c in rollout.samples.completions], [r["question"] for r in rows], rows)
        last_error.update(res.last_error)
        errors.update(res.errors)
        stats["time/reward_budget_used"] = max(stats["time/reward_budget_used"], res.budget_used)
        for name, value in res.metrics.items():  # a reward model's time, batches and memory: over the step's rounds
            stats[name] = stats[name] + value if name.startswith("time/") else value
        for name, n in res.error_counts("reward/errors").items():
            stats[name] += n
        totals, scores = list(res.total), dict(res.per_fn)
        if self.cfg.env.name:  # an environment's own rewards (StepResult.reward, summed per conversation) count too
            own = _env_rewards(rollout.samples.completions, totals, stats, errors, last_error)
            totals, scores["env"] = [a + b for a, b in zip(totals, own)], own
        return dataclasses.replace(rollout, rewards=torch.tensor(totals, dtype=torch.float32), scores=scores)

    def _reward_stats(self, batch: Rollout, prefix: str = "") -> dict[str, float]:
        """Each reward function's mean and std, and the share scored correct, over these rows."""
        out = {}
        for name, scores in batch.scores.items():
            t_scores = torch.tensor(scores, dtype=torch.float64)
            out[f"{prefix}reward/{name}"] = float(t_scores.mean())
            out[f"{prefix}reward/{name}/std"] = float(t_scores.std()) if len(scores) > 1 else 0.0
        correct = batch.scores[self.correct_reward]
        out[f"{prefix}train/accuracy"] = sum(s >= 1.0 for s in correct) / len(batch.samples)
        return out

    def _shape(self, batch: Rollout, stats: dict) -> Rollout:
        """The batch as it trains: DAPO's overlong penalty on its rewards, truncated rows masked out of training
        (`algo.mask_truncated`: no token of theirs counts, in the loss or in an advantage's token count)."""
        a, samples = self.cfg.algo, batch.samples
        if self.cfg.env.name:  # measured before masking: what the conversations were
            stats.update(conversation_stats(samples.completions))
        rewards = batch.rewards
        if a.overlong_buffer:
            rewards = rewards + overlong_penalty(samples.completion_lengths, self.cfg.max_completion_tokens,
                                                 a.overlong_buffer, a.overlong_penalty).float()
        if a.mask_truncated:
            samples = dataclasses.replace(samples, completions=[
                dataclasses.replace(c, loss_mask=[0] * len(c.completion_ids)) if c.truncated else c
                for c in samples.completions])
        return dataclasses.replace(batch, samples=samples, rewards=rewards)

    def resume_state(self) -> dict:
        """The prompt stream as a resumed run must see it: batches sampled ahead but not trained are redone; so
        are a stream's groups started but not trained (the prompts to sample again first)."""
        if self.streaming:
            return self.stream.state_dict(redo=[p for p, _ in self.started.values()] + [p for _, p, _ in self.ready])
        return self.ahead[0][1] if self.ahead else self.stream.state_dict()

    # ------------------------------------------------------------------------------------------------- stream

    def _next_streamed(self, step: int) -> tuple[Rollout, dict[str, float]]:
        """Step `step`'s batch under the streaming schedule: the first `prompts_per_step` groups to finish whole
        (scored as they arrive; under dynamic sampling kept only with a reward spread) whose tokens are within the
        staleness bound."""
        P = self.cfg.batch.prompts_per_step
        stats: dict[str, float] = defaultdict(float)
        errors: Counter = Counter()
        last_error: dict[str, str] = {}
        scored = 0
        with _timed(stats, "time/rollout"):  # the trainer's wait for groups
            while True:
                self._expire(step, stats)
                if len(self.ready) >= P:
                    break
                self._top_up(step)
                self.check_stop()
                scored += self._arrive(self.workers.stream_take(STOP_POLL_S), stats, errors, last_error)
        stats.update(self.scorer.error_limit.observe(scored, dict(errors), last_error))  # raises: stop before training
        self.ready.sort(key=lambda e: e[2].version)  # the oldest first: the nearest to the bound (a stable sort)
        taken, self.ready = self.ready[:P], self.ready[P:]
        batch = taken[0][2]
        for _, _, group in taken[1:]:
            batch = batch.concat(group)
        if self.cfg.algo.dynamic_sampling:
            arrived = stats.pop("dynamic/arrived_groups", 0)
            stats["dynamic/kept_group_frac"] = 1 - stats.get("dynamic/dropped_groups", 0) / max(arrived, 1)
        stats.update(self.in_flight, **{"stream/groups_waiting": len(self.ready)})  # as last reported
        batch = self._within_bound(step, batch, stats)
        stats.update(self._reward_stats(batch))
        return self._shape(batch, stats), stats

    def _top_up(self, step: int) -> None:
        """Start the groups that can still be trained within the bound: taken in order, P per step, the k-th group
        started or waiting trains at step `step + k // P`, and one started now samples with the samplers' version w
        or newer, so it may start while that step is at most w + max_staleness + 1. Each goes to the sampler with
        the fewest started; its prompt comes from the stream (those to sample again first)."""
        cfg, P = self.cfg, self.cfg.batch.prompts_per_step
        horizon = self.sampler_version + cfg.placement.max_staleness + 1  # the last step such a group may train in
        want = P * (horizon - step + 1) - len(self.started) - len(self.ready)
        if want <= 0:
            return
        engines = self.workers.samplers.size
        load = Counter(k for _, k in self.started.values())
        groups: list[list[StreamGroup]] = [[] for _ in range(engines)]
        G = cfg.batch.group_size
        for prompt in self.stream.take(want):
            k = min(range(engines), key=lambda j: load[j])
            load[k] += 1
            self.started[self.serial] = (prompt, k)
            seed = cfg.run.seed * 1_000_003 + self.serial * G
            groups[k].append(StreamGroup(self.serial, self.model_prompts([prompt])[0], G, seed, self._limit(prompt)))
            self.serial += 1
        self.workers.stream_add(groups, sampling_for(cfg, None))

    def _arrive(self, reports: list[StreamReport], stats: dict, errors: Counter, last_error: dict) -> int:
        """The samplers' reports: their times into `stats`, their finished groups scored and put in `ready` (under
        dynamic sampling only those with a reward spread); the rows scored."""
        arrived = []
        for rep in reports:
            stats["time/generate"] += rep.busy_seconds  # summed over the samplers
            stats["time/sampler_idle"] += rep.idle_seconds
            stats["time/weight_load"] += rep.load_seconds
            stats["stream/restarted"] += rep.restarted
            arrived += rep.groups
        self.sampler_version = min(rep.version for rep in reports)
        self.in_flight = {"stream/requests_in_flight": sum(rep.in_flight for rep in reports),
                          "stream/tokens_in_flight": sum(rep.tokens_in_flight for rep in reports)}
        if not arrived:
            return 0
        prompts = [self.started.pop(serial)[0] for serial, _ in arrived]
        comps = [c for _, group in arrived for c in group]
        rows_of = [k for k, (_, group) in enumerate(arrived) for _ in group]
        rollout = self._rewarded(prompts, Rollout(Samples(comps, rows_of, len(arrived))), stats, errors, last_error)
        a = self.cfg.algo
        keep = nonzero_variance_groups(rollout.rewards, rollout.samples.group)
        give_up = self.cfg.batch.prompts_per_step * (a.max_sampling_rounds - 1)  # then train on what comes
        for k, (serial, _) in enumerate(arrived):
            rows = [i for i, g in enumerate(rows_of) if g == k]
            if a.dynamic_sampling:
                stats["dynamic/arrived_groups"] += 1
                if not keep[rows].any() and stats["dynamic/dropped_groups"] < give_up:
                    stats["dynamic/dropped_groups"] += 1
                    continue
            group = rollout.select(rows)
            self.ready.append((serial, prompts[k], dataclasses.replace(group, version=_oldest(group.samples))))
        return len(comps)

    def _expire(self, step: int, stats: dict) -> None:
        """Under rollout.partial: drop, groups waiting with a token the staleness bound now leaves behind go back
        to be sampled again (their prompts first in the stream)."""
        if self.cfg.rollout.partial != "drop":
            return
        oldest = (step - 1) - self.cfg.placement.max_staleness  # the trainer is at version step - 1
        for entry in [e for e in self.ready if e[2].version < oldest]:
            self.ready.remove(entry)
            self.stream.redo.append(self.stream.index_of(entry[1]))
            stats["stream/expired_groups"] += 1

    def _within_bound(self, step: int, batch: Rollout, stats: dict) -> Rollout:
        """The batch with, under rollout.partial: resume, its tokens beyond the staleness bound masked out of the
        loss (kept as context: `stream/stale_masked_frac`); the per-token staleness of what it trains on (mean and
        max) into `stats`."""
        bound, comps = self.cfg.placement.max_staleness, batch.samples.completions
        oldest = max(((step - 1) - v for c in comps for v in c.versions), default=0)
        if oldest > bound and self.cfg.rollout.partial == "drop":  # `_expire` sent such groups back: never here
            raise RuntimeError(f"step {step}: a token {oldest} versions old, over placement.max_staleness={bound}")
        masked, total, ages, out = 0, 0, [], []
        for c in comps:
            keep = [int((step - 1) - v <= bound) for v in c.versions]
            mask = keep if c.loss_mask is None else [a * b for a, b in zip(keep, c.loss_mask)]
            ages += [(step - 1) - v for v, m in zip(c.versions, mask) if m]
            masked, total = masked + len(keep) - sum(keep), total + len(keep)
            out.append(dataclasses.replace(c, loss_mask=mask) if oldest > bound else c)
        stats["async/staleness"] = max(ages, default=0)
        stats["async/staleness_mean"] = sum(ages) / max(len(ages), 1)
        if oldest <= bound:
            return batch
        stats["stream/stale_masked_frac"] = masked / max(total, 1)
        return dataclasses.replace(batch, samples=dataclasses.replace(batch.samples, completions=out))


def _env_rewards(completions: list, totals: list[float], stats: dict, errors: Counter, last_error: dict
                 ) -> list[float]:
    """Each conversation's environment reward, held to a reward function's rule (`finite_score`, `overflows`: a
    number finite in float32, alone and added to its sample's total): one that is not is the `env` reward's
    `bad_value`, scored 0 and counted as a function's failure is (`reward/errors/env`, the error-rate stop)."""
    own, failed = [], 0
    for c, total in zip(completions, totals):
        value = c.meta.get("env_reward") or 0.0
        try:
            score = finite_score(value)
            if overflows(total, score):
                raise ValueError(f"returned {score:g}, which takes the sample's total to {total + score:g}, beyond "
                                 f"float32's range (|total| <= {FLOAT32_MAX:.4g}); scale the environment's reward down")
        except REWARD_FAILURES as exc:
            score, failed = 0.0, failed + 1
            last_error["env"] = f"bad_value: {exc}"[:500]
            if failed == 1:
                log.warning("the environment's reward failed (bad_value; scored 0, counted in reward/errors/env): %s",
                            exc)
        own.append(score)
    errors["env"] += failed
    stats["reward/errors/env"] += failed
    if failed:
        stats["reward/errors/env/bad_value"] += failed
    return own


def _oldest(samples: Samples) -> int:
    """The oldest policy version that sampled a token of these rows."""
    return min(min(c.versions) for c in samples.completions if c.versions)


@contextmanager
def _timed(stats: dict, key: str) -> Iterator[None]:
    """Adds the seconds spent in a `with` block to `stats[key]`."""
    start = time.perf_counter()
    try:
        yield
    finally:
        stats[key] += time.perf_counter() - start
