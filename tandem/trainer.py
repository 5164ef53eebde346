"""The controller: GRPO's loop over the workers (sync or async schedule), with eval, checkpoint and metrics cadence."""
from __future__ import annotations

import logging
import time
from collections import defaultdict, deque
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tandem.run import checkpoint
from tandem.architectures import check_supported
from tandem.rollout.multiturn import conversation_stats
from tandem.train import lora
from tandem.algo import ADVANTAGES, first_k_groups, nonzero_variance_groups, overlong_penalty, truncation_mask
from tandem.config import Config, ConfigError
from tandem.data.sources import Prompt, PromptStream, load_task_rows, tokenize_rows
from tandem.run.evaluation import evaluate
from tandem.run.metrics import METRICS_FILE, MetricsLog
from tandem.modeling import check_model_folder, load_tokenizer
from tandem.rewards import RewardScorer
from tandem.rollout import Samples, Sampling
from tandem.run.directory import RunLock, Start, claim
from tandem.run.signals import StopSignals, Stopped
from tandem.workers import placement
from tandem.workers.group import Pending
from tandem.workers.placement import PendingRollout, Placement, Rollout, Synced

log = logging.getLogger("tandem.trainer")

STOP_POLL_S = 0.25  # how often a wait for samples looks for a stop request (its latency; each look is one ray.wait)


@dataclass
class Run:
    cfg: Config
    stream: PromptStream
    eval_prompts: list[Prompt]
    scorer: RewardScorer
    correct_reward: str
    workers: Placement
    start_step: int = 0
    resumed: bool = False
    rollouts: "Rollouts | None" = None
    last_finished: float = 0.0  # wall-clock end of the last finished step's weight sync
    lock: RunLock | None = None  # on run.output_dir, for the run's lifetime (None: evaluation only)
    stop: StopSignals = field(default_factory=StopSignals)  # `train` installs its own; this one never fires

    def close(self) -> None:
        try:
            self.workers.shutdown()
            self.scorer.close()
        finally:
            if self.lock is not None:  # last: nothing of this run writes into the directory after it
                self.lock.release()


class Timer(defaultdict):
    def __init__(self):
        super().__init__(float)

    @contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self[phase] += time.perf_counter() - start


