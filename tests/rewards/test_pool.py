"""The reward pool: a reward that raises, hangs, kills its worker, or returns NaN or a string scores 0, is counted
by kind, and the step completes in bounded time with the other samples scored."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import time

import pytest

from tandem.rewards import RewardScorer

ROWS = [{"target": "x"}] * 6


def run(scorer: RewardScorer, completions: list[str]):
    n = len(completions)
    t = time.monotonic()
    res = scorer.score(completions, ["Q"] * n, [{"target": "x"}] * n)
    return res, time.monotonic() - t


@pytest.fixture(scope="module")
def scorer():
    s = RewardScorer([("bad_rewards:good", 1.0, {}), ("bad_rewards:raises", 1.0, {}),
                      ("bad_rewards:returns_nan", 1.0, {}), ("bad_rewards:returns_string", 1.0, {}),
                      ("bad_rewards:returns_none", 1.0, {}), ("bad_rewards:exits", 1.0, {})],
                     timeout_s=2.0, workers=2)
    yield s
    s.close()


def test_raising_and_garbage_values_score_zero_and_are_counted(scorer, caplog):
    with caplog.at_level(logging.WARNING, logger="tandem.rewards"):
        res, _ = run(scorer, ["a", "bb", "ccc"])
        run(scorer, ["a", "bb", "ccc"])
    assert res.per_fn["bad_rewards:good"] == [1.0, 2.0, 3.0]
    assert res.total == [1.0, 2.0, 3.0]
    for name, kind in [("raises", "raised"), ("returns_nan", "bad_value"), ("returns_string", "bad_value"),
                       ("returns_none", "bad_value"), ("exits", "raised")]:
        key = f"bad_rewards:{name}"
        assert res.per_fn[key] == [0.0, 0.0, 0.0]
        assert res.errors[key] == 3 and res.error_kinds[key] == {kind: 3}
    assert res.errors["bad_rewards:good"] == 0
    m = res.error_counts("reward/errors")
    assert m["reward/errors/bad_rewards:raises"] == 3 and m["reward/errors/bad_rewards:raises/raised"] == 3
    assert m["reward/errors/bad_rewards:good"] == 0 and "reward/errors/bad_rewards:good/raised" not in m
    # logged once per function and kind, with the sample, across two steps
    boom = [r for r in caplog.records if "bad_rewards:raises" in r.getMessage()]
    assert len(boom) == 1 and "boom on a" in boom[0].getMessage() and "'a'" in boom[0].getMessage()


def test_a_reward_that_hangs_is_killed_and_the_rest_is_scored():
    with RewardScorer([("bad_rewards:sleeps", 1.0, {})], timeout_s=1.0, workers=2) as s:
        run(s, ["warm"])  # workers up
        comps = ["a", "b", "hang", "c", "d", "e", "f", "g"]
        res, took = run(s, comps)
        assert took < 4.0
        assert res.per_fn["bad_rewards:sleeps"] == [0.0 if c == "hang" else 1.0 for c in comps]
        assert res.error_kinds["bad_rewards:sleeps"] == {"timeout": 1}
        res, _ = run(s, ["a", "b"])  # the replacement worker serves the next step
        assert res.per_fn["bad_rewards:sleeps"] == [1.0, 1.0] and res.errors["bad_rewards:sleeps"] == 0


def test_a_reward_that_kills_its_worker_scores_zero_and_the_worker_is_replaced():
    with RewardScorer([("bad_rewards:kills_worker", 1.0, {})], timeout_s=5.0, workers=1) as s:
        pids_before = [w.proc.pid for w in s._pool._workers]
        comps = ["a", "die", "b", "exit", "c"]
        res, took = run(s, comps)
        assert took < 10
        assert res.per_fn["bad_rewards:kills_worker"] == [1.0, 0.0, 1.0, 0.0, 1.0]
        assert res.error_kinds["bad_rewards:kills_worker"] == {"crashed": 2}
        assert s._pool.restarts == 2
        assert all(w.proc.poll() is None for w in s._pool._workers)
        assert [w.proc.pid for w in s._pool._workers] != pids_before


def test_a_batched_reward_that_hangs_fails_its_batch_only():
    with RewardScorer([("bad_rewards:batch_hangs", 1.0, {}), ("bad_rewards:batch_lengths", 2.0, {})],
                      timeout_s=1.0, workers=2) as s:
        res, took = run(s, ["ab", "c"])
        assert took < 8
        assert res.per_fn["bad_rewards:batch_hangs"] == [0.0, 0.0]
        assert res.error_kinds["bad_rewards:batch_hangs"] == {"timeout": 2}
        assert res.per_fn["bad_rewards:batch_lengths"] == [2.0, 1.0] and res.total == [4.0, 2.0]


def test_rewards_run_in_other_processes_and_close_stops_them():
    s = RewardScorer([("bad_rewards:pid", 1.0, {})], timeout_s=5.0, workers=2)
    res, _ = run(s, ["a"] * 4)
    workers = [w.proc for w in s._pool._workers]
    assert os.getpid() not in res.per_fn["bad_rewards:pid"]
    assert set(res.per_fn["bad_rewards:pid"]) <= {float(p.pid) for p in workers}
    s.close()
    assert all(p.poll() is not None for p in workers)


def test_workers_exit_when_the_trainer_dies_and_take_what_their_reward_started_with_them(tmp_path):
    here = os.path.dirname(__file__)
    pidfile = tmp_path / "sleeper"
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {here!r})
        from tandem.rewards import RewardScorer
        s = RewardScorer([("bad_rewards:starts_sleeper_then_hangs", 1.0, {{"pidfile": {str(pidfile)!r}}})],
                         timeout_s=100, workers=1)
        print(s._pool._workers[0].proc.pid, flush=True)
        s.score(["hang"], [""], [{{}}])
    """)
    trainer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    worker_pid = int(trainer.stdout.readline())
    for _ in range(100):  # the worker is hung inside the reward once the sleeper's pid is written
        if pidfile.exists() and pidfile.read_text():
            break
        time.sleep(0.1)
    trainer.kill()
    trainer.wait()
    for pid in (worker_pid, int(pidfile.read_text())):
        for _ in range(50):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            if open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z":
                break
            time.sleep(0.1)
        else:
            os.kill(pid, 9)
            pytest.fail(f"process {pid} outlived the trainer")


def test_workers_that_cannot_start_score_pool_errors_without_hanging(monkeypatch):
    monkeypatch.setattr(sys, "executable", "/bin/false")  # every worker dies at birth
    with RewardScorer([("bad_rewards:good", 1.0, {}), ("tag_count", 1.0, {})], workers=2, timeout_s=1) as s:
        res, took = run(s, ["a", "<think></think>"])
    assert took < 5
    assert res.error_kinds["bad_rewards:good"] == {"pool": 2}
    assert res.per_fn["tag_count"] == [0.0, 0.5]  # inline rewards are unaffected
