"""Experiment trackers (`run.report_to`): TensorBoard, Weights & Biases, MLflow, Trackio, SwanLab, each through its
own library, local by default, fed off the training thread; a failing one warns once and the run goes on."""
from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import logging
import os
import queue
import re
import signal
import threading
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger("tandem.run.trackers")

# name -> (the module it needs, where it stores a run under run.output_dir when the environment names no server)
TRACKERS: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlruns"),
    "trackio": ("trackio", "trackio"),
    "swanlab": ("swanlab", "swanlog"),
}
IDS_FILE = "trackers.json"  # each tracker's run id, so that a resumed run continues the same tracker run
FINAL = "final/"  # the final evaluation's figures, logged under this prefix at the last step


def missing(names: list[str]) -> list[str]:
    """Trackers among `names` whose library is not installed."""
    return [n for n in names if importlib.util.find_spec(TRACKERS[n][0]) is None]


def numeric(metrics: dict[str, Any]) -> dict[str, float]:
    """The figures a tracker can plot: numbers only (metrics.jsonl also keeps non-finite values as strings)."""
    return {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


class Tracker:
    """One tracker's run. `start` opens it (a resumed run passes the id `start` returned before); then `log` every
    metric at its step, `image` a picture, `final` the last evaluation, `close` once."""

    name = ""

    def start(self, run: "RunInfo", resume_id: str | None) -> str | None:
        raise NotImplementedError

    def log(self, step: int, metrics: dict[str, float]) -> None:
        raise NotImplementedError

    def image(self, step: int, key: str, path: Path) -> None:
        raise NotImplementedError

    def final(self, step: int, metrics: dict[str, float]) -> None:
        self.log(step, {FINAL + k: v for k, v in metrics.items()})

    def close(self) -> None:
        pass


@dataclasses.dataclass
class RunInfo:
    """What every tracker is given about the run: its name, project, folder and resolved config."""

    name: str
    project: str
    output_dir: Path
    config: dict[str, Any]

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


class TensorBoard(Tracker):
    name = "tensorboard"

    def start(self, run: RunInfo, resume_id: str | None) -> str | None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run.output_dir / "tensorboard"))
        self.writer.add_text("config", "```\n" + json.dumps(run.config, indent=2) + "\n```")
        return None

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
    """Offline in `<output_dir>/wandb` unless `WANDB_MODE` says otherwise (`wandb sync` uploads it later)."""

    name = module = "wandb"

    def start(self, run: RunInfo, resume_id: str | None) -> str | None:
        import wandb

        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT") or run.project, name=run.name,
                              dir=str(run.output_dir), config=run.params, id=resume_id,
                              resume="allow" if resume_id else None, mode=os.environ.get("WANDB_MODE") or "offline",
                              reinit="create_new", settings=wandb.Settings(console="off", quiet=True))
        return self.run.id

    def final(self, step: int, metrics: dict[str, float]) -> None:
        super().final(step, metrics)
        self.run.summary.update({FINAL + k: v for k, v in metrics.items()})


class MLflow(Tracker):
    """A file store in `<output_dir>/mlruns` unless `MLFLOW_TRACKING_URI` names another (a server, a database); the
    experiment is the project. MLflow 3 keeps its file store in maintenance mode behind `MLFLOW_ALLOW_FILE_STORE`,
    which tandem sets for that default only: a local store that needs no database. Metric names as `mlflow_key`
    makes them (`eval/pass@4` -> `eval.pass_4`)."""

    name = "mlflow"

    def start(self, run: RunInfo, resume_id: str | None) -> str | None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            uri = (run.output_dir / "mlruns").resolve().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        if resume_id is not None:
            self.run_id = resume_id
            self.client.update_run(resume_id, status="RUNNING")
            return resume_id
        project = os.environ.get("MLFLOW_EXPERIMENT_NAME") or run.project
        found = self.client.get_experiment_by_name(project)
        experiment = found.experiment_id if found is not None else self.client.create_experiment(project)
        self.run_id = self.client.create_run(experiment, run_name=run.name).info.run_id
        params = [Param(k, _param(v)) for k, v in run.params.items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[i:i + 100])
        return self.run_id

    def log(self, step: int, metrics: dict[str, float]) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(mlflow_key(k), float(v), now, step) for k, v in metrics.items()]
        for i in range(0, len(batch), 1000):  # MLflow's batch limit
            self.client.log_batch(self.run_id, metrics=batch[i:i + 1000])

    def image(self, step: int, key: str, path: Path) -> None:
        self.client.log_artifact(self.run_id, str(path))

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def mlflow_key(key: str) -> str:
    """`key` as MLflow's stores accept a metric name: `/` becomes `.` (the file store makes each name a path, so
    `reward/x` and `reward/x/std` could not both be), other characters outside `A-Za-z0-9_-. ` become `_`."""
    return re.sub(r"[^A-Za-z0-9_\-. ]", "_", key.replace("/", "."))


