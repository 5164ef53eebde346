"""The rollout source: where each step's batch comes from, sampled (now, or ahead), scored, filtered and shaped."""
from __future__ import annotations

import dataclasses
import time
from collections import Counter, defaultdict, deque
from contextlib import contextmanager
from typing import Callable, Iterator

import torch

from tandem.algo import first_k_groups, nonzero_variance_groups, overlong_penalty
from tandem.config import Config
from tandem.data.sources import Prompt, PromptStream
from tandem.rewards import RewardScorer
from tandem.rollout import Rollout, Sampling
from tandem.rollout.multiturn import conversation_stats
from tandem.workers.group import Pending
from tandem.workers.placement import Placement

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

    The schedule is `sync` (sampled now, with the weights just synced) or `async` (the samplers work on the next
    `max_staleness` batches while the trainers train, at most that many policy versions behind). Scoring counts
    the rewards' failures (and stops a run whose reward fails on most samples). Under dynamic sampling rounds are
    sampled until `prompts_per_step` groups have a reward spread (or `max_sampling_rounds` pass). Shaping adds an
    environment's own rewards and DAPO's overlong penalty, and masks truncated rows out of training
    (`mask_truncated`). `resume_state` is where a resumed run must start the prompt stream: batches sampled
    ahead but not trained on are sampled again."""

    def __init__(self, cfg: Config, stream: PromptStream, workers: Placement, scorer: RewardScorer,
                 correct_reward: str, start_step: int, check_stop: Callable[[], None]):
        self.cfg, self.stream, self.workers, self.scorer = cfg, stream, workers, scorer
        self.correct_reward, self.check_stop = correct_reward, check_stop
        pl = cfg.placement
        self.depth = pl.max_staleness if pl.schedule == "async" else 0
        # batches sampled ahead: their prompts, the stream before they were taken, the rollout in flight
        self.ahead: deque[tuple[list[Prompt], dict, Pending[Rollout]]] = deque()
        self.next_step = start_step + 1

    def next(self, step: int) -> tuple[Rollout, dict[str, float]]:
        """Step `step`'s batch, scored and shaped (`rewards` and `scores` set), and its metrics. `reward/*` and
        `train/accuracy` describe what is trained on; under dynamic sampling `sampled/reward/*` and
        `sampled/train/accuracy` describe everything sampled, every round."""
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
        return prompts, state, self.workers.submit_generate([p.ids for p in prompts], sampling)

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
        with _timed(stats, "time/reward"):
            rows = [prompts[g].row for g in rollout.samples.group.tolist()]
            res = self.scorer.score([c.text for c in rollout.samples.completions], [r["question"] for r in rows], rows)
        last_error.update(res.last_error)
        errors.update(res.errors)
        stats["time/reward_budget_used"] = max(stats["time/reward_budget_used"], res.budget_used)
        for name, n in res.error_counts("reward/errors").items():
            stats[name] += n
        totals, scores = list(res.total), dict(res.per_fn)
        if self.cfg.env.name:  # an environment's own rewards (StepResult.reward, summed over the conversation) count too
            own = [float(c.meta.get("env_reward") or 0.0) for c in rollout.samples.completions]
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
        """The prompt stream as a resumed run must see it: batches sampled ahead but not trained are redone."""
        return self.ahead[0][1] if self.ahead else self.stream.state_dict()


@contextmanager
def _timed(stats: dict, key: str) -> Iterator[None]:
    """Adds the seconds spent in a `with` block to `stats[key]`."""
    start = time.perf_counter()
    try:
        yield
    finally:
        stats[key] += time.perf_counter() - start
