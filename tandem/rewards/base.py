"""Reward functions by name; scoring a batch by a weighted sum where a failing function scores 0 and is counted."""
from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from tandem.plugins import Registry

log = logging.getLogger("tandem.rewards")


@dataclass(frozen=True)
class RewardFn:
    """A registered reward.

    Per-sample: `fn(completion: str, prompt: str, row: Mapping, **kwargs) -> float`.
    Batched (`batched=True`): `fn(completions: list[str], prompts: list[str], rows: list[Mapping], **kwargs)
    -> list[float]`. `row` is the dataset row the prompt came from (its answer, tests, ...); `kwargs` are the
    spec's `kwargs` from config. A score is a finite real number; bools count as 0/1.

    `inline=True` declares the function cheap and bounded (regex, arithmetic, or its own subprocess limits, like
    `code`): it runs in the trainer's process with no per-call time limit and no round-trip. Everything else
    (math-verify, user plugins) runs in the worker pool, where a hang or crash is killed and counted.
    A plugin declares these by function attributes: `score.batched = True`, `score.inline = True`.
    """

    name: str
    fn: Callable[..., Any]
    batched: bool = False
    inline: bool = False

    @classmethod
    def of(cls, name: str, fn: Callable[..., Any], batched: bool | None = None, inline: bool | None = None
           ) -> "RewardFn":
        """As registered (`register_reward`'s arguments), or as a plugin declares itself (its attributes)."""
        return cls(name, fn, bool(getattr(fn, "batched", False) if batched is None else batched),
                   bool(getattr(fn, "inline", False) if inline is None else inline))


REWARDS: Registry[RewardFn] = Registry("reward", RewardFn.of)


def register_reward(name: str, batched: bool = False, inline: bool = False):
    """Decorator: register `fn` under `name` (see RewardFn for the signature and what `inline` means)."""
    return REWARDS.register(name, batched=batched, inline=inline)


def resolve_reward(name: str) -> RewardFn:
    """A registered name, or a user plugin given by import path `package.module:function` (`import_plugin`)."""
    return REWARDS.resolve(name)


@dataclass
class RewardResult:
    total: list[float]  # weighted sum per sample
    per_fn: dict[str, list[float]]  # each function's raw score per sample
    errors: dict[str, int] = field(default_factory=dict)  # samples each function failed on (scored 0)
    error_kinds: dict[str, dict[str, int]] = field(default_factory=dict)  # name -> raised/bad_value/timeout/...
    last_error: dict[str, str] = field(default_factory=dict)  # name -> "kind: message" of its last failed sample
    budget_used: float = 0.0  # the call's time as a fraction of the step budget (1.0: it ran out)
    metrics: dict[str, float] = field(default_factory=dict)  # what built rewards report of the call (a model's time)

    def error_counts(self, prefix: str) -> dict[str, int]:
        """`<prefix>/<name>`: the samples each function failed on (scored 0); `<prefix>/<name>/<kind>`: by kind.
        Training logs them as `reward/errors/...`, evaluation as `eval/reward_errors/...`."""
        out = {f"{prefix}/{name}": n for name, n in self.errors.items()}
        for name, kinds in self.error_kinds.items():
            out.update({f"{prefix}/{name}/{kind}": n for kind, n in kinds.items()})
        return out


class RewardErrorRateExceeded(ValueError):
    """A reward failed on more of the recent samples than `reward_pool.max_error_rate` allows. A ValueError, so the
    command line prints it as one line: it is the user's reward (or its input) that needs fixing."""


class ErrorRateLimit:
    """Stops a run whose reward fails on most samples instead of training on its zeros (the silent-zero class of
    bug: a reward that cannot import, reads a missing field, or hangs everywhere still "scores" every sample).
    The rate is taken over the samples of the steps so far, the last `window` at most: step 1 is judged alone, so a
    reward broken from the start stops the run at step 1; after that, one bad step among good ones does not stop
    it (at 0.5, a step failing everywhere after one clean step is 50% of the two), a second in a row does."""

    def __init__(self, max_rate: float, window: int = 3):
        self.max_rate = max_rate
        self._steps: deque[tuple[int, Mapping[str, int]]] = deque(maxlen=window)

    def observe(self, samples: int, errors: Mapping[str, int], last_error: Mapping[str, str]) -> dict[str, float]:
        """Record one step's counts; its `reward/error_rate/<name>`. Raises RewardErrorRateExceeded when a
        function's rate over the window is above `max_rate`."""
        self._steps.append((samples, dict(errors)))
        total = sum(n for n, _ in self._steps)
        steps = f"{len(self._steps)} step{'s' * (len(self._steps) > 1)}"
        over = []
        for name in errors:
            failed = sum(e.get(name, 0) for _, e in self._steps)
            if total and failed / total > self.max_rate:
                over.append(f"reward {name!r} failed on {failed / total:.0%} of the last {total} samples ({steps}), "
                            f"its last error: {last_error.get(name, 'unknown')}")
        if over:
            raise RewardErrorRateExceeded(
                f"{'; '.join(over)}. That is over reward_pool.max_error_rate={self.max_rate:g}, and training on "
                f"its zeros would teach nothing: fix the reward (reward/errors/<name>/<kind> in metrics.jsonl counts "
                f"each kind of failure), or raise reward_pool.max_error_rate (1 never stops)")
        return {f"reward/error_rate/{name}": n / samples if samples else 0.0 for name, n in errors.items()}


