"""run.report_to: each tracker's own store, read back through its library, holds metrics.jsonl's history at every
step (each value once, after a resume that redoes steps too), the config, the curves and the final evaluation; a
resume continues the same tracker run where the tracker can take back what it was given; a tracker not installed is
refused before any model loads; one that fails, or does not answer within run.tracker_timeout_s (its start or any
call after), warns once and the run goes on; a SIGTERM while a tracker starts stops the run at once."""
from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

from tandem.config import trackers as tracker_libraries
from tandem.run import checkpoint, trackers

STORES = Path(__file__).with_name("tracker_stores.py")
ALL = ["tensorboard", "wandb", "mlflow", "trackio", "swanlab"]
all_installed = pytest.mark.skipif(tracker_libraries.missing(ALL) != [], reason=f"not installed: "
                                   f"{tracker_libraries.missing(ALL)} "
                                   "(MLflow's SQLite store needs sqlalchemy and alembic too): pip install "
                                   "'tandem[trackers]'")
with_mlflow = pytest.mark.skipif(importlib.util.find_spec("mlflow") is None, reason="mlflow not installed")
BOUND = 2.0  # run.tracker_timeout_s in the tests that wait on it
MARGIN = 0.75  # what a start may take beyond the bound: the wait looks every 50 ms, on a loaded 2-core machine


def _train(config: Path, model: Path, out: Path, *extra: str) -> None:
    overrides = [f"model.path={model}", f"run.output_dir={out}", "run.progress=false", "run.steps=2",
                 "run.save_every=2", "run.eval_every=1", "batch.prompts_per_step=4", "batch.group_size=4",
                 "rollout.max_new_tokens=4", "data.max_prompt_tokens=8", "data.eval_size=4", "eval.k=2",
                 "eval.temperature=1.0", "reward_pool.workers=0", f"run.report_to=[{','.join(ALL)}]",
                 "run.name=tracked", "run.project=tandem-tests"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "MLFLOW_", "TRACKIO_", "SWANLAB_"))}
    done = subprocess.run([sys.executable, "-m", "tandem.cli", "train", str(config), *overrides, *extra], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "run.report_to" not in done.stderr, done.stderr[-3000:]  # no tracker warned


def _config_file(tmp_path: Path) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text("rewards:\n  - {name: arithmetic_exact}\n")
    return path


def _ids(out: Path) -> dict[str, str | None]:
    return json.loads((out / "trackers.json").read_text())["ids"]


def _rows(points: list) -> tuple[dict[int, dict[str, float]], list]:
    """A store's values as rows by step, and the (step, metric) it holds more than once (it would plot both)."""
    rows: dict[int, dict[str, float]] = {}
    twice = []
    for step, key, value in points:
        if key in rows.setdefault(step, {}):
            twice.append((step, key))
        rows[step][key] = value
    return rows, twice


@all_installed
def test_every_tracker_holds_metrics_jsonl_after_a_resume_and_after_one_that_redoes_steps(tiny_model, tmp_path):
    """A run of 2 steps; a resume to step 4 from the checkpoint at step 2 (the same tracker runs go on); then the
    checkpoint of step 4 is deleted, as if the run had been killed after logging step 4 and before saving it, and a
    resume from step 2 redoes steps 3 and 4. Each tracker's current run then holds metrics.jsonl's rows, each value
    once: TensorBoard drops the earlier values (its purge marker), MLflow's SQLite store and Trackio's delete them,
    and wandb, whose steps only go forward, logs to a new run given the history first."""
    out, config = tmp_path / "run", _config_file(tmp_path)
    _train(config, tiny_model, out)
    ids = _ids(out)
    _train(config, tiny_model, out, "--resume", "run.steps=4")  # a flag among the overrides, as people type it
    resumed = _ids(out)
    # the same tracker runs, continued; SwanLab resumes only online runs, so offline it starts a second one
    assert {k: v for k, v in resumed.items() if k != "swanlab"} == {k: v for k, v in ids.items() if k != "swanlab"}
    assert resumed["swanlab"] != ids["swanlab"]
    shutil.rmtree(checkpoint.checkpoints(out / "checkpoints")[-1][1])
    _train(config, tiny_model, out, "--resume", "run.steps=4")
    redone = _ids(out)
    assert {k: redone[k] for k in ("tensorboard", "mlflow", "trackio")} == {k: ids[k] for k in
                                                                            ("tensorboard", "mlflow", "trackio")}
    assert redone["wandb"] != ids["wandb"] and redone["swanlab"] not in (ids["swanlab"], resumed["swanlab"])
    # MLflow's local store is a SQLite database in the run directory (its file store is in maintenance mode)
    assert (out / "mlflow" / "mlflow.db").read_bytes()[:16] == b"SQLite format 3\0" and not (out / "mlruns").exists()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    read = subprocess.run([sys.executable, str(STORES), str(out), "tandem-tests"], capture_output=True, text=True,
                          timeout=300)
    assert read.returncode == 0, read.stderr[-3000:]
    stores = json.loads(read.stdout)
    # each run ends with its final evaluation, logged again under final/ at its last step: the first at step 2, the
    # last (which redid 3 and 4) at step 4; a tracker run opened by that last resume holds only its own
    final = {r["step"]: {f"final/{k}": v for k, v in r.items() if k.startswith("eval/")} for r in rows[2::2]}
    assert final[4] and json.loads((out / "eval_results.json").read_text())["results"] == {
        k.removeprefix("final/eval/"): v for k, v in final[4].items()}
    images = {"tensorboard": 2, "mlflow": 1, "trackio": 2, "wandb": 1}  # MLflow's: one file, replaced
    for name, runs in stores.items():
        store = runs[redone[name]]
        steps, twice = _rows(store["points"])
        assert twice == [], (name, twice)
        for row in rows:
            want = {k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float))}
            if name != "wandb" or row["step"] == 4:
                want.update(final.get(row["step"], {}))
            if name == "mlflow":
                want = {trackers.mlflow_key(k): v for k, v in want.items()}
            got = steps.get(row["step"], {})
            assert got.keys() == want.keys(), (name, row["step"], sorted(set(got) ^ set(want)))
            # TensorBoard stores float32; the others the value itself
            tol = 1e-6 if name == "tensorboard" else 0.0
            bad = [k for k, v in want.items() if not math.isclose(got[k], v, rel_tol=tol, abs_tol=tol)]
            assert bad == [], (name, row["step"], [(k, got[k], want[k]) for k in bad])
        assert set(steps) == {0, 1, 2, 3, 4}, (name, sorted(steps))
        assert store["images"] == images[name], (name, store["images"])
        if name != "tensorboard":  # its config is a text panel
            assert store["params"]["run.name"] == "tracked", (name, store["params"])
    assert list(stores["wandb"]) == [ids["wandb"], redone["wandb"]]  # the first run keeps what it was given
    assert list(stores["mlflow"]) == [ids["mlflow"]] and list(stores["trackio"]) == [ids["trackio"]]
    assert len(list((out / "swanlog").glob("run-*"))) == 3  # SwanLab resumes only online runs: a new one each time


