"""Composition and plugins: weighted sums, per-function metrics, import-path plugins, inline fallbacks."""
from __future__ import annotations

import pytest

from tandem.rewards import REWARDS, RewardScorer, resolve_reward


def test_builtins_are_registered():
    assert {"gsm8k", "math", "format", "tag_count", "code", "length_penalty", "repetition_penalty"} <= set(REWARDS)


def test_unknown_name_suggests_the_nearest():
    with pytest.raises(KeyError, match="did you mean 'gsm8k'"):
        resolve_reward("gsm8")


def test_weighted_sum_and_per_function_metrics():
    rows = [{"answer": "#### 4"}, {"answer": "#### 5"}]
    comps = ["<think>2+2</think><answer>4</answer>", "the answer is 6"]
    with RewardScorer([("gsm8k", 1.0, {}), ("format", 0.5, {}), ("tag_count", 0.1, {})], workers=0) as s:
        res = s.score(comps, ["", ""], rows)
    assert res.per_fn == {"gsm8k": [1.0, 0.0], "format": [1.0, 0.0], "tag_count": [1.0, 0.0]}
    assert res.total == pytest.approx([1.6, 0.0])
    assert res.error_counts("reward/errors") == {"reward/errors/gsm8k": 0, "reward/errors/format": 0,
                                                 "reward/errors/tag_count": 0}


def test_same_function_twice_gets_two_metrics():
    with RewardScorer([("format", 1.0, {}), ("format", 1.0, {"pattern": "x+"})], workers=0) as s:
        res = s.score(["xx"], [""], [{}])
    assert res.per_fn == {"format": [0.0], "format_2": [1.0]}


def test_plugin_receives_completion_prompt_row_and_kwargs():
    with RewardScorer([("bad_rewards:with_row", 1.0, {"bonus": 0.25})], workers=1, timeout_s=5) as s:
        res = s.score(["x", "y", "x"], ["Q1", "Q2", "not q"], [{"target": "x"}] * 3)
    assert res.per_fn["bad_rewards:with_row"] == [1.25, 0.25, 0.25]


def test_batched_plugin_and_math_in_the_pool():
    rows = [{"answer": "\\frac{1}{2}"}, {"answer": "3"}]
    with RewardScorer([("bad_rewards:batch_lengths", 1.0, {}), ("math", 1.0, {})], workers=2, timeout_s=10) as s:
        res = s.score(["\\boxed{0.5}", "\\boxed{30}"], ["", ""], rows)
    assert res.per_fn["bad_rewards:batch_lengths"] == [11.0, 10.0]
    assert res.per_fn["math"] == [1.0, 0.0] and res.errors["math"] == 0


def test_functions_a_worker_cannot_import_run_inline(monkeypatch):
    from tandem.rewards import RewardFn

    monkeypatch.setitem(REWARDS._entries, "test_lambda", RewardFn("test_lambda", lambda c, p, r: 1.0))
    with RewardScorer([("test_lambda", 1.0, {})], workers=1) as s:
        assert s._pool is None
        assert s.score(["a"], [""], [{}]).per_fn["test_lambda"] == [1.0]


def test_code_reward_counts_rows_without_tests_as_errors():
    with RewardScorer([("code", 1.0, {"cpu_s": 1, "wall_s": 2.0})], workers=0) as s:
        res = s.score(["print(input())", "print(1)"], ["", ""], [{"tests": [{"stdin": "7", "stdout": "7"}]}, {}])
    assert res.per_fn["code"] == [1.0, 0.0]
    assert res.error_kinds["code"] == {"bad_value": 1}


def test_spec_objects_from_config_are_accepted():
    class Spec:  # the shape of tandem.config.RewardSpec
        name, weight, kwargs = "tag_count", 2.0, {}

    with RewardScorer([Spec()], workers=0) as s:
        assert s.score(["<think></think>"], [""], [{}]).total == [1.0]


def test_scoring_from_a_non_main_thread_keeps_math_verify_time_limits_working():
    # math-verify's own limit is signal.alarm, which fails off the main thread; the pool's limit does not care.
    import threading

    out = {}
    with RewardScorer([("math", 1.0, {})], workers=1, timeout_s=10) as s:
        t = threading.Thread(target=lambda: out.update(r=s.score(["\\boxed{2/4}"], [""], [{"answer": "1/2"}])))
        t.start()
        t.join(60)
    assert out["r"].per_fn["math"] == [1.0] and out["r"].errors["math"] == 0


def test_importing_rewards_stays_light():
    import subprocess
    import sys

    code = ("import sys, tandem.rewards; heavy = [m for m in ('torch', 'math_verify', 'sympy') if m in sys.modules];"
            " print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