def prepare(cfg: Config, resume: bool | Start = False, *, claim_output_dir: bool = True) -> Run:
    """Check everything that can be checked (model folder, tokenizer, data, the run directory, rewards), then start
    the workers. `resume`: True or False (`resume` / `start`), or a `tandem.run.directory.Start`. `claim_output_dir=False`
    (evaluation) neither locks nor reads run.output_dir."""
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    check_model_folder(cfg.model.path)
    check_supported(cfg)  # the architecture in this engine and placement, before any model loads
    placement.check_devices(cfg)  # and the devices that placement needs
    lora.check(cfg.lora, cfg.model.path, cfg.model.trust_remote_code)  # adapters PEFT can place, on no weights
    if cfg.env.name:  # the environment resolves and takes its arguments, before any model loads
        from tandem.rollout.tools import make_environment

        make_environment(cfg.env.name, **cfg.env.kwargs)
    tokenizer = load_tokenizer(cfg.model.path, cfg.model.trust_remote_code)
    d = cfg.data
    train_rows = load_task_rows(d.task, d.path, d.prompt_field, d.answer_field, "train")
    train = tokenize_rows(train_rows, tokenizer, d.chat_template, d.system_prompt, d.max_prompt_tokens, d.path or d.task,
                          d.overlong_prompts)
    if d.eval_path or d.task in ("arithmetic", "multiply"):  # the built-in tasks have a held-out split
        eval_rows = load_task_rows(d.task, d.eval_path or d.path, d.prompt_field, d.answer_field, "test")
        eval_prompts = tokenize_rows(eval_rows[: d.eval_size], tokenizer, d.chat_template, d.system_prompt,
                                     d.max_prompt_tokens, d.eval_path or d.task, d.overlong_prompts)
    else:
        eval_prompts = train[: d.eval_size]  # no held-out split given: say so in the logs
        log.warning("no data.eval_path: evaluating on the first %d training prompts", len(eval_prompts))
    with ExitStack() as undo:  # what a start that fails before the run exists must close again
        lock, last = None, None
        if claim_output_dir:
            start = {True: "resume", False: "start"}.get(resume, resume)
            lock, last = claim(Path(cfg.run.output_dir), start)
            undo.callback(lock.release)
            if last is not None:
                _refuse_nothing_to_train(cfg, last)
        pool = cfg.reward_pool
        scorer = RewardScorer(cfg.rewards, timeout_s=pool.timeout_s, workers=pool.workers,
                              step_budget_s=pool.step_budget_s, max_error_rate=pool.max_error_rate)
        undo.callback(scorer.close)  # its worker processes started early, to warm up while the models load
        correct = cfg.rewards[0].name
        workers = placement.build(cfg)
        undo.callback(workers.shutdown)
        stream = PromptStream(train, cfg.run.seed)
        start_step = 0
        if last is not None:
            state = checkpoint.load_state(last)
            workers.load(str(last), state["step"])
            stream.load_state_dict(state["data"])
            start_step = state["step"]
            changed = _changed_keys(state.get("config", {}), cfg.model_dump(mode="json"))
            if changed:
                log.warning("resuming with a config that differs from the checkpoint's in: %s", ", ".join(changed))
            log.info("resumed from %s (step %d)", last, start_step)
        run = Run(cfg, stream, eval_prompts, scorer, correct, workers, start_step, resumed=last is not None, lock=lock)
        run.rollouts = Rollouts(run)
        undo.pop_all()
    return run


def _refuse_nothing_to_train(cfg: Config, last: Path) -> None:
    """A resume whose run.steps the checkpoint has reached already would exit having done nothing: refuse it."""
    step = int(checkpoint.STEP_DIR.match(last.name).group(1))  # its trainer state agrees (checkpoint.problems)
    if cfg.run.steps <= step:
        raise ConfigError(
            f"run.steps: {cfg.run.steps}, but the run in {cfg.run.output_dir} is at step {step} already "
            f"({last.name}): resuming it would train nothing. Raise run.steps above {step} to train further, or "
            f"evaluate the checkpoint: tandem eval ... --model {last}")


def sampling_for(cfg: Config, seed: int) -> Sampling:
    r = cfg.rollout
    return Sampling(n=cfg.batch.group_size, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                    max_new_tokens=r.max_new_tokens, stop=tuple(r.stop), stop_token_ids=tuple(r.stop_token_ids),
                    ignore_eos=r.ignore_eos, seed=seed)


@dataclass
class InFlight:
    prompts: list[Prompt]
    pending: PendingRollout
    stream_state: dict  # the prompt stream before this batch was taken: where a resume must restart


class Rollouts:
    """Where each step's samples come from. `sync`: sampled now, with the weights just synced. `async`: sampled
    ahead by the samplers while the trainers train, at most `max_staleness` policy versions behind."""

    def __init__(self, run: Run):
        self.run = run
        pl = run.cfg.placement
        self.depth = pl.max_staleness if pl.schedule == "async" else 0
        self.ahead: deque[InFlight] = deque()
        self.next_step = run.start_step + 1

    def _submit(self, step: int, rnd: int = 0) -> InFlight:
        run = self.run
        state = run.stream.state_dict()
        prompts = run.stream.take(run.cfg.batch.prompts_per_step)
        seed = run.cfg.run.seed * 1_000_003 + step * 97 + rnd
        return InFlight(prompts, run.workers.submit_generate([p.ids for p in prompts], sampling_for(run.cfg, seed)),
                        state)

    def take(self, step: int, rnd: int, t: Timer) -> tuple[list[Prompt], Rollout]:
        if not self.depth:
            with t("rollout"):
                f = self._submit(step, rnd)
                return f.prompts, self._wait(f)
        while len(self.ahead) <= self.depth:  # the batch for this step plus `depth` ahead: the sampler never waits
            self.ahead.append(self._submit(self.next_step))
            self.next_step += 1
        f = self.ahead.popleft()
        with t("rollout"):  # under async this is the trainer's idle time waiting for samples
            return f.prompts, self._wait(f)

    def _wait(self, f: InFlight) -> Rollout:
        """The samples, unless a stop is asked for first: a step still sampling is what a stop drops."""
        while True:
            self.run.stop.check()
            try:
                return f.pending.get(timeout=STOP_POLL_S)
            except TimeoutError:
                pass

    def resume_state(self) -> dict:
        """The prompt stream as a resumed run must see it: batches sampled ahead but not trained are redone."""
        return self.ahead[0].stream_state if self.ahead else self.run.stream.state_dict()


