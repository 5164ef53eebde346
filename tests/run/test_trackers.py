"""run.report_to: each tracker's own store, read back through its library, holds every metric of metrics.jsonl at
its step, the config, the curves and the final evaluation; a resume continues the same tracker run; a tracker not
installed is refused before any model loads; one that fails warns once and the run goes on."""
from __future__ import annotations

import json
import logging
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.run import trackers

STORES = Path(__file__).with_name("tracker_stores.py")
ALL = ["tensorboard", "wandb", "mlflow", "trackio", "swanlab"]
pytestmark = pytest.mark.skipif(trackers.missing(ALL) != [], reason=f"not installed: {trackers.missing(ALL)}")


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


def test_every_tracker_stores_the_run_and_a_resume_continues_the_same_tracker_run(tiny_model, tmp_path):
    out, config = tmp_path / "run", _config_file(tmp_path)
    _train(config, tiny_model, out)
    ids = json.loads((out / "trackers.json").read_text())
    _train(config, tiny_model, out, "--resume", "run.steps=4")  # a flag among the overrides, as people type it
    resumed = json.loads((out / "trackers.json").read_text())
    # the same tracker runs, continued; SwanLab resumes only online runs, so offline it starts a second one
    assert {k: v for k, v in resumed.items() if k != "swanlab"} == {k: v for k, v in ids.items() if k != "swanlab"}
    assert resumed["swanlab"] != ids["swanlab"]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    read = subprocess.run([sys.executable, str(STORES), str(out), "tandem-tests"], capture_output=True, text=True,
                          timeout=300)
    assert read.returncode == 0, read.stderr[-3000:]
    stores = json.loads(read.stdout)
    # each of the two runs ends with its final evaluation, logged again under final/ at its last step
    final = {r["step"]: {f"final/{k}": v for k, v in r.items() if k.startswith("eval/")} for r in rows[2::2]}
    assert final[4] and json.loads((out / "eval_results.json").read_text())["results"] == {
        k.removeprefix("final/eval/"): v for k, v in final[4].items()}
    for name, store in stores.items():
        steps = {int(s): m for s, m in store["steps"].items()}
        for row in rows:
            want = {k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float))}
            want.update(final.get(row["step"], {}))
            if name == "mlflow":
                want = {trackers.mlflow_key(k): v for k, v in want.items()}
            got = steps.get(row["step"], {})
            assert got.keys() == want.keys(), (name, row["step"], sorted(set(got) ^ set(want)))
            # TensorBoard stores float32; the others the value itself
            tol = 1e-6 if name == "tensorboard" else 0.0
            bad = [k for k, v in want.items() if not math.isclose(got[k], v, rel_tol=tol, abs_tol=tol)]
            assert bad == [], (name, row["step"], [(k, got[k], want[k]) for k in bad])
        # the curves, at the end of each run (an MLflow artifact: the same file, replaced)
        assert store["images"] == (1 if name == "mlflow" else 2), name
        if name != "tensorboard":  # its config is a text panel
            assert store["params"]["run.name"] == "tracked", (name, store["params"])
    assert stores["wandb"]["ids"] == [ids["wandb"]] * 2  # two offline files of one wandb run
    assert stores["mlflow"]["ids"] == [ids["mlflow"]] and stores["trackio"]["ids"] == [ids["trackio"]]
    assert len(list((out / "swanlog").glob("run-*"))) == 2  # SwanLab resumes only online runs: a second one


def test_a_tracker_not_installed_is_refused_before_any_model_loads(tiny_model, tmp_path, monkeypatch, capsys):
    import tandem.trainer  # noqa: F401  imported before the patch: a module importing it then keeps the real one
    from tandem import modeling
    from tandem.cli import main

    monkeypatch.setitem(trackers.TRACKERS, "wandb", ("a_module_that_is_not_installed", "wandb"))
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
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # as SwanLab does: a handler of its own
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


def test_a_failing_tracker_warns_once_and_the_run_goes_on(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(trackers.KINDS, "flaky", _Flaky)
    monkeypatch.setitem(trackers.KINDS, "broken", _Broken)
    before = signal.getsignal(signal.SIGINT)
    with caplog.at_level(logging.WARNING, logger="tandem.run.trackers"):
        t = trackers.Trackers(["broken", "flaky"], trackers.RunInfo("r", "p", tmp_path, {}), resume=False)
        assert signal.getsignal(signal.SIGINT) is before  # tandem's handler kept: a preemption still saves
        flaky = t.open[0].tracker
        for step in range(5):
            t.log(step, {"loss": 1.0, "note": "text is not a figure"})
        t.image(4, "curves", tmp_path / "curves.png")
        t.close()
    assert flaky.logged == [0, 1]
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2, warnings
    assert "broken could not start (RuntimeError: no credentials)" in warnings[0]
    assert "flaky failed (log: ConnectionError: the server went away)" in warnings[1]
    assert json.loads((tmp_path / "trackers.json").read_text()) == {"flaky": "flaky-1"}
