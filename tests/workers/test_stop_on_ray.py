"""A Ray run told to stop stops well: its actors and Ray's own processes outlive a terminal's SIGINT until the
controller has its checkpoint, the controller keeps SIGTERM from ray.init, and nothing is left running after."""
from __future__ import annotations

import os
import random
import signal
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("ray")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "run"))
from signal_runs import descendants, launch, settings, stopped_well, write_config  # noqa: E402


def _group(pgid: int) -> set[int]:
    """Processes of process group `pgid` (the trainer's: Ray's head processes started from it are in it)."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[2]) == pgid:
                found.add(int(stat.parent.name))
        except (OSError, ValueError):
            pass
    return found


def _signal_if_alive(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:  # a short-lived helper of Ray's, gone meanwhile
        pass


def _actors() -> set[int]:
    pids = set()
    for pid in descendants():
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"ray::WorkerHost"):
                pids.add(pid)
        except OSError:
            pass
    return pids


def test_sigterm_with_sigint_everywhere_else_saves_the_last_step_on_two_colocated_workers(tiny_model, tmp_path):
    """At a random instant, a terminal's SIGINT reaches every process but the controller (Ray's head processes in
    its process group, and the actors, even though they sit in groups of their own), and a scheduler's SIGTERM the
    controller: the run finishes the update in flight on the workers, checkpoints it through them, exits 143 with
    one line, and Ray is gone."""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    run_settings = settings(tiny_model, tmp_path, steps=500, save_every=50, pause_s=0)
    run_settings["placement"] = {"backend": "ray", "workers": 2}
    run_settings["reward_pool"] = {"workers": 0}
    run = launch(write_config(tmp_path / "run.yaml", run_settings), tmp_path / "run")
    target, delay = rng.randint(3, 12), rng.uniform(0, 0.05)
    try:
        run.wait_for_step(target)
        time.sleep(delay)
        actors = _actors()
        assert len(actors) == 2, actors
        pids = descendants()
        for pid in (_group(run.proc.pid) - {run.proc.pid}) | actors:
            _signal_if_alive(pid, signal.SIGINT)
        run.signal(signal.SIGTERM)
        step = stopped_well(run, signal.SIGTERM, pids)
        assert step >= target
    except BaseException:
        print(f"seed {seed}: signalled at step {target} + {delay:.3f} s")
        raise