@dataclass
class Scored:
    """A step's samples so far and their scores, over its sampling rounds."""

    samples: Samples
    totals: list[float]  # the summed reward of each row
    per_fn: dict[str, list[float]]  # each reward function's score of each row

    def concat(self, other: "Scored") -> "Scored":
        """These rows, then another round's (see `Samples.concat`)."""
        return Scored(self.samples.concat(other.samples), self.totals + other.totals,
                      {k: v + other.per_fn[k] for k, v in self.per_fn.items()})

    def select(self, rows: list[int]) -> "Scored":
        """These rows, in this order (see `Samples.select`)."""
        return Scored(self.samples.select(rows), [self.totals[i] for i in rows],
                      {k: [v[i] for i in rows] for k, v in self.per_fn.items()})


def _score_round(run: Run, step: int, rnd: int, t: Timer, stats: dict, errors: dict, last_error: dict) -> Scored:
    """One rollout round of a step, taken and scored; its timings, staleness and reward errors go into `stats`."""
    cfg = run.cfg
    batch, rollout = run.rollouts.take(step, rnd, t)
    staleness = (step - 1) - rollout.version  # the trainer is at version step - 1 before this update
    stats["async/staleness"] = max(stats["async/staleness"], staleness)
    stats["time/sampler_idle"] += rollout.idle_seconds
    stats["time/weight_load"] += rollout.load_seconds
    stats["time/generate"] += rollout.seconds
    if staleness > cfg.placement.max_staleness:  # cannot happen with the schedule above; never train on it
        raise RuntimeError(f"step {step}: a batch sampled by policy version {rollout.version} is {staleness} "
                           f"versions old, over placement.max_staleness={cfg.placement.max_staleness}")
    new = rollout.samples
    with t("reward"):
        rows = [batch[g].row for g in new.group.tolist()]
        res = run.scorer.score([c.text for c in new.completions], [r["question"] for r in rows], rows)
    last_error.update(res.last_error)
    stats["time/reward_budget_used"] = max(stats["time/reward_budget_used"], res.budget_used)
    for name, n_err in res.errors.items():
        stats[f"reward/errors/{name}"] += n_err
        errors[name] += n_err
    for name, kinds in res.error_kinds.items():
        for kind, n_err in kinds.items():
            stats[f"reward/errors/{name}/{kind}"] += n_err
    totals, per_fn = list(res.total), dict(res.per_fn)
    if cfg.env.name:  # an environment's own rewards (StepResult.reward, summed over the conversation) count too
        own = [float(c.meta.get("env_reward") or 0.0) for c in new.completions]
        totals, per_fn["env"] = [a + b for a, b in zip(totals, own)], own
    return Scored(new, totals, per_fn)