def test_a_tracker_not_installed_is_refused_before_any_model_loads(tiny_model, tmp_path, monkeypatch, capsys):
    import tandem.trainer  # noqa: F401  imported before the patch: a module importing it then keeps the real one
    from tandem import modeling
    from tandem.cli import main

    monkeypatch.setitem(tracker_libraries.TRACKERS, "wandb", ("a_module_that_is_not_installed", "wandb"))
    monkeypatch.setattr(modeling, "load_causal_lm", lambda *a, **k: pytest.fail("a model loaded"))
    code = main(["train", str(_config_file(tmp_path)), f"model.path={tiny_model}", "run.report_to=[wandb]",
                 f"run.output_dir={tmp_path / 'run'}"])
    assert code == 2
    assert "run.report_to: Value error, ['wandb'] named but not installed: pip install 'tandem[wandb]'" in \
        capsys.readouterr().err
    assert not (tmp_path / "run").exists()


class _Flaky(trackers.Tracker):
    name = "flaky"

    def __init__(self):
        self.logged: list[int] = []

    def start(self, run, resume_id):
        if threading.current_thread() is threading.main_thread():  # as SwanLab does: a handler of its own
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        return "flaky-1"

    def log(self, step, metrics):
        if step == 2:
            raise ConnectionError("the server went away")
        self.logged.append(step)

    def image(self, step, key, path):
        raise AssertionError("called after the failure")


class _Broken(trackers.Tracker):
    name = "broken"

    def start(self, run, resume_id):
        raise RuntimeError("no credentials")


def _warnings(caplog) -> list[str]:
    """tandem's tracker warnings alone (a library's own, from a thread left behind, may land here too)."""
    return [r.getMessage() for r in caplog.records if r.name == "tandem.run.trackers" and r.levelno >= logging.WARNING]


