"""Code reward: run the completion's Python against its row's tests in the sandbox; the score is the fraction passed.

Row schema (either key, or both):

- `row["tests"]`: a list whose items are either `{"stdin": str, "stdout": str}` (the program reads stdin; it passes
  if it exits 0 and its output matches, ignoring trailing whitespace on each line and trailing blank lines) or a
  string of assert-style Python (e.g. `"assert add(2, 3) == 5"`) run after the solution in the same program;
- `row["test_code"]`: one string of assert-style Python, run after the solution as a single test.

An assert-style test passes only if the program reaches a random marker printed after the test code, so a
solution that calls `exit(0)` early, or prints "OK", does not pass.
"""
from __future__ import annotations

import os
import re
import secrets
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Mapping, Sequence

from tandem.rewards.base import register_reward
from tandem.rewards.sandbox import SandboxLimits, run_python

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


def run_test(solution: str, test: CodeTest, limits: SandboxLimits) -> bool:
    """Whether `solution` passes `test` in the sandbox."""
    if test.expected_stdout is not None:
        r = run_python(solution, test.stdin, limits)
        return r.ok and outputs_match(r.stdout, test.expected_stdout)
    marker = f"tandem-pass-{secrets.token_hex(8)}"
    r = run_python(f"{solution}\n\n{test.assert_code}\n\nprint({marker!r})\n", test.stdin, limits)
    lines = r.stdout.rstrip().splitlines()
    return r.ok and bool(lines) and lines[-1].strip() == marker


@register_reward("code", batched=True, inline=True)
def code(completions: Sequence[str], prompts: Sequence[str], rows: Sequence[Mapping], cpu_s: int = 2,
         wall_s: float = 5.0, memory_mb: int = 1024, parallel: int | None = None) -> list[float]:
    """The fraction of each row's tests the completion's code passes, each test a separate sandbox run with
    `cpu_s`, `wall_s` and `memory_mb` limits, `parallel` runs at a time (default: one per core).

    Inline on purpose: the isolation is the sandbox process, and the call is bounded by its limits
    (ceil(tests / parallel) × wall_s), so a pool worker would only add a second process per run. A row without
    usable tests scores NaN for that sample, which the scorer counts as an error."""
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
        for (i, _, _), ok in zip(runs, ex.map(lambda r: run_test(r[1], r[2], limits), runs)):
            passed[i] += int(ok)
    for i, n in enumerate(counts):
        if n:
            scores[i] = passed[i] / n
    return scores