def _reward_stats(scored: Scored, correct_reward: str, prefix: str = "") -> dict[str, float]:
    """Each reward function's mean and std, and the share scored correct, over these rows."""
    out = {}
    for name, scores in scored.per_fn.items():
        t_scores = torch.tensor(scores, dtype=torch.float64)
        out[f"{prefix}reward/{name}"] = float(t_scores.mean())
        out[f"{prefix}reward/{name}/std"] = float(t_scores.std()) if len(scores) > 1 else 0.0
    out[f"{prefix}train/accuracy"] = sum(s >= 1.0 for s in scored.per_fn[correct_reward]) / len(scored.samples)
    return out


def collect(run: Run, step: int, t: Timer) -> tuple[Scored, dict]:
    """Take a step's groups and score them; with dynamic sampling, keep sampling until enough groups have a reward
    spread (or the round cap is hit), and train on the first prompts_per_step of them. `reward/*` and
    `train/accuracy` describe what is trained on; under dynamic sampling `sampled/reward/*` and
    `sampled/train/accuracy` describe everything sampled, every round."""
    cfg, a = run.cfg, run.cfg.algo
    P = cfg.batch.prompts_per_step
    stats: dict[str, float] = defaultdict(float)
    errors, last_error = defaultdict(int), {}  # over the step's rounds: the error-rate limit's input
    rounds = a.max_sampling_rounds if a.dynamic_sampling else 1
    scored: Scored | None = None
    n_scored = 0
    for rnd in range(rounds):
        new = _score_round(run, step, rnd, t, stats, errors, last_error)
        n_scored += len(new.samples)
        scored = new if scored is None else scored.concat(new)
        if not a.dynamic_sampling:
            break
        keep = nonzero_variance_groups(torch.tensor(scored.totals), scored.samples.group)
        kept_groups = len(set(scored.samples.group[keep].tolist()))
        if kept_groups >= P or rnd == rounds - 1:
            stats.update({"dynamic/kept_group_frac": kept_groups / scored.samples.num_groups,
                          "dynamic/rounds": rnd + 1, **_reward_stats(scored, run.correct_reward, "sampled/")})
            rows = first_k_groups(scored.samples.group, keep, P).tolist()
            # nothing has a reward spread: train on the last round rather than on nothing
            scored = scored.select(rows or list(range(len(scored.samples) - len(new.samples), len(scored.samples))))
            break
    stats.update(run.scorer.error_limit.observe(n_scored, errors, last_error))  # raises: stop before training on it
    stats.update(_reward_stats(scored, run.correct_reward))
    return scored, stats


@dataclass
class Launched:
    """A step whose samples are scored and whose update and weight sync are queued on the workers."""

    step: int
    metrics: dict[str, float]
    launched_at: float  # wall-clock time at the start of `grpo_step`
    tokens: int  # prompt + completion tokens trained on
    prepared: Pending
    trained: Pending
    synced: Synced


def grpo_step(run: Run, step: int) -> Launched:
    """Sample (or take the samples made ahead), score, compute advantages and queue the update and the weight
    sync. It returns without waiting for them: the next step's samples are scored while this one trains."""
    cfg, a = run.cfg, run.cfg.algo
    t, launched_at = Timer(), time.time()
    scored, m = collect(run, step, t)
    run.stop.check()  # the last moment a stop can drop this step: next, its update is queued
    samples = scored.samples
    lengths = samples.completion_lengths
    run.workers.observe_lengths(lengths)
    reward = torch.tensor(scored.totals, dtype=torch.float32)
    if a.overlong_buffer:
        reward = reward + overlong_penalty(lengths, cfg.max_completion_tokens, a.overlong_buffer,
                                           a.overlong_penalty).float()
    prepared = run.workers.prepare(samples)  # queued behind the previous step's update and sync
    if a.kl_in_reward:
        reward = reward - prepared.get()[0].float()
    sampled = samples.sampled_lengths  # what the policy wrote: a tool's tokens are not trained on
    trained_tokens = sampled * truncation_mask(samples.truncated).long() if a.mask_truncated else sampled
    adv = ADVANTAGES[a.advantage](reward, samples.group, lengths=trained_tokens, eps=a.adv_eps)
    trained = run.workers.train(adv)
    synced = run.workers.sync_weights(step)
    m.update({
        "reward/mean": float(reward.mean()), "reward/std": float(reward.std()) if len(reward) > 1 else 0.0,
        "advantage/mean": float(adv.mean()), "advantage/std": float(adv.std()) if len(adv) > 1 else 0.0,
        "advantage/abs_mean": float(adv.abs().mean()),
        "completion/length_mean": float(lengths.float().mean()), "completion/length_max": int(lengths.max()),
        "completion/truncated_frac": int(samples.truncated.sum()) / len(samples),
        "time/rollout": t["rollout"], "time/reward": t["reward"],
        "rollout/tokens_per_s": int(lengths.sum()) / max(m["time/generate"], 1e-9),
    })
    if cfg.env.name:
        m.update(conversation_stats(samples.completions))
    tokens = int(lengths.sum()) + sum(len(c.prompt_ids) for c in samples.completions)
    return Launched(step, m, launched_at, tokens, prepared, trained, synced)


