"""`tandem train` in a subprocess, signalled as a terminal, a scheduler or the kernel would: the stop tests' helpers."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent

# Python keeps SIGINT ignored when it starts with it ignored (a test run from a background job): put back the
# handler an interactive `tandem` gets, then run the command line as the `tandem` script would.
LAUNCH = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
          "sys.argv = ['tandem', *sys.argv[1:]]; runpy.run_module('tandem.cli', run_name='__main__')")


def settings(model: Path, tmp: Path, steps: int, save_every: int, pause_s: float) -> dict:
    """The tiny run of tests/core/test_trainer.py, with a KL term and mu=2 (reference, optimizer moments and old
    logprobs all carry over a resume) and a pooled reward that pauses once, when the test opens its gate."""
    pausing = {"gate": str(tmp / "gate"), "marker": str(tmp / "paused"), "seconds": pause_s}
    return {
        "model": {"path": str(model)},
        "run": {"steps": steps, "save_every": save_every, "keep_checkpoints": 2, "eval_every": 20, "seed": 3,
                "progress": False, "report_to": [], "plots": False},
        "batch": {"prompts_per_step": 4, "group_size": 4, "micro_batch_tokens": 64},
        "rollout": {"max_new_tokens": 4},
        "data": {"max_prompt_tokens": 8, "eval_size": 8},
        "optim": {"lr": 1e-3},
        "algo": {"kl_coef": 0.05, "mu": 2},
        "rewards": [{"name": "arithmetic_exact"},
                    {"name": "signal_runs:text_length_pausing", "weight": 0.5, "kwargs": pausing}],
        "reward_pool": {"workers": 1, "timeout_s": 2 * pause_s + 10},
    }


def write_config(path: Path, settings: dict) -> Path:
    path.write_text(yaml.safe_dump(settings))
    return path


@dataclass
class Launched:
    proc: subprocess.Popen
    out: Path  # run.output_dir
    log: Path  # stdout and stderr together

    def metrics(self) -> list[dict]:
        path = self.out / "metrics.jsonl"
        if not path.is_file():
            return []
        rows = []
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:  # a line being written right now
                break
        return rows

    def wait_for(self, ready, what: str, timeout: float = 240.0) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if self.proc.poll() is not None:
                raise AssertionError(f"the run ended (rc {self.proc.returncode}) before {what}:\n{self.tail()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no {what} within {timeout} s:\n{self.tail()}")
            time.sleep(0.005)

    def wait_for_step(self, step: int) -> None:
        self.wait_for(lambda: (rows := self.metrics()) and rows[-1]["step"] >= step, f"step {step}")

    def signal(self, signum: int, group: bool = False) -> None:
        """To the trainer alone (a scheduler's SIGTERM), or to its whole process group (a terminal's Ctrl-C)."""
        (os.killpg if group else os.kill)(self.proc.pid, signum)

    def finish(self, timeout: float = 120.0) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"still running {timeout} s later:\n{self.tail()}") from None

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def last_line(self) -> str:
        return self.log.read_text(errors="replace").splitlines()[-1]


def launch(config: Path, out: Path, *flags: str) -> Launched:
    """`tandem train CONFIG run.output_dir=OUT FLAGS...` in a session of its own (its process group is its own)."""
    _BEFORE_LAUNCH.clear()
    _BEFORE_LAUNCH.update(_children_now())
    log = out.with_name(out.name + f"-{time.monotonic_ns()}.log")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    with log.open("w") as f:
        proc = subprocess.Popen([sys.executable, "-c", LAUNCH, "train", str(config), f"run.output_dir={out}", *flags],
                                stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)
    return Launched(proc, out, log)


def _children_now() -> set[int]:
    sys.path.insert(0, str(HERE.parent / "workers"))
    try:
        from procs import descendants as found
    finally:
        sys.path.remove(str(HERE.parent / "workers"))
    return {pid for pid, _ in found()}


_BEFORE_LAUNCH: set[int] = set()  # the test process's descendants just before the latest launch


def descendants() -> set[int]:
    """This test process's live descendants started since the latest launch (the trainer, its reward workers, Ray's
    processes and actors), not helpers it had before (multiprocessing's resource tracker, started by an earlier
    test in the same pytest process)."""
    return _children_now() - _BEFORE_LAUNCH


def still_alive(pids: set[int], grace: float = 10.0) -> list[str]:
    """Which of `pids` are still running `grace` seconds on (zombies excepted), with their command lines."""
    deadline = time.monotonic() + grace
    while True:
        alive = []
        for pid in pids:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if state != "Z":
                alive.append(f"{pid} {cmd[:160]}")
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


STOP_LINE = re.compile(r"^tandem: stopped by (SIG\w+) after step (\d+); checkpoint (\S+); resume with: tandem train .* "
                       r"--resume$")


def stopped_well(run: Launched, signum: int, pids: set[int]) -> int:
    """The run exited 128 + signum with one line naming the signal, the last completed step and its checkpoint,
    every step up to it logged, and none of its processes left; returns that step."""
    rc = run.finish()
    assert rc == 128 + signum, run.tail()
    log = run.log.read_text()
    assert "Traceback" not in log, run.tail()
    line = STOP_LINE.match(run.last_line())
    assert line, run.tail()
    name, step, path = line.group(1), int(line.group(2)), Path(line.group(3))
    assert name == signal.Signals(signum).name
    assert path == run.out / "checkpoints" / f"step-{step:08d}" and checkpoint_steps(run.out)[-1] == step
    assert json.loads((path / "trainer_state.json").read_text())["step"] == step
    rows = run.metrics()
    assert [r["step"] for r in rows] == list(range(step + 1))
    assert not still_alive(pids), still_alive(pids)
    return step


def resumable_from(run: Launched) -> int:
    """The first step a resumed run can be waited for after `run` was killed: past its last checkpoint by two, and
    past every step it logged, since rows after the checkpoint stay in metrics.jsonl until the resumed run drops
    them (a wait for one of those would end before the resumed run has started)."""
    logged = run.metrics()[-1]["step"] if run.metrics() else 0
    return max(checkpoint_steps(run.out)[-1] + 2, logged + 1)


def checkpoint_steps(out: Path) -> list[int]:
    from tandem.run import checkpoint

    return [step for step, _ in checkpoint.checkpoints(out / "checkpoints")]


def text_length_pausing(completion: str, prompt: str, row, *, gate: str, marker: str, seconds: float, **_) -> float:
    """toy_rewards.text_length, except that the first call after `gate` appears creates `marker` and sleeps
    `seconds` first: a test knows the trainer is scoring, for as long as it needs, without changing any score."""
    if os.path.exists(gate):
        try:
            open(marker, "x").close()
        except FileExistsError:
            pass
        else:
            time.sleep(seconds)
    return float(len(completion))