def test_a_failing_tracker_warns_once_and_the_run_goes_on(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(trackers.KINDS, "flaky", _Flaky)
    monkeypatch.setitem(trackers.KINDS, "broken", _Broken)
    before = signal.getsignal(signal.SIGINT)
    with caplog.at_level(logging.WARNING, logger="tandem.run.trackers"):
        t = trackers.Trackers(["broken", "flaky"], trackers.RunInfo("r", "p", tmp_path, {}))
        assert signal.getsignal(signal.SIGINT) is before  # started off the main thread: tandem's handler kept
        flaky = t.open[0].tracker
        for step in range(5):
            t.log(step, {"loss": 1.0, "note": "text is not a figure"})
        t.image(4, "curves", tmp_path / "curves.png")
        t.close()
    assert flaky.logged == [0, 1]
    warnings = _warnings(caplog)
    assert len(warnings) == 2, warnings
    assert f"broken at {tmp_path} could not start (RuntimeError: no credentials)" in warnings[0]
    assert f"flaky at {tmp_path} failed (log: ConnectionError: the server went away)" in warnings[1]
    assert json.loads((tmp_path / "trackers.json").read_text()) == {"ids": {"flaky": "flaky-1"}, "last_step": 4}


@contextmanager
def _server(kind: str) -> Iterator[tuple[str, threading.Event]]:
    """A loopback URL whose server accepts connections and never answers (`silent`: the event is set at the first),
    or where nothing listens (`refusing`)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    accepted, held = threading.Event(), []
    if kind == "refusing":
        listener.close()
        yield url, accepted
        return
    listener.listen(64)

    def accept() -> None:
        while True:
            try:
                held.append(listener.accept()[0])  # kept open, never read, never answered
            except OSError:
                return
            accepted.set()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield url, accepted
    finally:
        listener.close()
        for conn in held:
            conn.close()


@with_mlflow
@pytest.mark.parametrize("kind", ["silent", "refusing"])
def test_a_tracker_server_that_never_answers_or_refuses_costs_the_bound_once(kind, tmp_path, monkeypatch, caplog):
    """MLflow at a loopback server that accepts and never answers (a run was held over 9 minutes), or at a port that
    refuses (254 s of MLflow's retries): the start returns within run.tracker_timeout_s plus a small margin, with one
    warning naming the tracker, the URL and the bound, and the run goes on with its other trackers."""
    import mlflow.tracking  # noqa: F401  imported before the clock starts: the bound is the server's, not an import's
    import torch.utils.tensorboard  # noqa: F401
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # MLflow's own limits, short enough that the call left behind ends soon after the test (still far past BOUND)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    with _server(kind) as (url, _), caplog.at_level(logging.WARNING, logger="tandem.run.trackers"):
        monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
        began = time.monotonic()
        t = trackers.Trackers(["mlflow", "tensorboard"], trackers.RunInfo("r", "p", tmp_path, {}), timeout_s=BOUND)
        took = time.monotonic() - began
        for step in range(3):
            t.log(step, {"loss": float(step)})
        began = time.monotonic()
        t.close()
        closed = time.monotonic() - began
    print(f"{kind}: the trackers' start took {took:.2f} s with a bound of {BOUND} s; close {closed:.2f} s")
    assert BOUND <= took < BOUND + MARGIN, took
    assert closed < MARGIN, closed
    assert _warnings(caplog) == [f"run.report_to: mlflow at {url} did not start within {BOUND:g} s "
                                 "(run.tracker_timeout_s); the run goes on without it (metrics.jsonl holds every "
                                 "metric)"]
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("loss")] == [0, 1, 2]  # the run went on with the tracker that answers
    assert _ids_of(tmp_path) == {"tensorboard": "tensorboard"}


def _ids_of(folder: Path) -> dict:
    return json.loads((folder / "trackers.json").read_text())["ids"]


# wandb online at a server that never answers, in a process of its own (its exit is part of what is measured):
# argv = run directory, bound. Prints the start's seconds, then the wall-clock time it closed the trackers.
WANDB_ONLINE = """
import sys, time
from pathlib import Path
import wandb  # before the clock starts: the bound is the server's, not an import's
from tandem.run import trackers
began = time.monotonic()
t = trackers.Trackers(["wandb"], trackers.RunInfo("r", "p", Path(sys.argv[1]), {}), timeout_s=float(sys.argv[2]))
print(f"started in {time.monotonic() - began:.3f} s, {len(t.open)} open", flush=True)
t.close()
print(f"closed at {time.time():.3f}", flush=True)
"""


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb not installed")
def test_wandb_online_at_a_server_that_never_answers_costs_the_bound_and_not_the_exit(tmp_path):
    """wandb online to a server that never answers: the start returns within the bound, and the process then exits
    at once (wandb's own wait, its init_timeout of 90 s, held the exit after tandem had left the start behind: it
    now follows run.tracker_timeout_s). Unreachable, it cost ~100 s, and SIGTERM ~90 s."""
    with _server("silent") as (url, accepted):
        env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
        env.update(WANDB_MODE="online", WANDB_BASE_URL=url, WANDB_API_KEY="0" * 40)
        done = subprocess.run([sys.executable, "-c", WANDB_ONLINE, str(tmp_path), str(BOUND)], env=env,
                              capture_output=True, text=True, timeout=300)
        ended = time.time()
    assert done.returncode == 0, done.stderr[-3000:]
    started = float(done.stdout.split("started in ")[1].split(" s")[0])
    exiting = ended - float(done.stdout.split("closed at ")[1].split()[0])
    print(f"wandb online, a server that never answers: start {started:.2f} s (bound {BOUND} s), exit {exiting:.2f} s")
    assert accepted.is_set() and ", 0 open" in done.stdout, done.stdout
    assert BOUND <= started < BOUND + MARGIN, started
    assert exiting < 20, (exiting, done.stderr[-3000:])
    assert "wandb at " + url + f" did not start within {BOUND:g} s" in done.stderr, done.stderr[-3000:]


class _Hanging(trackers.Tracker):
    """Starts, then hangs in its second log call until the test lets it go."""

    name = "hanging"
    release = threading.Event()

    def __init__(self):
        self.logged: list[int] = []

    def start(self, run, resume_id):
        return "hanging-1"

    def log(self, step, metrics):
        if step == 1:
            self.release.wait(60)
        self.logged.append(step)

    def close(self):
        raise AssertionError("closed after it was left behind")


def test_a_tracker_call_that_hangs_is_left_behind_within_the_bound(tmp_path, monkeypatch, caplog):
    """A log call that never returns does not hold the run, nor its end: at the next call past the bound the
    tracker is turned off with one warning, and closing the trackers does not wait for it."""
    monkeypatch.setitem(trackers.KINDS, "hanging", _Hanging)
    bound = 0.5
    try:
        with caplog.at_level(logging.WARNING, logger="tandem.run.trackers"):
            t = trackers.Trackers(["hanging"], trackers.RunInfo("r", "p", tmp_path, {}), timeout_s=bound)
            hanging = t.open[0].tracker
            t.log(0, {"loss": 0.0})
            t.log(1, {"loss": 1.0})  # hangs on the tracker's thread, not here
            time.sleep(bound + 0.3)
            for step in range(2, 5):
                t.log(step, {"loss": float(step)})
            began = time.monotonic()
            t.close()
            assert time.monotonic() - began < 0.5
    finally:
        _Hanging.release.set()
    assert hanging.logged == [0]
    assert _warnings(caplog) == [f"run.report_to: hanging at {tmp_path} did not return from log within {bound:g} s "
                                 "(run.tracker_timeout_s); the run goes on without it (metrics.jsonl holds every "
                                 "metric)"]


@with_mlflow
def test_sigterm_while_a_tracker_starts_stops_the_run_at_once(tiny_model, tmp_path):
    """A SIGTERM while MLflow waits on a server that never answers (the bound set far away, 300 s) stops the run
    as promptly as elsewhere: exit 143 within seconds, with its one line, nothing saved (no step ran)."""
    out = tmp_path / "run"
    with _server("silent") as (url, accepted):
        env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
        env["MLFLOW_TRACKING_URI"] = url
        proc = subprocess.Popen(
            [sys.executable, "-m", "tandem.cli", "train", str(_config_file(tmp_path)), f"model.path={tiny_model}",
             f"run.output_dir={out}", "run.progress=false", "run.steps=2", "reward_pool.workers=0",
             "run.report_to=[mlflow]", "run.tracker_timeout_s=300", "batch.prompts_per_step=4", "batch.group_size=4",
             "rollout.max_new_tokens=4", "data.max_prompt_tokens=8", "data.eval_size=4"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert accepted.wait(120), "MLflow never reached the server"
            time.sleep(0.5)  # well inside the start: MLflow waits on its first answer
            os.kill(proc.pid, signal.SIGTERM)
            began = time.monotonic()
            _, err = proc.communicate(timeout=60)
            took = time.monotonic() - began
        finally:
            proc.kill()
    print(f"SIGTERM during the tracker's start: exited {proc.returncode} after {took:.2f} s")
    assert proc.returncode == 143, err[-3000:]
    assert took < 10, (took, err[-3000:])
    assert "no checkpoint" in err and "Traceback" not in err, err[-3000:]
    assert not (out / "checkpoints").exists() or not list((out / "checkpoints").iterdir())
