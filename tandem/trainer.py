"""The controller: GRPO's loop (`_train`), the step it repeats (`grpo_step`), and a run's start (`start_run`)."""
from __future__ import annotations

import logging
import time
from contextlib import ExitStack, suppress
from dataclasses import dataclass, field
from pathlib import Path


from tandem.algo import ADVANTAGES
from tandem.architectures import ModelProfile
from tandem.config import Config, ConfigError
from tandem.data.images import image_resize
from tandem.data.sources import Prompt, PromptStream, load_prompts
from tandem.modeling import load_processor, load_tokenizer
from tandem.rewards import RewardScorer
from tandem.rollout import Samples, judge
from tandem.run import checkpoint
from tandem.run.card import model_card
from tandem.run.directory import RunLock, Start, claim
from tandem.run.evaluation import RESULTS_FILE, Evaluation, evaluate, results, write_json
from tandem.run.metrics import METRICS_FILE, MetricsLog
from tandem.run.preflight import check_before_loading
from tandem.run.signals import StopSignals, Stopped
from tandem.run.trackers import RunInfo, Trackers
from tandem.run.source import RolloutSource, sampling_for
from tandem.run.vision import VisionPrompts
from tandem.util.rng import rng_state, set_rng_state
from tandem.workers import models, placement
from tandem.workers.group import Pending, local_device
from tandem.workers.placement import Placement, Synced

log = logging.getLogger("tandem.trainer")


@dataclass
class Run:
    """A started run: its workers, where its batches come from, what scores them, and where it stands."""

    cfg: Config
    workers: Placement
    source: RolloutSource
    scorer: RewardScorer
    correct_reward: str  # the reward whose score >= 1 counts as correct (the first listed)
    eval_prompts: list[Prompt]
    start_step: int = 0
    resumed: bool = False
    lock: RunLock | None = None  # on run.output_dir, for the run's lifetime (None: evaluation only)
    stop: StopSignals = field(default_factory=StopSignals)  # `train` passes its own; this one never fires
    last_finished: float = 0.0  # wall-clock end of the last finished step's weight sync
    last_eval: Evaluation | None = None  # the latest evaluation (`run_eval`), per reward, per task and per sample
    profile: ModelProfile | None = None  # the model's (tandem.architectures.profile), resolved once by `start_run`

    def close(self) -> None:
        try:
            self.workers.shutdown()
            self.scorer.close()
        finally:
            if self.lock is not None:  # last: nothing of this run writes into the directory after it
                self.lock.release()


def train(cfg: Config, resume: bool | Start = False) -> dict[str, float]:
    """Run GRPO as configured; returns the final evaluation (and the first one, when this run made it).

    SIGTERM or SIGINT raises `tandem.run.signals.Stopped`: the step whose update is queued on the workers
    finishes, a step still sampling or scoring is dropped, the last completed step is checkpointed
    (run.save_on_signal), metrics are flushed and every worker stops. A second signal raises it at once, unsaved.
    `resume="resume_or_start"` on a run whose last checkpoint is at run.steps raises `RunFinished` before any model
    loads: the run is done (a requeued job), which the CLI reports as a success."""
    r = cfg.run
    then = ("saves a checkpoint of the last completed step" if r.save_on_signal
            else "exits unsaved (run.save_on_signal=false)")
    with StopSignals(then) as stop:
        try:
            run = start_run(cfg, resume, stop=stop)  # a signal while starting stops at once: no step to save
            stop.running()
            return _train(run)
        except Stopped as stopped:
            if not stopped.saved:
                stopped.checkpoint = checkpoint.latest(Path(r.output_dir) / "checkpoints")
            raise


def _train(run: Run) -> dict[str, float]:
    """The loop. Each step's batch comes from the rollout source while the step before it still trains; that step
    is then concluded (metrics, evaluation, checkpoint at their periods). A stop ends it between steps."""
    cadence = Cadence(run)
    try:
        cadence.start()
        queued: Launched | None = None  # a step whose update may still be running on the workers
        for step in range(run.start_step + 1, run.cfg.run.steps + 1):
            restart = run.source.resume_state(), rng_state()  # what a stop before this step's update saves
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
                        cadence.conclude(queued)
                raise
            if queued is not None:
                cadence.conclude(queued)
            queued = launched
            if cadence.due(step):  # evaluation and checkpoints see this step's update, and nothing queued after it
                cadence.conclude(queued)
                queued = None
        else:
            return cadence.finish()
        if queued is not None:
            cadence.conclude(queued)  # its update is on the workers already: wait for it, so it is saved and logged
        raise _stopped(run, cadence.done, *restart)
    finally:
        with run.stop.closing():
            cadence.close()
            run.close()


