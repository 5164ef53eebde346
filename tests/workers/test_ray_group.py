"""The ray worker-group backend on loopback: process groups, calls, two groups in one world, failures, shutdown."""
from __future__ import annotations

import functools
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before `import ray`: stay on loopback
os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # no ~/.ray/auth_token
pytest.importorskip("ray")

from procs import descendants  # noqa: E402
from ray_workers import ProbeWorker, ray_session, start_group  # noqa: E402

from tandem.workers.group import WorkerError  # noqa: E402
from tandem.workers.ray.group import GroupSpec, start_groups  # noqa: E402

CHECKOUT = Path(__file__).resolve().parents[2]
BOUNDED = dict(pg_timeout_s=120, setup_timeout_s=120)  # a broken test fails instead of hanging


def _ray_processes() -> list[str]:
    """Live Ray processes descended from this one (raylet, gcs_server, workers; other tests' helpers, such as
    the reward pool or a multiprocessing resource tracker, are not Ray's and are left out)."""
    return [f"{pid} {cmd}" for pid, cmd in descendants() if "ray" in cmd.lower()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]


def _wait_gone(pids: list[int], seconds: float = 20) -> list[int]:
    deadline = time.monotonic() + seconds
    while (alive := [p for p in pids if _pid_alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive


class _Session:
    """One Ray session for the module (each ray.init costs 7–17 s here); the last test closes it."""

    def __init__(self):
        self.folder = tempfile.mkdtemp(prefix="tandem-ray-test-")  # short: Ray's socket paths live below it
        cwd = os.getcwd()
        os.chdir(self.folder)  # the actors must find tandem and the test worker without the driver's cwd
        try:
            self._cm = ray_session(num_cpus=4, temp_dir=self.folder, log_to_driver=False,
                                   object_store_memory=80 << 20)
            self._cm.__enter__()
        finally:
            os.chdir(cwd)
        self.open = True

    def close(self) -> None:
        if self.open:
            self.open = False
            self._cm.__exit__(None, None, None)
            shutil.rmtree(self.folder, ignore_errors=True)


@pytest.fixture(scope="module")
def session():
    s = _Session()
    yield s
    s.close()


def test_process_group_calls_and_submit(session, tmp_path):
    group = start_group("workers", functools.partial(ProbeWorker, marker_dir=str(tmp_path)), 2, **BOUNDED)
    try:
        info = group.call("info")
        assert [i["rank"] for i in info] == [0, 1] and all(i["size"] == 2 and i["world_size"] == 2 for i in info)
        assert all(i["group_ranks"] == {"workers": [0, 1]} and i["group_is_world"] for i in info)
        assert all(i["threads"] == 1 and i["omp"] == "1" and i["device"] == "cpu" for i in info)
        assert all(i["tandem"] == str(CHECKOUT / "tandem" / "__init__.py") for i in info)
        assert len({i["pid"] for i in info} | {os.getpid()}) == 3
        assert group.call("all_reduce", 1.5) == [3.0, 3.0]
        assert group.call("add", 1, y=2) == [3, 103]
        assert group.call_each("add", [(1,), (2, 3)]) == [1, 105]
        pending = group.submit("sleep", 0.5)
        assert not pending.done()
        with pytest.raises(TimeoutError):
            pending.get(timeout=0.01)
        assert pending.get(timeout=30) == [0, 1] and pending.done()
        assert group.submit_each("add", [(5,), (6,)]).get() == [5, 106]
        with pytest.raises(ValueError):
            group.submit_each("add", [(1,)])
    finally:
        group.shutdown()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["closed-workers-0", "closed-workers-1"]
    assert not _wait_gone([i["pid"] for i in info])
    with pytest.raises(WorkerError, match="shut down"):
        group.call("info")


def test_a_large_argument_reaches_every_actor_through_one_put(session, monkeypatch):
    """A step's completions go to every trainer: stored once per call, not copied once per actor."""
    import ray

    group = start_group("trainers", ProbeWorker, 2, **BOUNDED)
    real_put, puts = ray.put, []
    monkeypatch.setattr(ray, "put", lambda value, **kw: puts.append(value) or real_put(value, **kw))
    try:
        big = list(range(50_000))  # ~250 KB pickled: more than Ray inlines in a call (100 KiB)
        assert group.call("total", big) == [sum(big), sum(big) + 100] and puts == [(big,)]
        assert group.submit_side("total", big, offset=1).get() == [sum(big) + 1, sum(big) + 101]
        assert len(puts) == 2
        assert group.call("total", [1, 2], offset=3) == [6, 106] and len(puts) == 2  # small: inline, no put
    finally:
        group.shutdown()


def test_two_groups_share_one_world(session):
    trainers, samplers = start_groups([GroupSpec("trainers", ProbeWorker, 1), ("samplers", ProbeWorker, 2)],
                                      **BOUNDED)
    try:
        t, s = trainers.call("info"), samplers.call("info")
        ranks = {"trainers": [0], "samplers": [1, 2]}
        assert [i["global_rank"] for i in t + s] == [0, 1, 2] and [i["rank"] for i in s] == [0, 1]
        assert all(i["world_size"] == 3 and i["group_ranks"] == ranks and not i["group_is_world"] for i in t + s)
        # Each group's ctx.group is its own: the samplers' all_reduce sums over the two samplers only.
        assert samplers.call_each("all_reduce", [(1.0,), (2.0,)]) == [3.0, 3.0]
        assert trainers.call("all_reduce", 7.0) == [7.0]
        # Across groups over the default group: the trainer sends, the samplers receive.
        sent = [trainers.submit("broadcast_from", 0, 42.0), samplers.submit("broadcast_from", 0, 0.0)]
        assert [p.get(timeout=60) for p in sent] == [[42.0], [42.0, 42.0]]
        world = [trainers.submit("all_reduce", 1.0, world=True), samplers.submit("all_reduce", 2.0, world=True)]
        assert [p.get(timeout=60) for p in world] == [[5.0], [5.0, 5.0]]
    finally:
        trainers.shutdown()
        samplers.shutdown()


def test_a_group_can_stay_outside_the_world(session):
    """join_world=False (vLLM samplers): those workers are in no torch.distributed world, numbered after the
    world's ranks; the others form a world of their own."""
    trainers, samplers = start_groups([GroupSpec("trainers", ProbeWorker, 2),
                                       GroupSpec("samplers", ProbeWorker, 1, join_world=False)], **BOUNDED)
    try:
        t, s = trainers.call("info"), samplers.call("info")
        assert [i["global_rank"] for i in t + s] == [0, 1, 2]
        assert all(i["in_a_world"] and i["world_size"] == 2 for i in t) and not s[0]["in_a_world"]
        assert trainers.call("all_reduce", 1.0, world=True) == [2.0, 2.0]
    finally:
        trainers.shutdown()
        samplers.shutdown()
    with pytest.raises(ValueError, match="join_world=False must come after"):
        start_groups([GroupSpec("samplers", ProbeWorker, 1, join_world=False), GroupSpec("trainers", ProbeWorker, 1)])


def test_exception_names_worker_and_method_and_stops_the_group(session):
    group = start_group("trainers", ProbeWorker, 2, **BOUNDED)
    try:
        pids = [i["pid"] for i in group.call("info")]
        with pytest.raises(WorkerError,
                           match=r"worker 1/2 of 'trainers' failed in raise_on: ValueError: boom on rank 1"):
            group.call("raise_on", 1)
        assert not _wait_gone(pids)  # any failure kills the whole group: no half-alive world
        with pytest.raises(WorkerError, match="unusable"):
            group.call("info")
    finally:
        group.shutdown()


def test_worker_death_in_a_collective_is_reported_not_hung(session):
    group = start_group("samplers", ProbeWorker, 2, **BOUNDED)
    try:
        pids = [i["pid"] for i in group.call("info")]
        start = time.monotonic()
        with pytest.raises(WorkerError, match=r"worker 1/2 of 'samplers' died in exit_on"):
            group.call("exit_on", 1)  # rank 0 sits in all_reduce waiting for rank 1 (gloo timeout: 120 s)
        assert time.monotonic() - start < 60
        assert not _wait_gone(pids)
    finally:
        group.shutdown()


def test_call_timeout_names_the_ranks_still_running(session):
    group = start_group("slow", ProbeWorker, 1, call_timeout_s=1.0, **BOUNDED)
    try:
        with pytest.raises(WorkerError, match=r"sleep timed out after 1 s; still running: ranks \[0\] of 'slow'"):
            group.call("sleep", 60)
    finally:
        group.shutdown()


def test_shutdown_leaves_no_ray_process(session):
    """Closes the module's session: keep it last."""
    group = start_group("last", ProbeWorker, 1, **BOUNDED)
    pid = group.call("info")[0]["pid"]
    group.shutdown()
    assert not _wait_gone([pid])
    assert _ray_processes(), "Ray's own processes should still serve the module's session"
    session.close()
    deadline = time.monotonic() + 20
    while (left := _ray_processes()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left
