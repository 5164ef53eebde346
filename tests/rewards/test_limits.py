"""Limits that bound a step: the per-step reward budget, the error-rate stop, reward processes killed with their
worker, sys.exit() in a reward, plugins found from the current directory, and reward errors counted in evaluation."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tandem.data.sources import Prompt
from tandem.run.evaluation import evaluate
from tandem.rewards import RewardScorer, resolve_reward
from tandem.rewards.base import ErrorRateLimit, RewardErrorRateExceeded, RewardSetupError
from tandem.rollout.base import Completion, Samples, Sampling


def run(scorer: RewardScorer, completions: list[str]):
    n = len(completions)
    t = time.monotonic()
    res = scorer.score(completions, ["Q"] * n, [{"target": "x"}] * n)
    return res, time.monotonic() - t


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # killed but not reaped yet (a zombie, waiting for whoever adopted it) is dead
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def wait_dead(pids: list[int], seconds: float = 3.0) -> list[int]:
    """The pids still alive after `seconds` (killed here, so a failing test leaves nothing behind)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end and any(alive(p) for p in pids):
        time.sleep(0.05)
    left = [p for p in pids if alive(p)]
    for p in left:
        os.kill(p, 9)
    return left


# --- the per-step budget


def test_a_step_budget_bounds_a_reward_that_hangs_on_every_sample():
    with RewardScorer([("bad_rewards:sleeps", 1.0, {}), ("tag_count", 1.0, {})], timeout_s=5.0, workers=2,
                      step_budget_s=1.5) as s:
        run(s, ["warm"])  # workers up
        res, took = run(s, ["a", "hang"] * 4)
        assert took < 3.5  # without the budget: 4 hangs x 5 s / 2 workers = 10 s
        assert sum(res.per_fn["bad_rewards:sleeps"]) == 2.0  # what finished before the budget ran out is kept
        assert res.error_kinds["bad_rewards:sleeps"] == {"budget": 6}
        assert res.per_fn["tag_count"] == [0.0] * 8 and res.errors["tag_count"] == 0  # inline ran first, in full
        assert 1.0 <= res.budget_used < 1.5
        res, _ = run(s, ["a", "b"])  # fresh workers serve the next step
        assert res.per_fn["bad_rewards:sleeps"] == [1.0, 1.0] and res.errors["bad_rewards:sleeps"] == 0
        assert res.budget_used < 0.5


def test_the_budget_stops_calling_an_inline_reward_once_it_has_run_out():
    with RewardScorer([("bad_rewards:slow_inline", 1.0, {})], workers=0, step_budget_s=1.0) as s:
        res, took = run(s, ["a"] * 10)  # 0.3 s each: 3 s without the budget
    assert took < 1.7
    done = int(sum(res.per_fn["bad_rewards:slow_inline"]))
    assert 2 <= done <= 4 and res.error_kinds["bad_rewards:slow_inline"] == {"budget": 10 - done}


def test_the_budget_is_a_documented_config_field():
    from tandem.config import ConfigError, load_config

    cfg = load_config(None, ["reward_pool.step_budget_s=30", "reward_pool.max_error_rate=0.25"])
    assert cfg.reward_pool.step_budget_s == 30 and cfg.reward_pool.max_error_rate == 0.25
    with pytest.raises(ConfigError, match="max_error_rate"):
        load_config(None, ["reward_pool.max_error_rate=1.5"])


# --- the error-rate stop


def test_a_reward_failing_on_everything_stops_the_check_a_few_bad_samples_do_not():
    limit = ErrorRateLimit(0.5)
    for _ in range(5):  # a few bad samples a step, for many steps
        m = limit.observe(10, {"good": 0, "flaky": 2}, {"flaky": "raised: ValueError('bad row')"})
    assert m == {"reward/error_rate/good": 0.0, "reward/error_rate/flaky": 0.2}
    limit.observe(10, {"good": 0, "flaky": 10}, {"flaky": "timeout: no result within 10 s"})  # one bad step
    with pytest.raises(RewardErrorRateExceeded) as info:  # a second one: 22 of the last 30 samples
        limit.observe(10, {"good": 0, "flaky": 10}, {"flaky": "timeout: no result within 10 s"})
    msg = str(info.value)
    for part in ("'flaky'", "73%", "reward_pool.max_error_rate=0.5", "timeout: no result within 10 s"):
        assert part in msg, msg
    with pytest.raises(RewardErrorRateExceeded, match="'broken'.*100%"):  # from the first step on
        ErrorRateLimit(0.5).observe(4, {"broken": 4}, {"broken": "raised: ImportError('x')"})
    ErrorRateLimit(1.0).observe(4, {"broken": 4}, {"broken": "raised: ImportError('x')"})  # 1 = never stop