def finish(run: Run, s: Launched) -> dict[str, float]:
    """Wait for a launched step's update and sync; its metrics. `time/step` runs from the end of the previous
    step's sync (or this step's start, if later) to the end of this one's: with steps queued back to back, that is
    the pipeline's rate, each second counted once."""
    s.prepared.get()  # its errors, if any, surface here
    m = dict(s.metrics)
    m.update(s.trained.get()[0])
    sync = s.synced.get()
    step_time = sync["finished_at"] - max(s.launched_at, run.last_finished)
    run.last_finished = sync["finished_at"]
    m.update({"time/sync": sync["seconds"], "sync/bytes": sync["bytes"], "time/step": step_time,
              "tokens_per_s": s.tokens / max(step_time, 1e-9)})
    return m


def run_eval(run: Run) -> dict[str, float]:
    cfg = run.cfg

    def gen(ids, sampling):
        return run.workers.generate(ids, sampling).samples

    res = evaluate(gen, run.eval_prompts, run.scorer, run.correct_reward, cfg.rollout.max_new_tokens,
                   k=cfg.eval.k, temperature=cfg.eval.temperature, seed=cfg.run.seed, stop=tuple(cfg.rollout.stop))
    return {f"eval/{k}": v for k, v in res.items()}


def save(run: Run, step: int, data: dict | None = None) -> Path:
    """Checkpoint `step`; `data`: the prompt stream's position a resume starts from (default: the rollouts' now)."""
    data = run.rollouts.resume_state() if data is None else data
    state = {"step": step, "data": data, "config": run.cfg.model_dump(mode="json")}
    out = Path(run.cfg.run.output_dir)
    return checkpoint.save(out / "checkpoints", step, run.workers.save, state, run.cfg.run.keep_checkpoints,
                           flush_first=[out / METRICS_FILE])


def train(cfg: Config, resume: bool | Start = False) -> dict[str, float]:
    """Run GRPO as configured; returns the final evaluation (and the first one, when this run made it).

    SIGTERM or SIGINT raises `tandem.run.signals.Stopped`: the step whose update is queued on the workers finishes, a
    step still sampling or scoring is dropped, the last completed step is checkpointed (run.save_on_signal), metrics
    are flushed and every worker stops. A second signal raises it at once, unsaved."""
    r = cfg.run
    then = ("saves a checkpoint of the last completed step" if r.save_on_signal
            else "exits unsaved (run.save_on_signal=false)")
    with StopSignals(then) as stop:
        try:
            run = prepare(cfg, resume)  # a signal while starting stops at once: no step has finished to save
            run.stop = stop
            stop.running()
            return _train(run)
        except Stopped as stopped:
            if not stopped.saved:
                stopped.checkpoint = checkpoint.latest(Path(r.output_dir) / "checkpoints")
            raise


