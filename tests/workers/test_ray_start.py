"""Where tandem starts Ray itself: a resource its Ray cannot have is refused before any wait, saying that nothing was
saved; a controller killed outright leaves no Ray process holding a loopback port (Ray's agents held one ~60 s)."""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before `import ray`: stay on loopback
os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # no ~/.ray/auth_token
pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")

CHECKOUT = Path(__file__).resolve().parents[2]
# A controller as `tandem` starts its own Ray (tandem.workers.ray.session), which then waits to be killed.
CONTROLLER = ("import sys, time; from tandem.workers.ray import session; "
              "session.acquire_ray(None, 1, 0, None, False, 80 << 20); "
              "print('ready', flush=True); time.sleep(600)")


def test_a_resource_tandems_own_ray_lacks_is_refused_before_any_wait(tiny_model, tmp_path):
    """placement.train_resources naming a resource the Ray tandem starts on this machine cannot have: refused at
    once (the wait for a placement was 120 s), exit 2, naming the field, the resource and the fix, and saying that
    nothing was saved, where it suggested --resume."""
    config = tmp_path / "run.yaml"
    config.write_text("rewards:\n  - {name: arithmetic_exact}\n")
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "tandem.cli", "train", str(config), f"model.path={tiny_model}",
                           f"run.output_dir={tmp_path / 'run'}", "run.progress=false", "reward_pool.workers=0",
                           "placement.backend=ray", "placement.mode=split",
                           "placement.train_resources={nonexistent: 1}",
                           "batch.prompts_per_step=4", "batch.group_size=4", "rollout.max_new_tokens=4",
                           "data.max_prompt_tokens=8", "data.eval_size=4"],
                          capture_output=True, text=True, timeout=100, cwd=CHECKOUT)
    took = time.monotonic() - began
    assert done.returncode == 2, done.stderr[-3000:]
    assert ("placement.train_resources: {'nonexistent': 1.0} (each trainers worker's), but no node of the Ray "
            "cluster has that") in done.stderr, done.stderr[-3000:]
    assert "set placement.ray_address, or remove it from placement.train_resources" in done.stderr, done.stderr[-3000:]
    assert "this run trained and saved nothing" in done.stderr and "--resume" not in done.stderr, done.stderr[-3000:]
    assert took < 60, took  # Ray's start and the checks before it; no placement wait


def _never(ctx):
    raise AssertionError("a worker was built: the placement should have been refused")


def test_on_a_cluster_a_resource_no_node_has_is_waited_for_then_refused_saying_nothing_was_saved(monkeypatch,
                                                                                                  caplog):
    """On a cluster of one's own (placement.ray_address) an autoscaler may yet add a node with the resource: the
    run warns and waits, then says that nothing was saved (it suggested --resume), as a ValueError the command line
    reports in one line (exit 2)."""
    import ray

    from tandem.workers.ray import group as ray_group

    real = ray_group._check_resources
    monkeypatch.setattr(ray_group, "_check_resources", lambda specs, fixed: real(specs, fixed=False))
    spec = ray_group.GroupSpec("trainers", _never, 1, resources={"nonexistent": 1},
                               resources_from="placement.train_resources")
    with caplog.at_level(logging.WARNING, logger="tandem.workers.ray.group"), \
            pytest.raises(ray_group.PlacementError) as refused:
        ray_group.start_groups([spec], placement_timeout_s=2, num_cpus=1, object_store_memory=80 << 20)
    assert isinstance(refused.value, ValueError)
    assert str(refused.value).startswith("could not place trainers: 1 x {'CPU': 1, 'nonexistent': 1} within 2 s")
    assert str(refused.value).endswith("No worker started: this run trained and saved nothing"), refused.value
    assert ("placement.train_resources: {'nonexistent': 1} (each trainers worker's), but no node of the Ray cluster "
            "has that") in caplog.text and "waiting for one that has (an autoscaler may add it)" in caplog.text
    assert not ray.is_initialized()


def _tree(root: int) -> set[int]:
    """`root` and its live descendants."""
    found, todo = {root}, [root]
    while todo:
        try:
            kids = psutil.Process(todo.pop()).children()
        except psutil.NoSuchProcess:
            continue
        for kid in kids:
            found.add(kid.pid)
            todo.append(kid.pid)
    return found


def _listening(pids: set[int]) -> list[tuple[int, str, int]]:
    """(pid, name, port) of each loopback port one of `pids` listens on, zombies left out."""
    out = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            out += [(pid, proc.name(), c.laddr.port) for c in proc.net_connections(kind="inet")
                    if c.status == psutil.CONN_LISTEN and c.laddr.ip in ("127.0.0.1", "::ffff:127.0.0.1")]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return out


def test_a_controller_killed_outright_leaves_no_ray_process_holding_a_port():
    """SIGKILL to a controller whose Ray is up: within a few seconds no process of that Ray (its head processes,
    the raylet's dashboard and runtime-env agents) listens on a loopback port any more."""
    controller = subprocess.Popen([sys.executable, "-c", CONTROLLER], stdout=subprocess.PIPE, text=True,
                                  cwd=CHECKOUT, start_new_session=True)
    try:
        assert controller.stdout.readline().strip() == "ready"
        ray_pids = _tree(controller.pid) - {controller.pid}
        # the raylet starts its agents as it comes up: wait until they listen (or the test's bound)
        deadline = time.monotonic() + 30
        while not any(name.startswith("ray::RuntimeEnv") for _, name, _ in _listening(_tree(controller.pid))):
            assert time.monotonic() < deadline, _listening(_tree(controller.pid))
            time.sleep(0.2)
        ray_pids = _tree(controller.pid) - {controller.pid}
        assert _listening(ray_pids), "Ray's processes should listen on loopback while it is up"
    finally:
        os.kill(controller.pid, signal.SIGKILL)
        controller.wait()
    began = time.monotonic()
    while (left := _listening(ray_pids)) and time.monotonic() - began < 10:
        time.sleep(0.2)
    took = time.monotonic() - began
    print(f"the last of Ray's loopback ports closed {took:.1f} s after the controller's SIGKILL")
    assert left == [], left