@dataclass
class Launched:
    """A step whose batch is scored and whose update and weight sync are queued on the workers."""

    step: int
    metrics: dict[str, float]
    launched_at: float  # wall-clock time at the start of `grpo_step`
    tokens: int  # prompt + completion tokens trained on
    prepared: Pending
    trained: Pending
    synced: Synced


def grpo_step(run: Run, step: int) -> Launched:
    """Take the step's batch (sampled, scored, filtered and shaped by the rollout source), queue its old and
    reference logprobs, compute the advantages, queue the update and the weight sync. It returns without waiting
    for them: the next step's batch is scored while this one trains."""
    a = run.cfg.algo
    launched_at = time.time()
    batch, m = run.source.next(step)
    run.stop.check()  # the last moment a stop can drop this step: next, its update is queued
    samples = batch.samples
    lengths = samples.completion_lengths
    run.workers.observe_lengths(lengths)
    if run.workers.teachers is not None:  # distillation on the teacher's own workers, beside the previous update
        samples, m["time/teacher"] = run.workers.teacher_logprobs(samples)
    prepared = run.workers.prepare(samples)  # queued behind the previous step's update and sync
    reward = batch.rewards
    if a.kl_in_reward:
        reward = reward - prepared.get()[0].float()
    # an advantage weighs a row by the tokens it trains on: what the policy sampled, not a tool's, nor a masked row's
    adv = ADVANTAGES[a.advantage](reward, samples.group, lengths=samples.sampled_lengths, eps=a.adv_eps)
    trained = run.workers.train(adv)
    synced = run.workers.sync_weights(step)
    m.update({
        "reward/mean": float(reward.mean()), "reward/std": float(reward.std()) if len(reward) > 1 else 0.0,
        "advantage/mean": float(adv.mean()), "advantage/std": float(adv.std()) if len(adv) > 1 else 0.0,
        "advantage/abs_mean": float(adv.abs().mean()),
        "completion/length_mean": float(lengths.float().mean()), "completion/length_max": int(lengths.max()),
        "completion/truncated_frac": int(samples.truncated.sum()) / len(samples),
    })
    if m.get("time/generate", 0) > 0:  # a streamed step may train only groups that finished during earlier steps
        m["rollout/tokens_per_s"] = int(lengths.sum()) / m["time/generate"]
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


class Cadence:
    """What follows a step's update, at the run's periods: its metrics logged (metrics.jsonl, run.report_to), the
    evaluation (run.eval_every, and after the last step) and the checkpoint (run.save_every, and after the last
    step) of the weights it made, the progress bar. `done` is the last step whose update is in the weights and
    whose metrics are logged."""

    def __init__(self, run: Run):
        self.run, self.done = run, run.start_step
        self.metrics: MetricsLog | None = None
        self.bar = None
        self.summary: dict[str, float] = {}

    def start(self) -> None:
        """Open the metrics log; a new run evaluates its starting model first (step 0)."""
        run, r = self.run, self.run.cfg.run
        out = Path(r.output_dir)
        resume_step = run.start_step if run.resumed else None
        self.metrics = MetricsLog(out, resume_step)
        info = RunInfo(r.name, r.project, out, run.cfg.model_dump(mode="json"), resume_step, self.metrics.history)
        # each tracker starts within run.tracker_timeout_s; a SIGTERM or SIGINT meanwhile stops the wait at once
        self.metrics.trackers = Trackers(r.report_to, info, r.tracker_timeout_s,
                                         stopping=lambda: run.stop.signum is not None)
        if run.start_step == 0 and run.stop.signum is None:  # a run told to stop while starting has nothing to do
            first = run_eval(run)
            self.metrics.log(0, first)
            self.summary.update({f"initial_{k}": v for k, v in first.items()})
            log.info("step 0 eval: %s", _fmt(first))
        self.bar = _progress(r.progress, run.start_step, r.steps)

    def due(self, step: int) -> bool:
        """Whether `step` is evaluated or saved: then nothing may be queued after it before it is concluded."""
        return self._evaluates(step) or self._saves(step)

    def _evaluates(self, step: int) -> bool:
        return _every(self.run.cfg.run.eval_every, step) or step == self.run.cfg.run.steps

    def _saves(self, step: int) -> bool:
        return _every(self.run.cfg.run.save_every, step) or step == self.run.cfg.run.steps

    def conclude(self, s: Launched) -> None:
        m = finish(self.run, s)
        if self._evaluates(s.step):
            m.update(run_eval(self.run))
        self.metrics.log(s.step, m)
        if self._saves(s.step):
            save(self.run, s.step)
        self.done = s.step
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(reward=f"{m['reward/mean']:.3f}", acc=f"{m['train/accuracy']:.2f}",
                                 **({"eval": f"{m['eval/accuracy']:.2f}"} if "eval/accuracy" in m else {}))

    def finish(self) -> dict[str, float]:
        """The run is complete: the final evaluation's figures (and the first one's), the curves, a summary."""
        if self.bar is not None:
            self.bar.close()
        final = self.metrics.history[-1] if self.metrics.history else {}
        evaluated = {k: v for k, v in final.items() if k.startswith("eval/")}
        self.summary.update(evaluated)
        out, trackers = Path(self.run.cfg.run.output_dir), self.metrics.trackers
        if self.run.last_eval is not None:  # the last step's evaluation (every run evaluates after its last step)
            write_json(out / RESULTS_FILE, results(self.run.last_eval, self.run.cfg))
        trackers.final(self.done, evaluated)
        if self.run.cfg.run.plots and (curves := self.metrics.plot()) is not None:
            trackers.image(self.done, "curves", curves)
        print(self.metrics.summary())
        return self.summary

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.metrics is not None:
            self.metrics.close()


