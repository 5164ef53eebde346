"""Experiment trackers (`run.report_to`): TensorBoard, Weights & Biases, MLflow, Trackio, SwanLab, each through its
own library, local by default, each on a thread of its own with a time bound on every call, its start included; one
that fails or hangs warns once and the run goes on without it."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import queue
import re
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Callable

from tandem.config.trackers import sql_store

log = logging.getLogger("tandem.run.trackers")

IDS_FILE = "trackers.json"  # each tracker's run id, so that a resumed run continues the same tracker run
FINAL = "final/"  # the final evaluation's figures, logged under this prefix at the last step
POLL_S = 0.05  # how often a wait on a tracker's thread looks at the clock and at the run's stop signals


def numeric(metrics: dict[str, Any]) -> dict[str, float]:
    """The figures a tracker can plot: numbers only (metrics.jsonl also keeps non-finite values as strings)."""
    return {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


@dataclasses.dataclass
class RunInfo:
    """What every tracker is given about the run: its name, project, folder and resolved config; for a resumed run,
    the checkpoint's step and the rows of metrics.jsonl it keeps."""

    name: str
    project: str
    output_dir: Path
    config: dict[str, Any]
    resume_step: int | None = None  # None: a new run; else the checkpoint's step (later rows are logged again)
    history: list[dict] = dataclasses.field(default_factory=list)  # metrics.jsonl's rows up to resume_step
    redone: bool = False  # the trackers were given steps after resume_step, which this run redoes
    # run.tracker_timeout_s, which a library's own limit follows where it has one: wandb's init_timeout, whose wait
    # (90 s by default) would otherwise hold the process at its exit after tandem has left the start behind
    timeout_s: float = 60.0

    @property
    def params(self) -> dict[str, Any]:
        """The config flat, as trackers take parameters: `algo.kl_coef`, ..."""
        return flatten(self.config)


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


class Tracker:
    """One tracker's run. `start` opens it (a resumed run passes the id `start` returned before, and a tracker that
    `resumes` drops what it was given after `run.resume_step`, so that its history is metrics.jsonl's); then `log`
    every metric at its step, `image` a picture, `final` the last evaluation, `close` once. Every call but `where`
    and `resumes` runs on the tracker's own thread."""

    name = ""

    def where(self, run: RunInfo) -> str:
        """Where it logs (a folder, or a server's URL), for messages; from the environment alone, without waiting."""
        return str(run.output_dir)

    def resumes(self, run: RunInfo) -> str | None:
        """None where a start with the earlier run's id continues that run as metrics.jsonl continues (the values
        of the steps this resume redoes taken back); otherwise why not: the resume then opens a new tracker run and
        gives it metrics.jsonl's history first."""
        return None

    def start(self, run: RunInfo, resume_id: str | None) -> str | None:
        raise NotImplementedError

    def log(self, step: int, metrics: dict[str, float]) -> None:
        raise NotImplementedError

    def image(self, step: int, key: str, path: Path) -> None:
        raise NotImplementedError

    def final(self, step: int, metrics: dict[str, float]) -> None:
        self.log(step, {FINAL + k: v for k, v in metrics.items()})

    def close(self) -> None:
        pass


class TensorBoard(Tracker):
    """Event files in `<output_dir>/tensorboard`. A resume writes TensorBoard's purge marker at the first redone
    step (`purge_step`): its readers then drop the earlier values of that step and the ones after it."""

    name = "tensorboard"

    def where(self, run: RunInfo) -> str:
        return str(run.output_dir / "tensorboard")

    def start(self, run: RunInfo, resume_id: str | None) -> str | None:
        from torch.utils.tensorboard import SummaryWriter

        purge = None if run.resume_step is None else run.resume_step + 1
        self.writer = SummaryWriter(str(run.output_dir / "tensorboard"), purge_step=purge)
        self.writer.add_text("config", "```\n" + json.dumps(run.config, indent=2) + "\n```")
        return "tensorboard"  # the folder: a resume appends to it

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, step)

    def image(self, step: int, key: str, path: Path) -> None:
        import matplotlib.image

        self.writer.add_image(key, matplotlib.image.imread(str(path))[..., :3], step, dataformats="HWC")

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()


