"""Reward functions by name, and scoring a batch with a weighted sum where a failing function scores 0 and is counted."""
from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

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


REWARDS: dict[str, RewardFn] = {}


def register_reward(name: str, batched: bool = False, inline: bool = False):
    """Decorator: register `fn` under `name` (see RewardFn for the signature and what `inline` means)."""

    def deco(fn):
        if name in REWARDS:
            raise ValueError(f"reward {name!r} is registered twice")
        REWARDS[name] = RewardFn(name, fn, batched, inline)
        return fn

    return deco


def resolve_reward(name: str) -> RewardFn:
    """A registered name, or a user plugin given by import path `package.module:function`."""
    if name in REWARDS:
        return REWARDS[name]
    if ":" in name:
        import importlib

        module, _, attr = name.partition(":")
        fn = getattr(importlib.import_module(module), attr)
        return RewardFn(name, fn, bool(getattr(fn, "batched", False)), bool(getattr(fn, "inline", False)))
    import difflib

    near = difflib.get_close_matches(name, list(REWARDS), n=1)
    hint = f"; did you mean {near[0]!r}?" if near else f"; registered: {', '.join(sorted(REWARDS))}"
    raise KeyError(f"unknown reward {name!r}{hint} (or give a plugin as 'module:function')")


@dataclass
class RewardResult:
    total: list[float]  # weighted sum per sample
    per_fn: dict[str, list[float]]  # each function's raw score per sample
    errors: dict[str, int] = field(default_factory=dict)  # samples each function failed on (scored 0)
    error_kinds: dict[str, dict[str, int]] = field(default_factory=dict)  # name -> raised/bad_value/timeout/crashed/pool

    def metrics(self, prefix: str = "reward") -> dict[str, float]:
        """`reward/total`, `reward/<name>` (each function's mean), `reward/errors/<name>` and
        `reward/errors/<name>/<kind>` (counts this step)."""
        out = {f"{prefix}/total": _mean(self.total)}
        out.update({f"{prefix}/{name}": _mean(scores) for name, scores in self.per_fn.items()})
        out.update({f"{prefix}/errors/{name}": float(n) for name, n in self.errors.items()})
        for name, kinds in self.error_kinds.items():
            out.update({f"{prefix}/errors/{name}/{kind}": float(n) for kind, n in kinds.items()})
        return out


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _finite(value: Any) -> float:
    """A score must be a real finite number (bools count as 0/1); anything else is an error."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (str, bytes)) or not (isinstance(value, (int, float)) or hasattr(value, "__float__")):
        raise TypeError(f"returned {type(value).__name__} {value!r:.80}, expected a number")
    x = float(value)
    if not math.isfinite(x):
        raise ValueError(f"returned non-finite {x}")
    return x


def default_workers() -> int:
    """Pool size when not configured: one per core, at most 4 (rewards are a small slice of a step)."""
    import os

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


class RewardScorer:
    """Scores completions with a weighted sum of named rewards.

    Inline rewards run in this process; the others run in a pool of `workers` processes where each call has
    `timeout_s` (a batched function's one call covers its whole batch). `workers=0` runs everything inline with no
    time limit (debugging). A reward that raises, hangs, crashes its worker, or returns a non-finite or
    non-numeric value scores 0 for that sample, is counted in `errors[name]` and `error_kinds[name][kind]`, and is
    logged once per function and kind with the sample, so training goes on and nothing fails silently.
    """

    def __init__(self, specs: Sequence[Any], *, timeout_s: float = 10.0, workers: int | None = None):
        self.timeout_s = float(timeout_s)
        self.workers = default_workers() if workers is None else int(workers)
        self._logged: set[tuple[str, str]] = set()
        self._lock = threading.Lock()  # one score() at a time: the pool drives its workers from one caller
        entries: list[_Entry] = []
        for spec in specs:  # (name, weight, kwargs) tuples or config RewardSpec objects
            name, weight, kwargs = (spec.name, spec.weight, spec.kwargs) if hasattr(spec, "name") else spec
            rf = resolve_reward(name)
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

    def _inline(self, e: _Entry, completions, prompts, rows) -> list[tuple[float | None, str, str]]:
        n = len(completions)
        if e.rf.batched:
            try:
                raw = list(e.rf.fn(completions, prompts, rows, **e.kwargs))
                if len(raw) != n:
                    raise ValueError(f"returned {len(raw)} scores for {n} completions")
            except Exception as exc:  # the whole batch failed
                return [(None, "raised", repr(exc)[:500])] * n
        else:
            raw = []
            for i in range(n):
                try:
                    raw.append(e.rf.fn(completions[i], prompts[i], rows[i], **e.kwargs))
                except Exception as exc:
                    raw.append(_Raised(repr(exc)[:500]))
        out = []
        for v in raw:
            if isinstance(v, _Raised):
                out.append((None, "raised", v.message))
                continue
            try:
                out.append((_finite(v), "", ""))
            except Exception as exc:
                out.append((None, "bad_value", str(exc)[:500]))
        return out

    def _pooled(self, entries: list[_Entry], completions, prompts, rows) -> dict[str, list]:
        from tandem.rewards.pool import Job

        items = tuple((i, completions[i], prompts[i], rows[i]) for i in range(len(completions)))
        jobs = [Job(e.key, e.fn_bytes, e.kwargs, e.rf.batched, items) for e in entries]
        try:
            res = self._pool.run(jobs, self.timeout_s)
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
        outcomes: dict[str, list] = {}
        pooled = [e for e in self.entries if e.fn_bytes is not None]
        if pooled and n:
            outcomes.update(self._pooled(pooled, completions, prompts, rows))
        for e in self.entries:
            if e.fn_bytes is None:
                outcomes[e.key] = self._inline(e, completions, prompts, rows)
        total = [0.0] * n
        per_fn: dict[str, list[float]] = {}
        errors: dict[str, int] = {}
        kinds: dict[str, dict[str, int]] = {}
        for e in self.entries:
            scores = [0.0] * n
            counts: dict[str, int] = {}
            for i, (value, kind, message) in enumerate(outcomes.get(e.key, [])):
                if value is None:
                    counts[kind] = counts.get(kind, 0) + 1
                    self._fail(e.key, kind, message, completions[i])
                else:
                    scores[i] = value
                    total[i] += e.weight * value
            per_fn[e.key] = scores
            errors[e.key] = sum(counts.values())
            kinds[e.key] = counts
        return RewardResult(total, per_fn, errors, kinds)

    def close(self) -> None:
        """Stop the worker pool (idempotent)."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def __enter__(self) -> "RewardScorer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class _Raised:
    message: str
