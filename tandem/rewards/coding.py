"""Code reward: run the completion's Python against its row's tests in the sandbox; the score is the fraction passed.

Row schema (either key, or both):

- `row["tests"]`: a list whose items are either `{"stdin": str, "stdout": str}` (the program reads stdin; it passes
  if it exits 0 and its output matches, ignoring trailing whitespace on each line and trailing blank lines) or a
  string of assert-style Python (e.g. `"assert add(2, 3) == 5"`) run against the solution once it has loaded;
- `row["test_code"]`: one string of assert-style Python, run against the solution as a single test.

An assert-style test runs in a harness process apart from the program (`sandbox.judge_python`): the tests hold
mirrors of the program's objects, only data crosses, and a program object never judges its relation to the tests'
values, so nothing the program prints, patches or exits with can pass a test for it. The tests' expected values never
enter the program's process unless a test passes them to it. The tests see the solution's functions, classes and data
under their names, read when read, as if they ran after it in the same module, except that builtins and modules are
the harness's own, and a standard-library name the program redefines (`Counter`, `sqrt`, `pi`) is judged both ways
(tandem/rewards/README.md, "The code sandbox").

Before the first call (when the reward scorer starts) `preflight` runs the sandbox's self-test and refuses a sandbox
that cannot run a correct program, or one that is weak (no namespaces) unless `allow_weak_sandbox` says so.
"""
from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Mapping, Sequence

from tandem.rewards.base import register_reward
from tandem.sandbox import SandboxLimits, check_sandbox, judge_python, run_python

_FENCE_RE = re.compile(r"```[ \t]*([\w+-]*)[ \t]*\r?\n(.*?)```", re.DOTALL)


def extract_code(completion: str) -> str:
    """The last fenced code block tagged python/py (or untagged); the whole text when there is no fence."""
    blocks = [(lang.lower(), body) for lang, body in _FENCE_RE.findall(completion)]
    usable = [body for lang, body in blocks if lang in ("", "python", "python3", "py")]
    return usable[-1] if usable else completion


@dataclass(frozen=True)
class CodeTest:
    stdin: str = ""
    expected_stdout: str | None = None  # an input/output test
    assert_code: str | None = None  # an assert-style test


def tests_of(row: Mapping) -> list[CodeTest]:
    """The row's tests (see the module docstring); raises ValueError when it has none or they are malformed."""
    tests: list[CodeTest] = []
    for t in row.get("tests") or []:
        if isinstance(t, str):
            tests.append(CodeTest(assert_code=t))
        elif isinstance(t, Mapping) and "stdout" in t:
            tests.append(CodeTest(stdin=str(t.get("stdin", "")), expected_stdout=str(t["stdout"])))
        else:
            raise ValueError(f"a test must be an assert string or {{'stdin', 'stdout'}}, got {t!r:.80}")
    if row.get("test_code"):
        tests.append(CodeTest(assert_code=str(row["test_code"])))
    if not tests:
        raise ValueError("row has no 'tests' or 'test_code'")
    return tests


def outputs_match(actual: str, expected: str) -> bool:
    """Equal up to trailing whitespace on each line and trailing blank lines (how judges usually compare)."""
    def norm(s: str) -> list[str]:
        return [line.rstrip() for line in s.rstrip().splitlines()]

    return norm(actual) == norm(expected)


def run_test(solution: str, test: CodeTest, limits: SandboxLimits, packages: Sequence[str] = ()) -> bool:
    """Whether `solution` passes `test` in the sandbox."""
    if test.expected_stdout is not None:
        r = run_python(solution, test.stdin, limits, packages=packages)
        return r.ok and outputs_match(r.stdout, test.expected_stdout)
    return judge_python(solution, test.assert_code, limits, packages=packages).passed is True


def preflight(cpu_s: int = 2, wall_s: float = 5.0, memory_mb: int = 1024, parallel: int | None = None,
              packages: Sequence[str] = (), allow_weak_sandbox: bool = False) -> None:
    """Run once when a scorer with `code` is built, before any model loads: the sandbox works here, or the run stops."""
    check_sandbox(packages, allow_weak_sandbox)


@register_reward("code", batched=True, inline=True)
def code(completions: Sequence[str], prompts: Sequence[str], rows: Sequence[Mapping], cpu_s: int = 2,
         wall_s: float = 5.0, memory_mb: int = 1024, parallel: int | None = None, packages: Sequence[str] = (),
         allow_weak_sandbox: bool = False) -> list[float]:
    """The fraction of each row's tests the completion's code passes, each test a separate sandbox run with
    `cpu_s`, `wall_s` and `memory_mb` limits, `parallel` runs at a time (default: one per core). `packages`: top-level
    packages besides the standard library that programs may import (read-only). `allow_weak_sandbox`: run even where
    the sandbox has no namespaces (see `check_sandbox`).

    Inline on purpose: the isolation is the sandbox process, and the call is bounded by its limits
    (ceil(tests / parallel) × wall_s), so a pool worker would only add a second process per run. A row without
    usable tests scores NaN for that sample, which the scorer counts as an error."""
    check_sandbox(packages, allow_weak_sandbox)
    limits = SandboxLimits(cpu_s=cpu_s, wall_s=wall_s, memory_mb=memory_mb)
    scores: list[float] = [float("nan")] * len(completions)
    runs: list[tuple[int, str, CodeTest]] = []
    counts = [0] * len(completions)
    for i, (completion, row) in enumerate(zip(completions, rows)):
        try:
            tests = tests_of(row)
        except ValueError:
            continue
        solution = extract_code(completion)
        runs.extend((i, solution, t) for t in tests)
        counts[i] = len(tests)
    passed = [0] * len(completions)
    with ThreadPoolExecutor(max_workers=parallel or os.cpu_count() or 1) as ex:
        for (i, _, _), ok in zip(runs, ex.map(lambda r: run_test(r[1], r[2], limits, packages), runs)):
            passed[i] += int(ok)
    for i, n in enumerate(counts):
        if n:
            scores[i] = passed[i] / n
    return scores


code.preflight = preflight