def test_the_error_rate_window_is_the_steps_so_far():
    # What the README and the field's description say: step 1 is judged alone; after one clean step, a step that
    # fails everywhere is 50% of the two (not above 0.5) and passes; a second bad step in a row stops the run.
    with pytest.raises(RewardErrorRateExceeded, match="60% of the last 10 samples \\(1 step\\)"):
        ErrorRateLimit(0.5).observe(10, {"flaky": 6}, {"flaky": "timeout"})
    limit = ErrorRateLimit(0.5)
    limit.observe(10, {"flaky": 0}, {})
    assert limit.observe(10, {"flaky": 10}, {"flaky": "timeout"}) == {"reward/error_rate/flaky": 1.0}
    with pytest.raises(RewardErrorRateExceeded, match="67% of the last 30 samples \\(3 steps\\)"):
        limit.observe(10, {"flaky": 10}, {"flaky": "timeout"})


def test_a_reward_that_fails_everywhere_stops_the_run_by_name_and_evaluation_counts_its_errors(
        tiny_model, tmp_path, capsys):
    from tandem.cli import main

    out = tmp_path / "run"
    config = tmp_path / "run.yaml"
    config.write_text("rewards: [{name: arithmetic_exact}, {name: 'bad_rewards:raises'}]\n")
    code = main(["train", str(config), f"model.path={tiny_model}", f"run.output_dir={out}", "run.steps=2",
                 "run.progress=false", "run.report_to=[]", "run.plots=false", "batch.prompts_per_step=2",
                 "batch.group_size=2", "rollout.max_new_tokens=4", "data.max_prompt_tokens=8",
                 "batch.micro_batch_tokens=64", "data.eval_size=3", "reward_pool.workers=1"])
    err = capsys.readouterr().err
    assert code == 2
    line = next(l for l in err.splitlines() if l.startswith("tandem: error:"))
    for part in ("'bad_rewards:raises'", "100%", "reward_pool.max_error_rate=0.5", "RuntimeError('boom on"):
        assert part in line, line
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0]  # stopped in step 1, before training on zeros
    assert rows[0]["eval/reward_errors/bad_rewards:raises"] == 3
    assert rows[0]["eval/reward_errors/bad_rewards:raises/raised"] == 3
    assert rows[0]["eval/reward_errors/arithmetic_exact"] == 0


# --- evaluation counts reward errors


def test_evaluation_counts_reward_errors_by_function_and_kind():
    prompts = [Prompt([1, 2], {"question": "Q1", "target": "x"}), Prompt([3], {"question": "Q2", "target": "x"})]

    def generate(prompts, sampling):
        return Samples.of_call([Completion(list(p.ids), [7], [-1.0], "x", "stop", i) for i, p in enumerate(prompts)
                                for _ in range(sampling.n)], len(prompts))

    with RewardScorer([("bad_rewards:with_row", 1.0, {}), ("bad_rewards:raises", 1.0, {})], workers=0) as s:
        out = evaluate(generate, prompts, s, "bad_rewards:with_row", Sampling(max_new_tokens=4, seed=0), k=3).figures
    assert out["accuracy"] == 1.0
    assert out["reward_errors/bad_rewards:raises"] == 2 + 6  # greedy and sampled
    assert out["reward_errors/bad_rewards:raises/raised"] == 8
    assert out["reward_errors/bad_rewards:with_row"] == 0


# --- processes a reward starts


def test_close_kills_what_a_reward_started_in_a_new_session():
    s = RewardScorer([("bad_rewards:starts_setsid_sleeper", 1.0, {}), ("bad_rewards:double_forks_a_sleeper", 1.0, {})],
                     timeout_s=10.0, workers=1)
    res, _ = run(s, ["a", "b"])
    assert sum(res.errors.values()) == 0, res.error_kinds
    pids = [int(p) for scores in res.per_fn.values() for p in scores]
    assert all(alive(p) for p in pids)
    s.close()
    assert wait_dead(pids) == []


def test_a_replaced_worker_takes_what_its_reward_started_with_it(tmp_path):
    pidfile = tmp_path / "pid"
    with RewardScorer([("bad_rewards:starts_sleeper_then_hangs", 1.0, {"pidfile": str(pidfile)})], timeout_s=1.0,
                      workers=1) as s:
        res, _ = run(s, ["a"])
        assert res.error_kinds["bad_rewards:starts_sleeper_then_hangs"] == {"timeout": 1}
        assert wait_dead([int(pidfile.read_text())]) == []  # while the scorer (and its new worker) lives on


# --- sys.exit() and KeyboardInterrupt