# What reward code may raise and still be only a failure of that reward, wherever it runs (a call, the __float__
# of what it returned, its warm-up, its preflight): any Exception, and SystemExit (sys.exit()). KeyboardInterrupt
# is not: in the trainer's process it is the user's Ctrl-C and stops the run; a pool worker never gets the user's
# (its own session), so there one is a crash.
REWARD_FAILURES = (Exception, SystemExit)

# An outcome per sample: (score, "", "") or (None, kind, message).
Outcome = tuple[float | None, str, str]


def call_one(fn: Callable[..., Any], args: tuple, kwargs: Mapping) -> Outcome:
    """One per-sample call, its failures classified: `raised` (an exception or sys.exit) or `bad_value`."""
    try:
        value = fn(*args, **kwargs)
    except REWARD_FAILURES as exc:
        return None, "raised", repr(exc)[:500]
    try:
        return finite_score(value), "", ""
    except REWARD_FAILURES as exc:
        return None, "bad_value", str(exc)[:500]


def call_batched(fn: Callable[..., Any], completions: list, prompts: list, rows: list,
                 kwargs: Mapping) -> list[Outcome]:
    """One batched call; when it raises or returns the wrong number of scores, its whole batch failed. An exception
    in place of a score is that sample's failure alone (`raised`)."""
    n = len(completions)
    try:
        values = list(fn(completions, prompts, rows, **kwargs))
        if len(values) != n:
            raise ValueError(f"returned {len(values)} scores for {n} completions")
    except REWARD_FAILURES as exc:
        return [(None, "raised", repr(exc)[:500])] * n
    out: list[Outcome] = []
    for value in values:
        if isinstance(value, BaseException):
            out.append((None, "raised", repr(value)[:500]))
            continue
        try:
            out.append((finite_score(value), "", ""))
        except REWARD_FAILURES as exc:
            out.append((None, "bad_value", str(exc)[:500]))
    return out


# The largest float32 (torch.finfo(torch.float32).max, stated here since this layer imports no torch): a step's
# rewards are a float32 tensor, where a score finite in float64 but larger than this is inf, and a group holding an
# inf has advantages of 0 (no error, no warning). So a score, and a sample's weighted total, must stay within it.
FLOAT32_MAX = 3.4028234663852886e38