class _RunObject(Tracker):
    """A library whose `init` returns a run object with `log(metrics, step=)` and `finish()`, and whose module has an
    `Image` type (wandb, Trackio, SwanLab)."""

    module = ""

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def image(self, step: int, key: str, path: Path) -> None:
        self.run.log({key: importlib.import_module(self.module).Image(str(path))}, step=step)

    def close(self) -> None:
        self.run.finish()


class WandB(_RunObject):
    """Offline in `<output_dir>/wandb` unless `WANDB_MODE` says otherwise (`wandb sync` uploads it later). A wandb
    run's steps only go forward (its server drops a step below the last one; rewinding a run is a private preview),
    so a resume that redoes steps opens a new wandb run."""

    name = module = "wandb"

    def where(self, run: RunInfo) -> str:
        if _mode("WANDB_MODE", "offline") in ("offline", "dryrun", "disabled"):
            return str(run.output_dir / "wandb")
        return os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai"

    def resumes(self, run: RunInfo) -> str | None:
        if run.redone:
            return "a wandb run's steps only go forward, and this resume redoes steps it was given"
        return None

    def start(self, run: RunInfo, resume_id: str | None) -> str | None:
        import wandb

        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT") or run.project, name=run.name,
                              dir=str(run.output_dir), config=run.params, id=resume_id,
                              resume="allow" if resume_id else None, mode=_mode("WANDB_MODE", "offline"),
                              reinit="create_new",
                              settings=wandb.Settings(console="off", quiet=True, init_timeout=run.timeout_s))
        return self.run.id

    def final(self, step: int, metrics: dict[str, float]) -> None:
        super().final(step, metrics)
        self.run.summary.update({FINAL + k: v for k, v in metrics.items()})


class MLflow(Tracker):
    """A SQLite database, `<output_dir>/mlflow/mlflow.db` (artifacts beside it in `artifacts/`), unless
    `MLFLOW_TRACKING_URI` names another store (a server, a database); the experiment is the project. SQLite is what
    MLflow recommends for a local store: its file store is in maintenance mode (MLflow 3.18 refuses it without
    `MLFLOW_ALLOW_FILE_STORE`). Metric names as `mlflow_key` makes them (`eval/pass@4` -> `eval.pass_4`)."""

    name = "mlflow"

    def where(self, run: RunInfo) -> str:
        return os.environ.get("MLFLOW_TRACKING_URI") or _sqlite_uri(run.output_dir / "mlflow" / "mlflow.db")

    def resumes(self, run: RunInfo) -> str | None:
        if run.redone and not sql_store(self.where(run)):
            return ("MLflow has no call that removes a metric's values outside its SQL stores, and this resume redoes "
                    "steps it was given")
        return None

    def start(self, run: RunInfo, resume_id: str | None) -> str | None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = self.where(run)
        local = not os.environ.get("MLFLOW_TRACKING_URI")
        if local:
            (run.output_dir / "mlflow").mkdir(parents=True, exist_ok=True)
        self.client = MlflowClient(tracking_uri=uri)
        if resume_id is not None:
            self.run_id = resume_id
            self.client.update_run(resume_id, status="RUNNING")
            if run.resume_step is not None and sql_store(uri):
                self._forget_after(run.resume_step)
            return resume_id
        project = os.environ.get("MLFLOW_EXPERIMENT_NAME") or run.project
        found = self.client.get_experiment_by_name(project)
        if found is not None:
            experiment = found.experiment_id
        else:  # a local store keeps its artifacts beside it (MLflow's default is ./mlruns of the current folder)
            artifacts = (run.output_dir / "mlflow" / "artifacts").resolve().as_uri() if local else None
            experiment = self.client.create_experiment(project, artifact_location=artifacts)
        self.run_id = self.client.create_run(experiment, run_name=run.name).info.run_id
        params = [Param(k, _param(v)) for k, v in run.params.items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[i:i + 100])
        return self.run_id

    def _forget_after(self, step: int) -> None:
        """Remove the run's metric values after `step` (the steps this resume redoes). MLflow has no call for it:
        this goes through its SQL store's own tables (`SqlMetric`, and `SqlLatestMetric`, each metric's latest
        value, chosen again as MLflow chooses it: highest step, then timestamp, then value)."""
        from mlflow.store.tracking.dbmodels.models import SqlLatestMetric, SqlMetric

        store = self.client._tracking_client.store  # the client's own store: the same engine and session maker
        try:
            writing = store.ManagedSessionMaker(read_only=False)
        except TypeError:  # an MLflow from before read-only sessions: every session writes
            writing = store.ManagedSessionMaker()
        with writing as session:
            session.query(SqlMetric).filter(SqlMetric.run_uuid == self.run_id, SqlMetric.step > step).delete()
            stale = session.query(SqlLatestMetric).filter(SqlLatestMetric.run_uuid == self.run_id,
                                                          SqlLatestMetric.step > step).all()
            for latest in stale:
                kept = (session.query(SqlMetric)
                        .filter(SqlMetric.run_uuid == self.run_id, SqlMetric.key == latest.key)
                        .order_by(SqlMetric.step.desc(), SqlMetric.timestamp.desc(), SqlMetric.value.desc())
                        .first())
                if kept is None:
                    session.delete(latest)
                else:
                    latest.value, latest.step = kept.value, kept.step
                    latest.timestamp, latest.is_nan = kept.timestamp, kept.is_nan

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(mlflow_key(k), float(v), now, step) for k, v in metrics.items()]
        for i in range(0, len(batch), 1000):  # MLflow's batch limit
            self.client.log_batch(self.run_id, metrics=batch[i:i + 1000])

    def image(self, step: int, key: str, path: Path) -> None:
        self.client.log_artifact(self.run_id, str(path))

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _sqlite_uri(path: Path) -> str:
    return "sqlite:///" + str(path.resolve())


