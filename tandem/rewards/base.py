"""Reward functions by name, and scoring a batch with a weighted sum where a failing function scores 0 and is counted."""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

log = logging.getLogger("tandem.rewards")


@dataclass(frozen=True)
class RewardFn:
    """A registered reward.

    Per-sample: `fn(completion: str, prompt: str, row: Mapping, **kwargs) -> float`.
    Batched (`batched=True`): `fn(completions: list[str], prompts: list[str], rows: list[Mapping], **kwargs)
    -> list[float]`. `row` is the dataset row the prompt came from (its answer, tests, ...).
    """

    name: str
    fn: Callable[..., Any]
    batched: bool = False


REWARDS: dict[str, RewardFn] = {}


def register_reward(name: str, batched: bool = False):
    def deco(fn):
        if name in REWARDS:
            raise ValueError(f"reward {name!r} is registered twice")
        REWARDS[name] = RewardFn(name, fn, batched)
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
        return RewardFn(name, fn, getattr(fn, "batched", False))
    import difflib

    near = difflib.get_close_matches(name, list(REWARDS), n=1)
    hint = f"; did you mean {near[0]!r}?" if near else f"; registered: {', '.join(sorted(REWARDS))}"
    raise KeyError(f"unknown reward {name!r}{hint} (or give a plugin as 'module:function')")


@dataclass
class RewardResult:
    total: list[float]  # weighted sum per sample
    per_fn: dict[str, list[float]]  # each function's raw score per sample
    errors: dict[str, int] = field(default_factory=dict)  # samples each function failed on (scored 0)


def _finite(value: Any) -> float:
    """A score must be a real finite number (bools count as 0/1); anything else is an error."""
    if isinstance(value, bool):
        return float(value)
    if not isinstance(value, (int, float)) and not hasattr(value, "__float__"):
        raise TypeError(f"returned {type(value).__name__} {value!r}, expected a number")
    x = float(value)
    if not math.isfinite(x):
        raise ValueError(f"returned non-finite {x}")
    return x


class RewardScorer:
    """Scores completions with a weighted sum of named rewards, in this process.

    A reward that raises or returns garbage scores 0 for that sample, is counted in `errors[name]`, and is logged
    once per function with the sample, so training goes on and nothing fails silently.
    """

    def __init__(self, specs: list[tuple[str, float, dict]]):
        self.specs = [(resolve_reward(name), weight, dict(kwargs)) for name, weight, kwargs in specs]
        self._logged: set[str] = set()

    def _fail(self, name: str, exc: BaseException, completion: str) -> None:
        if name not in self._logged:
            self._logged.add(name)
            log.warning("reward %r failed (scored 0, counted in reward/errors/%s): %r on completion %r",
                        name, name, exc, completion[:200])

    def score(self, completions: list[str], prompts: list[str], rows: list[Mapping]) -> RewardResult:
        n = len(completions)
        total = [0.0] * n
        per_fn: dict[str, list[float]] = {}
        errors: dict[str, int] = {}
        for rf, weight, kwargs in self.specs:
            scores = [0.0] * n
            errs = 0
            if rf.batched:
                try:
                    raw = list(rf.fn(completions, prompts, rows, **kwargs))
                    if len(raw) != n:
                        raise ValueError(f"returned {len(raw)} scores for {n} completions")
                except Exception as exc:  # the whole batch failed
                    self._fail(rf.name, exc, completions[0] if completions else "")
                    raw, errs = [0.0] * n, n
                for i, v in enumerate(raw):
                    try:
                        scores[i] = _finite(v)
                    except Exception as exc:
                        errs += 1
                        self._fail(rf.name, exc, completions[i])
            else:
                for i in range(n):
                    try:
                        scores[i] = _finite(rf.fn(completions[i], prompts[i], rows[i], **kwargs))
                    except Exception as exc:
                        errs += 1
                        self._fail(rf.name, exc, completions[i])
            per_fn[rf.name] = scores
            errors[rf.name] = errs
            for i in range(n):
                total[i] += weight * scores[i]
        return RewardResult(total, per_fn, errors)