def finite_score(value: Any) -> float:
    """A score must be a real number finite in float32 (bools count as 0/1); anything else is an error."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (str, bytes)) or not (isinstance(value, (int, float)) or hasattr(value, "__float__")):
        raise TypeError(f"returned {type(value).__name__} {value!r:.80}, expected a number")
    try:
        x = float(value)
    except REWARD_FAILURES as exc:  # the reward's own number type: its __float__ may raise anything, sys.exit too
        raise TypeError(f"returned {type(value).__name__}, whose float() raised {exc!r}"[:500]) from None
    if not math.isfinite(x):
        raise ValueError(f"returned non-finite {x}")
    if abs(x) > FLOAT32_MAX:
        raise ValueError(f"returned {x:g}, beyond float32's range (|score| <= {FLOAT32_MAX:.4g}), the dtype a step's "
                         "rewards train in; scale the score down")
    return x


def overflows(total: float, weighted: float) -> bool:
    """Whether a sample's `total` with `weighted` added leaves float32's range (a NaN does too): summed scores
    overflow as surely as one large one."""
    return not abs(total + weighted) <= FLOAT32_MAX


def default_workers() -> int:
    """Pool size when not configured: one per core, at most 4 (rewards are a small slice of a step)."""
    return max(1, min(4, os.cpu_count() or 1))


def _by_reference(fn: Callable[..., Any]) -> bytes | None:
    """`fn` pickled by reference (module + qualified name) if a worker can import it; None for lambdas, closures and
    functions of `__main__`, which a worker process cannot load."""
    import pickle

    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if module in (None, "__main__", "__mp_main__") or "<" in qualname:
        return None
    try:
        data = pickle.dumps(fn)
        return data if pickle.loads(data) is fn else None
    except Exception:
        return None


@dataclass(frozen=True)
class _Entry:
    key: str  # the metric name: the spec's name, made unique if a function is listed twice
    rf: RewardFn
    weight: float
    kwargs: dict
    fn_bytes: bytes | None  # set when it runs in the pool


class RewardSetupError(ValueError):
    """A reward cannot run here as configured (its `preflight` check failed): the run stops before models load."""


def _preflight(name: str, rf: RewardFn, kwargs: dict) -> None:
    """A reward may carry `fn.preflight(**kwargs)`, run once when a scorer is built (the code sandbox's self-test):
    its failure, or kwargs the reward does not take, stop the run now instead of scoring every sample 0."""
    check = getattr(rf.fn, "preflight", None)
    if not callable(check):
        return
    try:
        check(**kwargs)
    except REWARD_FAILURES as exc:
        raise RewardSetupError(f"reward {name!r} cannot run: {exc}") from exc


class RewardScorer:
    """Scores completions with a weighted sum of named rewards.

    Inline rewards run in this process; the others run in a pool of `workers` processes where each call has
    `timeout_s` (a batched function's one call covers its whole batch). `workers=0` runs everything inline with no
    time limit (debugging). One `score()` call has `step_budget_s` in all: inline rewards run first (they are
    cheap), the pool gets what is left, and when it runs out the calls in flight are killed and every sample not
    scored yet scores 0 (kind `budget`); an inline call is never interrupted, only not started. A reward that
    raises (sys.exit() included), hangs, crashes its worker, or returns a non-finite or non-numeric value scores 0
    for that sample, is counted in `errors[name]` and `error_kinds[name][kind]`, and is logged once per function
    and kind with the sample, so training goes on and nothing fails silently. `error_limit` is the trainer's check
    that a reward does not fail on most samples (`max_error_rate`).

    `builders` maps a name to what builds that reward from its config spec, for a reward holding what this layer
    cannot know (a reward model: `tandem.train.reward_model`, given by the trainer). What it builds is a batched
    inline reward; it may report `metrics(key) -> dict` after each call (`RewardResult.metrics`) and is closed
    with the scorer.
    """

    def __init__(self, specs: Sequence[Any], *, timeout_s: float = 10.0, workers: int | None = None,
                 step_budget_s: float = math.inf, max_error_rate: float = 1.0,
                 builders: Mapping[str, Callable[[Any], Callable[..., Any]]] | None = None):
        self.timeout_s = float(timeout_s)
        self.step_budget_s = float(step_budget_s)
        self.error_limit = ErrorRateLimit(max_error_rate)
        self.workers = default_workers() if workers is None else int(workers)
        self._logged: set[tuple[str, str]] = set()
        self._lock = threading.Lock()  # one score() at a time: the pool drives its workers from one caller
        entries: list[_Entry] = []
        self._built: list[Any] = []  # closed with the scorer
        for spec in specs:  # (name, weight, kwargs) tuples or config RewardSpec objects
            name, weight, kwargs = (spec.name, spec.weight, spec.kwargs) if hasattr(spec, "name") else spec
            if name in (builders or {}):
                self._built.append(builders[name](spec))
                rf = RewardFn(name, self._built[-1], batched=True, inline=True)
            else:
                rf = resolve_reward(name)
                _preflight(name, rf, dict(kwargs or {}))
            key, k = name, 2
            while any(e.key == key for e in entries):
                key, k = f"{name}_{k}", k + 1
            fn_bytes = None
            if not rf.inline and self.workers > 0:
                fn_bytes = _by_reference(rf.fn)
                if fn_bytes is None:
                    log.warning("reward %r cannot be loaded by a worker process (a lambda, closure or __main__ "
                                "function); it runs inline, without a time limit", name)
            entries.append(_Entry(key, rf, float(weight), dict(kwargs or {}), fn_bytes))
        self.entries = entries
        self.specs = [(e.rf, e.weight, e.kwargs) for e in entries]
        self._pool = None
        pooled = list(dict.fromkeys(e.fn_bytes for e in entries if e.fn_bytes is not None))
        if pooled:  # start now, so workers import and warm up while the model loads
            from tandem.rewards.pool import RewardPool

            self._pool = RewardPool(self.workers, warm=pooled)

    def _fail(self, name: str, kind: str, message: str, completion: str) -> None:
        if (name, kind) not in self._logged:
            self._logged.add((name, kind))
            log.warning("reward %r failed (%s; scored 0, counted in reward/errors/%s): %s on completion %r",
                        name, kind, name, message, completion[:200])

    def _out_of_budget(self) -> Outcome:
        return None, "budget", (f"not scored: the step's reward budget ran out (reward_pool.step_budget_s="
                                f"{self.step_budget_s:g})")

    def _inline(self, e: _Entry, completions, prompts, rows, deadline: float) -> list[Outcome]:
        n = len(completions)
        if time.monotonic() >= deadline:
            return [self._out_of_budget()] * n
        if e.rf.batched:
            return call_batched(e.rf.fn, completions, prompts, rows, e.kwargs)
        return [call_one(e.rf.fn, (completions[i], prompts[i], rows[i]), e.kwargs) if time.monotonic() < deadline
                else self._out_of_budget() for i in range(n)]

    def _pooled(self, entries: list[_Entry], completions, prompts, rows, deadline: float) -> dict[str, list]:
        from tandem.rewards.pool import Job

        items = tuple((i, completions[i], prompts[i], rows[i]) for i in range(len(completions)))
        jobs = [Job(e.key, e.fn_bytes, e.kwargs, e.rf.batched, items) for e in entries]
        try:
            res = self._pool.run(jobs, self.timeout_s, deadline, self._out_of_budget()[2])
        except Exception as exc:  # a bug in the pool must not stop training either
            log.exception("reward pool failed; scoring its rewards 0 this step")
            return {e.key: [(None, "pool", repr(exc)[:500])] * len(items) for e in entries}
        return {e.key: [(o.value, o.kind, o.message) if (o := res[e.key].get(i)) is not None
                        else (None, "pool", "no result") for i in range(len(items))] for e in entries}

    def score(self, completions: list[str], prompts: list[str], rows: list[Mapping]) -> RewardResult:
        """Score each (completion, prompt, row); callable from any thread (calls are serialized)."""
        with self._lock:
            return self._score(completions, prompts, rows)

    def _score(self, completions: list[str], prompts: list[str], rows: list[Mapping]) -> RewardResult:
        n = len(completions)
        if not (len(prompts) == len(rows) == n):
            raise ValueError(f"score: {n} completions, {len(prompts)} prompts, {len(rows)} rows")
        start = time.monotonic()
        deadline = start + self.step_budget_s
        outcomes: dict[str, list] = {}
        for e in self.entries:  # inline first: cheap, so a hanging pooled reward cannot starve them
            if e.fn_bytes is None:
                outcomes[e.key] = self._inline(e, completions, prompts, rows, deadline)
        pooled = [e for e in self.entries if e.fn_bytes is not None]
        if pooled and n:
            outcomes.update(self._pooled(pooled, completions, prompts, rows, deadline))
        seconds = time.monotonic() - start
        total, per_fn, errors, kinds, last = self._tally(outcomes, completions)
        metrics: dict[str, float] = {}
        for e in self.entries:
            report = getattr(e.rf.fn, "metrics", None)
            if callable(report) and e.key in outcomes:
                metrics.update(report(e.key))
        over = {name: c["budget"] for name, c in kinds.items() if c.get("budget")}
        if over:  # every time, not once: each step it happens costs the whole budget
            log.warning("the reward budget ran out after %.1f s (reward_pool.step_budget_s=%g); not scored, so 0: %s",
                        seconds, self.step_budget_s, ", ".join(f"{k} on {v} samples" for k, v in over.items()))
        return RewardResult(total, per_fn, errors, kinds, last, seconds / self.step_budget_s, metrics)

    def _tally(self, outcomes: Mapping[str, list[Outcome]], completions: list[str]) -> tuple[
            list[float], dict[str, list[float]], dict[str, int], dict[str, dict[str, int]], dict[str, str]]:
        """Each sample's weighted total, each function's scores, and the failures counted by function and kind. A
        score whose weighted value takes its sample's total beyond float32 (`overflows`) fails there, as a
        `bad_value` of the function that added it."""
        n = len(completions)
        total = [0.0] * n
        per_fn: dict[str, list[float]] = {}
        errors: dict[str, int] = {}
        kinds: dict[str, dict[str, int]] = {}
        last: dict[str, str] = {}
        for e in self.entries:
            scores = [0.0] * n
            counts: dict[str, int] = {}
            for i, (value, kind, message) in enumerate(outcomes.get(e.key, [])):
                if value is not None and overflows(total[i], e.weight * value):
                    value, kind, message = None, "bad_value", (
                        f"returned {value:g}, which weighted by {e.weight:g} takes the sample's total to "
                        f"{total[i] + e.weight * value:g}, beyond float32's range (|total| <= {FLOAT32_MAX:.4g}), "
                        "the dtype a step's rewards train in; scale the score or its weight down")
                if value is None:
                    counts[kind] = counts.get(kind, 0) + 1
                    last[e.key] = f"{kind}: {message}"
                    self._fail(e.key, kind, message, completions[i])
                else:
                    scores[i] = value
                    total[i] += e.weight * value
            per_fn[e.key] = scores
            errors[e.key] = sum(counts.values())
            kinds[e.key] = counts
        return total, per_fn, errors, kinds, last

    def close(self) -> None:
        """Stop the worker pool and close what `builders` built (idempotent)."""
        while self._built:
            built = self._built.pop()
            if callable(getattr(built, "close", None)):
                built.close()
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def __enter__(self) -> "RewardScorer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