def mlflow_key(key: str) -> str:
    """`key` as MLflow's stores accept a metric name: `/` becomes `.` (its file store made each name a path, so
    `reward/x` and `reward/x/std` could not both be, and the names stay as they were), other characters outside
    `A-Za-z0-9_-. ` become `_`."""
    return re.sub(r"[^A-Za-z0-9_\-. ]", "_", key.replace("/", "."))


def _param(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= 6000 else text[:5997] + "..."  # MLflow's limit on a param's value


def _mode(variable: str, default: str) -> str:
    return os.environ.get(variable) or default


class Trackio(_RunObject):
    """Trackio's local store in `<output_dir>/trackio` unless `TRACKIO_DIR` names another; a resumed run continues
    the run of the same name, its rows after the checkpoint deleted from the store's SQLite table first (Trackio has
    no call for that). Trackio reads its directory once, when first imported: a later run in the same process (not
    the command line's way) logs where the first one's store is, and says so."""

    name = module = "trackio"
    _dir_set: str | None = None  # the TRACKIO_DIR tandem set, if it did

    def where(self, run: RunInfo) -> str:
        return os.environ.get("TRACKIO_DIR") or str(run.output_dir / "trackio")

    def start(self, run: RunInfo, resume_id: str | None) -> str | None:
        import sys

        wanted = str((run.output_dir / "trackio").resolve())
        if "trackio" not in sys.modules and "TRACKIO_DIR" not in os.environ:
            os.environ["TRACKIO_DIR"] = Trackio._dir_set = wanted
        import trackio
        from trackio.sqlite_storage import SQLiteStorage
        from trackio.utils import TRACKIO_DIR

        if Trackio._dir_set is not None and str(TRACKIO_DIR) != wanted:
            log.warning("run.report_to: trackio logs to %s, where an earlier run of this process had it, not %s",
                        TRACKIO_DIR, wanted)
        if resume_id is not None and run.resume_step is not None:
            db = SQLiteStorage.get_project_db_path(run.project)
            if db.is_file():
                with sqlite3.connect(db, timeout=30) as conn:  # its metrics table: run_name, step, metrics (JSON)
                    conn.execute("DELETE FROM metrics WHERE run_name = ? AND step > ?", (resume_id, run.resume_step))
        self.run = trackio.init(project=run.project, name=resume_id or run.name, config=run.params,
                                resume="must" if resume_id else "never", auto_log_cpu=False, auto_log_gpu=False)
        return self.run.name


class SwanLab(_RunObject):
    """Offline in `<output_dir>/swanlog` unless `SWANLAB_MODE` says otherwise (`swanlab sync` uploads it later).
    SwanLab resumes only online runs: offline, a resumed run is a new SwanLab run beside the first, given
    metrics.jsonl's history first."""

    name = module = "swanlab"

    def where(self, run: RunInfo) -> str:
        if _mode("SWANLAB_MODE", "offline") != "cloud":
            return str(run.output_dir / "swanlog")
        return os.environ.get("SWANLAB_API_HOST") or "https://swanlab.cn"

    def resumes(self, run: RunInfo) -> str | None:
        if _mode("SWANLAB_MODE", "offline") != "cloud":
            return "SwanLab resumes online runs only"
        if run.redone:
            return "a SwanLab run's steps only go forward, and this resume redoes steps it was given"
        return None

    def start(self, run: RunInfo, resume_id: str | None) -> str | None:
        import swanlab

        mode = _mode("SWANLAB_MODE", "offline")
        again = {"id": resume_id, "resume": "allow"} if resume_id and mode == "cloud" else {}
        self.run = swanlab.init(project=run.project, name=run.name, config=run.params, mode=mode,
                                log_dir=str(run.output_dir / "swanlog"), reinit=True, **again)
        return self.run.id


KINDS: dict[str, type[Tracker]] = {k.name: k for k in (TensorBoard, WandB, MLflow, Trackio, SwanLab)}


@dataclasses.dataclass
class _Call:
    """One call of a tracker's method, made on its thread; `done` is set when it has returned or failed."""

    what: str
    args: tuple
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    result: Any = None


class Background:
    """A tracker on a thread of its own, started there and then fed in order, so that neither a slow start nor a
    slow call (an upload, a server's retries) holds the training thread. Each call is bounded by `timeout_s`: one
    still running after that (a server that accepts and never answers) turns the tracker off with one warning, its
    thread left to the call (a daemon: it ends with the process). The first error does the same. metrics.jsonl stays
    the record. The run's thread notices an overdue call when it hands the tracker the next one, and when it closes."""

    def __init__(self, tracker: Tracker, where: str, timeout_s: float):
        self.tracker, self.where, self.timeout_s = tracker, where, timeout_s
        self.failed = False
        self._lock = threading.Lock()  # `failed` is set by either thread: one warning
        self._queue: queue.Queue[_Call | None] = queue.Queue()
        self._busy: tuple[str, float] | None = None  # the call running now and when it began (time.monotonic)
        self._thread = threading.Thread(target=self._drain, name=f"tracker-{tracker.name}", daemon=True)
        self._thread.start()

    def start(self, run: RunInfo, resume_id: str | None, stopping: Callable[[], bool]) -> tuple[bool, str | None]:
        """Open the tracker's run on its thread, waiting at most `timeout_s`, or until `stopping()` (a SIGTERM or
        SIGINT the run has recorded: the run must stop now, not after a tracker's retries). (started, its id)."""
        call = _Call("start", (run, resume_id))
        self._queue.put(call)
        deadline = time.monotonic() + self.timeout_s
        while not call.done.wait(POLL_S):
            if stopping():
                self._fail(None)
                log.info("run.report_to: not waiting for %s to start: the run is stopping", self.tracker.name)
                return False, None
            if time.monotonic() > deadline:
                self._fail(f"did not start within {self.timeout_s:g} s (run.tracker_timeout_s)")
                return False, None
        return not self.failed, call.result

    def call(self, what: str, *args) -> None:
        if not self.failed and not self._overdue():
            self._queue.put(_Call(what, args))

    def close(self) -> None:
        """Everything queued written, then the tracker's run closed on its thread (where it was started), each call
        within the bound. A tracker that failed is left as it is."""
        if not self.failed:
            self._queue.put(_Call("close", ()))
        self._queue.put(None)
        while not self.failed and self._thread.is_alive():
            self._thread.join(POLL_S)
            self._overdue()

    def _drain(self) -> None:
        while (call := self._queue.get()) is not None:
            if not self.failed:
                self._run(call)
            call.done.set()

    def _run(self, call: _Call) -> None:
        self._busy = (call.what, time.monotonic())
        try:
            call.result = getattr(self.tracker, call.what)(*call.args)
        except Exception as exc:  # noqa: BLE001  any library error: the run goes on without this tracker
            error = f"{type(exc).__name__}: {exc}"
            self._fail(f"could not start ({error})" if call.what == "start" else f"failed ({call.what}: {error})")
        else:
            if call.what == "start" and self.failed:  # it started after the run stopped waiting: close it again
                try:
                    self.tracker.close()
                except Exception:  # noqa: BLE001  it is off already, and said so
                    pass
        finally:
            self._busy = None

    def _overdue(self) -> bool:
        """Whether the call in progress has run past the bound (then the tracker is turned off)."""
        busy = self._busy
        if busy is not None and time.monotonic() - busy[1] > self.timeout_s:
            self._fail(f"did not return from {busy[0]} within {self.timeout_s:g} s (run.tracker_timeout_s)")
        return self.failed

    def _fail(self, why: str | None) -> None:
        """Turn the tracker off; warn once, saying `why` (None: silently, the run is stopping)."""
        with self._lock:
            if self.failed:
                return
            self.failed = True
        if why is not None:
            log.warning("run.report_to: %s at %s %s; the run goes on without it (metrics.jsonl holds every metric)",
                        self.tracker.name, self.where, why)


class Trackers:
    """The run's trackers: each started on its own thread within `timeout_s` (a hung or failed one is left out,
    warned about once), then fed every metric, the curves and the final evaluation. `<output_dir>/trackers.json`
    keeps each tracker's run id, so that a resume continues the same tracker run, and the last step the trackers
    were given, so that a resume knows whether it redoes steps they hold. `stopping`: whether the run has been asked
    to stop (no start is waited for then)."""

    def __init__(self, names: list[str], run: RunInfo, timeout_s: float = 60.0,
                 stopping: Callable[[], bool] = lambda: False):
        self.file = run.output_dir / IDS_FILE
        resumed = run.resume_step is not None
        self.ids, self.given = read_state(self.file) if resumed else ({}, None)
        redone = resumed and self.given is not None and self.given > run.resume_step
        run = dataclasses.replace(run, redone=redone, timeout_s=timeout_s)
        self.names = names
        self.open: list[Background] = []
        for name in names:
            if stopping():
                break
            self._start(name, run, timeout_s, stopping)
        self._save()

    def _start(self, name: str, run: RunInfo, timeout_s: float, stopping: Callable[[], bool]) -> None:
        """Start one tracker: the same tracker run as before where it `resumes`, else a new one, which a resumed run
        gives metrics.jsonl's history first."""
        tracker = KINDS[name]()
        known, earlier = name in self.ids, self.ids.get(name)
        why_new = tracker.resumes(run) if known else None
        t = Background(tracker, tracker.where(run), timeout_s)
        started, run_id = t.start(run, None if why_new else earlier, stopping)
        if not started:
            t.close()
            return
        self.open.append(t)
        self.ids[name] = run_id
        if run.resume_step is not None and (why_new or not known):
            if why_new:
                log.info("%s: the resumed run logs to a new %s run, %s, given metrics.jsonl's history first (%s); %s "
                         "keeps the earlier values", name, name, run_id, why_new, earlier)
            for row in run.history:
                t.call("log", row["step"], numeric({k: v for k, v in row.items() if k != "step"}))

    def _save(self) -> None:
        if self.names:
            write_state(self.file, self.ids, self.given)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if self.open and (self.given is None or step > self.given):
            self.given = step
            self._save()  # before the trackers may have it: a resume must know what they hold
        figures = numeric(metrics)
        for t in self.open:
            t.call("log", step, figures)

    def image(self, step: int, key: str, path: Path) -> None:
        for t in self.open:
            t.call("image", step, key, path)

    def final(self, step: int, metrics: dict[str, Any]) -> None:
        figures = numeric(metrics)
        for t in self.open:
            t.call("final", step, figures)

    def close(self) -> None:
        for t in self.open:
            t.close()
        self.open = []


def read_state(path: Path) -> tuple[dict[str, str | None], int | None]:
    """trackers.json: each tracker's run id, and the last step the trackers were given (None: none, or a file of an
    earlier tandem, which kept the ids alone). One a kill cut while it was written is said and left: the trackers
    then open new runs, given metrics.jsonl's history."""
    if not path.is_file():
        return {}, None
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            raise ValueError("not an object")
    except ValueError as exc:
        log.warning("%s is unreadable (%s): the trackers open new runs, given metrics.jsonl's history", path, exc)
        return {}, None
    if "ids" not in data:
        return data, None
    return data["ids"], data.get("last_step")


def write_state(path: Path, ids: dict[str, str | None], last_step: int | None) -> None:
    # in place, one small write (a temporary file beside it would be a file the run directory does not expect)
    path.write_text(json.dumps({"ids": ids, "last_step": last_step}, indent=2) + "\n")