def _param(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= 6000 else text[:5997] + "..."  # MLflow's limit on a param's value


class Trackio(_RunObject):
    """Trackio's local store in `<output_dir>/trackio` unless `TRACKIO_DIR` names another; a resumed run continues
    the run of the same name. Trackio reads its directory once, when first imported: a later run in the same
    process (not the command line's way) logs where the first one's store is, and says so."""

    name = module = "trackio"
    _dir_set: str | None = None  # the TRACKIO_DIR tandem set, if it did

    def start(self, run: RunInfo, resume_id: str | None) -> str | None:
        import sys

        wanted = str((run.output_dir / "trackio").resolve())
        if "trackio" not in sys.modules and "TRACKIO_DIR" not in os.environ:
            os.environ["TRACKIO_DIR"] = Trackio._dir_set = wanted
        import trackio
        from trackio.utils import TRACKIO_DIR

        if Trackio._dir_set is not None and str(TRACKIO_DIR) != wanted:
            log.warning("run.report_to: trackio logs to %s, where an earlier run of this process had it, not %s",
                        TRACKIO_DIR, wanted)
        self.run = trackio.init(project=run.project, name=resume_id or run.name, config=run.params,
                                resume="must" if resume_id else "never", auto_log_cpu=False, auto_log_gpu=False)
        return self.run.name


class SwanLab(_RunObject):
    """Offline in `<output_dir>/swanlog` unless `SWANLAB_MODE` says otherwise (`swanlab sync` uploads it later).
    SwanLab resumes only online runs: offline, a resumed run is a new SwanLab run beside the first."""

    name = module = "swanlab"

    def start(self, run: RunInfo, resume_id: str | None) -> str | None:
        import swanlab

        mode = os.environ.get("SWANLAB_MODE") or "offline"
        again = {"id": resume_id, "resume": "allow"} if resume_id and mode == "cloud" else {}
        self.run = swanlab.init(project=run.project, name=run.name, config=run.params, mode=mode,
                                log_dir=str(run.output_dir / "swanlog"), reinit=True, **again)
        return self.run.id


KINDS: dict[str, type[Tracker]] = {k.name: k for k in (TensorBoard, WandB, MLflow, Trackio, SwanLab)}


class Background:
    """A tracker fed from a thread of its own, in order: a slow library (an upload, a flush) never holds a step.
    The first error warns (naming the tracker and what failed) and turns the tracker off; metrics.jsonl stays the
    record."""

    def __init__(self, tracker: Tracker):
        self.tracker, self.failed = tracker, False
        self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._drain, name=f"tracker-{tracker.name}", daemon=True)
        self._thread.start()

    def call(self, what: str, *args) -> None:
        if not self.failed:
            self._queue.put(lambda: self._run(what, *args))

    def _run(self, what: str, *args) -> None:
        if self.failed:
            return
        try:
            getattr(self.tracker, what)(*args)
        except Exception as exc:  # noqa: BLE001  any library error: the run goes on without this tracker
            self.failed = True
            log.warning("run.report_to: %s failed (%s: %s: %s); the run goes on without it (metrics.jsonl holds every "
                        "metric)", self.tracker.name, what, type(exc).__name__, exc)

    def _drain(self) -> None:
        while (job := self._queue.get()) is not None:
            job()

    def close(self, timeout: float = 120.0) -> None:
        """Everything queued written (waiting at most `timeout` seconds), then the tracker's run closed from the
        calling thread: libraries restore their signal handlers when a run finishes, which only the main thread
        may do."""
        self._queue.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("run.report_to: %s did not finish writing within %.0f s; leaving it", self.tracker.name,
                        timeout)
            return
        self._run("close")


class Trackers:
    """The run's trackers: opened at the start (each one's run id kept in `<output_dir>/trackers.json`, so that a
    resume continues the same tracker run), then fed every metric, the curves and the final evaluation."""

    def __init__(self, names: list[str], run: RunInfo, resume: bool):
        ids_file = run.output_dir / IDS_FILE
        ids = json.loads(ids_file.read_text()) if resume and ids_file.is_file() else {}
        self.open: list[Background] = []
        with _signal_handlers_kept():
            for name in names:
                tracker = KINDS[name]()
                try:
                    ids[name] = tracker.start(run, ids.get(name))
                except Exception as exc:  # noqa: BLE001  a tracker that cannot start must not stop the run
                    log.warning("run.report_to: %s could not start (%s: %s); the run goes on without it", name,
                                type(exc).__name__, exc)
                    continue
                self.open.append(Background(tracker))
        if names:
            ids_file.write_text(json.dumps(ids, indent=2) + "\n")

    def log(self, step: int, metrics: dict[str, Any]) -> None:
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


@contextlib.contextmanager
def _signal_handlers_kept():
    """SIGINT and SIGTERM as they were before: a library that installs its own handler (SwanLab does, for SIGINT)
    must not take a preemption away from tandem's (tandem.run.signals saves the last step first)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    kept = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in kept.items():
            if handler is not None:
                signal.signal(s, handler)