def _train(run: Run) -> dict[str, float]:
    r = run.cfg.run
    summary: dict[str, float] = {}
    metrics: MetricsLog | None = None
    bar = None
    try:
        metrics = MetricsLog(Path(r.output_dir), r.tensorboard, r.name, run.start_step if run.resumed else None)
        if run.start_step == 0:
            first = run_eval(run)
            metrics.log(0, first)
            summary.update({f"initial_{k}": v for k, v in first.items()})
            log.info("step 0 eval: %s", _fmt(first))
        bar = _progress(r.progress, run.start_step, r.steps)

        def evaluates(step: int) -> bool:
            return _every(r.eval_every, step) or step == r.steps

        def saves(step: int) -> bool:
            return _every(r.save_every, step) or step == r.steps

        done = run.start_step  # the last step whose update is in the weights and whose metrics are logged

        def conclude(s: Launched) -> None:
            nonlocal done
            m = finish(run, s)
            if evaluates(s.step):
                m.update(run_eval(run))
            metrics.log(s.step, m)
            if saves(s.step):
                save(run, s.step)
            done = s.step
            if bar is not None:
                bar.update(1)
                bar.set_postfix(reward=f"{m['reward/mean']:.3f}", acc=f"{m['train/accuracy']:.2f}",
                                **({"eval": f"{m['eval/accuracy']:.2f}"} if "eval/accuracy" in m else {}))

        queued: Launched | None = None  # a step whose update may still be running on the workers
        for step in range(run.start_step + 1, r.steps + 1):
            # What a checkpoint of the step before this one records, should a stop drop this one half-sampled.
            restart = run.rollouts.resume_state(), checkpoint.rng_state()
            if run.stop.signum is not None:
                break
            try:
                launched = grpo_step(run, step)  # this step's samples were scored while `queued` trained
            except Stopped as stopped:
                if stopped.second:
                    raise
                break  # asked to stop before its update was queued: only its samples and scores are lost
            except BaseException:
                if queued is not None:  # its update ran (or failed too): its metrics are not lost with this step
                    with suppress(Exception):
                        conclude(queued)
                raise
            if queued is not None:
                conclude(queued)
            queued = launched
            if evaluates(step) or saves(step):
                conclude(queued)  # evaluation and checkpoints see this step's update, and nothing queued after it
                queued = None
        else:
            if bar is not None:
                bar.close()
            final = metrics.history[-1] if metrics.history else {}
            summary.update({k: v for k, v in final.items() if k.startswith("eval/")})
            if r.plots:
                metrics.plot()
            print(metrics.summary())
            return summary
        if queued is not None:
            conclude(queued)  # its update is on the workers already: wait for it, so that it is saved and logged
        raise _stopped(run, done, *restart)
    finally:
        with run.stop.closing():
            if bar is not None:
                bar.close()
            if metrics is not None:
                metrics.close()
            run.close()


def _stopped(run: Run, done: int, data: dict, rng: dict) -> Stopped:
    """The stop of a run whose last completed step is `done`: saved first, if asked and not on disk already."""
    stopped = Stopped(run.stop.signum)
    stopped.step = done
    have = checkpoint.checkpoints(Path(run.cfg.run.output_dir) / "checkpoints")
    if have and have[-1][0] == done:
        stopped.checkpoint, stopped.saved = have[-1][1], True
    elif done > 0 and run.cfg.run.save_on_signal:
        checkpoint.set_rng_state(rng)  # as step `done` left it: nothing the dropped step drew reaches the resume
        stopped.checkpoint, stopped.saved = save(run, done, data), True
    return stopped


def _changed_keys(old: dict, new: dict, prefix: str = "") -> list[str]:
    out = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _changed_keys(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k}")
    return out


def _every(period: int, step: int) -> bool:
    return bool(period) and step % period == 0


def _progress(enabled: bool, start: int, total: int):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=start, desc="grpo", unit="step", dynamic_ncols=True)


def _fmt(m: dict) -> str:
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in m.items())