def run_eval(run: Run) -> dict[str, float]:
    """The held-out evaluation with the policy's current weights, sampled as the run samples (`sampling_for`): its
    figures as logged (`eval/...`); the whole evaluation is kept as `run.last_eval`."""
    cfg = run.cfg
    def generate(prompts: list[Prompt], sampling) -> Samples:
        return run.workers.generate(run.source.model_prompts(prompts), sampling).samples

    run.last_eval = evaluate(generate, run.eval_prompts,
                             run.scorer, run.correct_reward, sampling_for(cfg, cfg.run.seed), k=cfg.eval.k,
                             temperature=cfg.eval.temperature, task=cfg.data.task)
    return {f"eval/{k}": v for k, v in run.last_eval.figures.items()}


def save(run: Run, step: int, data: dict | None = None) -> Path:
    """Checkpoint `step`; `data`: the prompt stream's position a resume starts from (default: the source's now)."""
    data = run.source.resume_state() if data is None else data
    figures = {f"eval/{k}": v for k, v in run.last_eval.figures.items()} if run.last_eval is not None else {}
    state = {"step": step, "data": data, "config": run.cfg.model_dump(mode="json"), "eval": figures}
    out = Path(run.cfg.run.output_dir)
    card = model_card(state, "adapter" if run.cfg.lora.enabled else "full")
    return checkpoint.save(out / "checkpoints", step, run.workers.save, state, run.cfg.run.keep_checkpoints,
                           flush_first=[out / METRICS_FILE], card=card)


def _stopped(run: Run, done: int, data: dict, rng: dict) -> Stopped:
    """The stop of a run whose last completed step is `done`: saved first, if asked and not on disk already."""
    stopped = Stopped(run.stop.signum)
    stopped.step = done
    have = checkpoint.checkpoints(Path(run.cfg.run.output_dir) / "checkpoints")
    if have and have[-1][0] == done:
        stopped.checkpoint, stopped.saved = have[-1][1], True
    elif done > 0 and run.cfg.run.save_on_signal:
        set_rng_state(rng)  # as step `done` left it: nothing the dropped step drew reaches the resume
        stopped.checkpoint, stopped.saved = save(run, done, data), True
    return stopped


# ---------------------------------------------------------------------------------------------------- start


def start_run(cfg: Config, resume: bool | Start = False, *, claim_output_dir: bool = True,
              stop: StopSignals | None = None) -> Run:
    """Check everything that can be checked (model folder, architecture, devices, tokenizer, data, the run
    directory, rewards), then start the workers and resume them from the last checkpoint. `resume`: True or False
    (`resume` / `start`), or a `tandem.run.directory.Start`. `claim_output_dir=False` (evaluation) neither locks nor
    reads run.output_dir. `stop`: the run's stop signals (default: ones that never fire)."""
    model = check_before_loading(cfg)  # the model's profile, resolved once for the run
    vision = _vision(cfg, model)
    train_prompts, eval_prompts = _prompts(cfg, vision)
    judge.check_fields(cfg.rewards, {"training": [p.row for p in train_prompts],
                                     "held-out": [p.row for p in eval_prompts]})
    stop = stop or StopSignals()
    with ExitStack() as undo:  # what a start that fails before the run exists must close again
        lock, last = None, None
        if claim_output_dir:
            lock, last = claim(Path(cfg.run.output_dir), {True: "resume", False: "start"}.get(resume, resume))
            undo.callback(lock.release)
            if last is not None:
                _check_steps_left(cfg, last, resume)
        pool = cfg.reward_pool
        scorer = RewardScorer(cfg.rewards, timeout_s=pool.timeout_s, workers=pool.workers,
                              step_budget_s=pool.step_budget_s, max_error_rate=pool.max_error_rate,
                              builders=_builders(cfg))
        undo.callback(scorer.close)  # its worker processes started early, to warm up while the models load
        workers = placement.build(cfg, model)
        undo.callback(workers.shutdown)
        _attach_rewards(scorer, workers)
        stream = PromptStream(train_prompts, cfg.run.seed)
        start_step = 0 if last is None else _resume(cfg, workers, stream, last)
        correct = cfg.rewards[0].name
        source = RolloutSource(cfg, stream, workers, scorer, correct, start_step, stop.check, vision)
        run = Run(cfg, workers, source, scorer, correct, eval_prompts, start_step, last is not None, lock, stop,
                  profile=model)
        undo.pop_all()
    return run