def test_sys_exit_in_a_reward_is_a_failure_of_its_sample_inline_and_in_the_pool():
    with RewardScorer([("bad_rewards:exits_inline", 1.0, {}), ("bad_rewards:exits", 1.0, {}),
                       ("bad_rewards:good", 1.0, {})], timeout_s=5.0, workers=1) as s:
        res, _ = run(s, ["a", "bb"])
    assert res.error_kinds["bad_rewards:exits_inline"] == {"raised": 2}  # in the trainer's process
    assert res.error_kinds["bad_rewards:exits"] == {"raised": 2}  # in a worker
    assert "SystemExit(3)" in res.last_error["bad_rewards:exits_inline"]
    assert res.total == [1.0, 2.0]
    with RewardScorer([("bad_rewards:exits", 1.0, {})], workers=0) as s:  # everything inline
        assert run(s, ["a"])[0].error_kinds["bad_rewards:exits"] == {"raised": 1}


def test_sys_exit_while_reading_a_score_is_a_bad_value_inline_and_in_the_pool():
    """The same rule when the sys.exit() comes from the returned value's __float__, not the call."""
    names = ["bad_rewards:returns_exiting_number_inline", "bad_rewards:returns_exiting_number",
             "bad_rewards:batch_returns_exiting_numbers"]
    with RewardScorer([(n, 1.0, {}) for n in names] + [("bad_rewards:good", 1.0, {})], timeout_s=5.0,
                      workers=1) as s:
        res, _ = run(s, ["a", "bb"])
    assert all(res.error_kinds[n] == {"bad_value": 2} for n in names), res.error_kinds  # not crashed, not stopped
    assert "SystemExit(4)" in res.last_error["bad_rewards:returns_exiting_number"]
    assert res.total == [1.0, 2.0]


def test_sys_exit_in_a_warmup_or_a_preflight_is_that_reward_failing_not_the_pool_or_the_process():
    with RewardScorer([("bad_rewards:exits_in_warmup", 1.0, {})], timeout_s=5.0, workers=1) as s:
        res, _ = run(s, ["a"])  # a broken warm-up is not fatal: the worker lives and scores
    assert res.total == [1.0] and res.errors == {"bad_rewards:exits_in_warmup": 0}
    with pytest.raises(RewardSetupError, match="'bad_rewards:exits_in_preflight' cannot run"):
        RewardScorer([("bad_rewards:exits_in_preflight", 1.0, {})], workers=0)


def test_a_keyboard_interrupt_in_the_trainer_process_still_stops_the_run():
    with RewardScorer([("bad_rewards:interrupts_inline", 1.0, {})], workers=0) as s:
        with pytest.raises(KeyboardInterrupt):
            run(s, ["a"])


# --- plugins in the current directory


def test_a_plugin_in_the_current_directory_is_found_when_sys_path_does_not_hold_it(tmp_path):
    """The `tandem` console script's sys.path[0] is its bin folder, not the current directory."""
    work, bindir = tmp_path / "work", tmp_path / "bin"
    work.mkdir()
    bindir.mkdir()
    (work / "my_cwd_rewards.py").write_text(textwrap.dedent("""
        def pooled(completion, prompt, row):
            return 2.0

        def inline(completion, prompt, row):
            return 3.0

        inline.inline = True
    """))
    script = bindir / "tandem"
    script.write_text(textwrap.dedent(f"""
        import json, os, sys
        assert sys.path[0] == {str(bindir)!r} and os.getcwd() not in sys.path, sys.path
        from tandem.rewards import RewardScorer
        with RewardScorer([("my_cwd_rewards:pooled", 1.0, {{}}), ("my_cwd_rewards:inline", 1.0, {{}})],
                          workers=1, timeout_s=30) as s:
            assert s._pool is not None
            res = s.score(["a"], [""], [{{}}])
        print(json.dumps([res.per_fn, res.errors]))
    """))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, str(script)], cwd=work, capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    per_fn, errors = json.loads(proc.stdout.strip().splitlines()[-1])
    assert per_fn == {"my_cwd_rewards:pooled": [2.0], "my_cwd_rewards:inline": [3.0]}
    assert errors == {"my_cwd_rewards:pooled": 0, "my_cwd_rewards:inline": 0}


def test_a_plugin_that_cannot_be_imported_is_a_clear_error():
    with pytest.raises(ValueError, match=r"'no_such_module_here:score'.*No module named 'no_such_module_here'"
                                         r".*current directory"):
        resolve_reward("no_such_module_here:score")
    with pytest.raises(ValueError, match=r"'bad_rewards:nothing'.*has no function 'nothing'"):
        resolve_reward("bad_rewards:nothing")