def _builders(cfg: Config) -> dict:
    """What builds each model-backed reward (`RewardScorer`'s `builders`): in this process, on its device; with
    placement.reward_workers, the controller's side of one on workers of its own (`RemoteReward`), which the
    placement's workers are attached to once started (`_attach_rewards`)."""
    if not cfg.placement.reward_workers:
        return models.reward_builders(cfg, local_device())
    return {name: models.RemoteReward for name in models.MODEL_REWARDS}


def _attach_rewards(scorer: RewardScorer, workers: Placement) -> None:
    """Each `RemoteReward` of the scorer (cfg.rewards order) to the workers the placement started for it."""
    remote = [e for e in scorer.entries if isinstance(e.rf.fn, models.RemoteReward)]
    for e, i in zip(remote, sorted(workers.reward_hosts)):
        e.rf.fn.attach(workers.reward_hosts[i], e.key)


def _vision(cfg: Config, p: ModelProfile) -> VisionPrompts | None:
    """A vision-language model's prompt renderer (its processor), or None for a text-only model."""
    if not p.images:
        return None
    processor = load_processor(cfg.model.path, cfg.model.trust_remote_code)
    return VisionPrompts(processor, cfg.data.chat_template, cfg.data.system_prompt,
                         image_resize(cfg.data.max_pixels, cfg.data.min_pixels, processor.image_processor.to_dict()))


def _prompts(cfg: Config, vision: VisionPrompts | None = None) -> tuple[list[Prompt], list[Prompt]]:
    """The training prompts and the held-out ones, tokenized and checked (a bad row is named by where it is), before
    any model loads: with a vision-language model's `vision`, rendered by its processor; without, rows with images
    refused."""
    tokenizer = load_tokenizer(cfg.model.path, cfg.model.trust_remote_code)
    return load_prompts(cfg.data, tokenizer, cfg.model.path, None if vision is None else vision.ids)


class RunFinished(Exception):
    """`resume_or_start` found the run at run.steps already: its job ran to the end and was started again (a
    scheduler's requeue). Not an error: the command is meant to be repeated, and the run is where it asks."""


def _check_steps_left(cfg: Config, last: Path, resume: bool | Start) -> None:
    """A resume whose run.steps the checkpoint has reached already would exit having done nothing. Under
    `resume_or_start` a checkpoint at run.steps is a finished run (`RunFinished`); under `resume`, the command a
    person types to train further, it is refused: run.steps was most likely not raised, and a success that trained
    nothing would hide that. A checkpoint beyond run.steps is no run this config describes: refused either way."""
    step = int(checkpoint.STEP_DIR.match(last.name).group(1))  # its trainer state agrees (checkpoint.problems)
    if resume == "resume_or_start" and cfg.run.steps == step:
        raise RunFinished(
            f"the run in {cfg.run.output_dir} is finished: its last checkpoint, {last}, is at run.steps ({step}); "
            f"nothing to train. To train further raise run.steps above {step} (the same command resumes it); to "
            f"evaluate it: tandem eval ... --model {last}")
    if cfg.run.steps <= step:
        raise ConfigError(
            f"run.steps: {cfg.run.steps}, but the run in {cfg.run.output_dir} is at step {step} already "
            f"({last.name}): resuming it would train nothing. Raise run.steps above {step} to train further, or "
            f"evaluate the checkpoint: tandem eval ... --model {last}")


def _resume(cfg: Config, workers: Placement, stream: PromptStream, last: Path) -> int:
    """The workers and the prompt stream as checkpoint `last` left them; its step."""
    state = checkpoint.load_state(last)
    workers.restore(str(last), state["step"])
    stream.load_state_dict(state["data"])
    changed = _changed_keys(state.get("config", {}), cfg.model_dump(mode="json"))
    if changed:
        log.warning("resuming with a config that differs from the checkpoint's in: %s", ", ".join(changed))
    log.info("resumed from %s (step %d)", last, state["step"])
    return state["step"]


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
