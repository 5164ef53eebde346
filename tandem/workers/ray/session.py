"""The Ray session tandem starts or joins, shared by reference count, and the reaper beside a Ray it started."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator


def import_ray() -> Any:
    """Import Ray with this project's safe defaults (the caller's environment wins where it sets them)."""
    # Read once, at import: without it Ray rewrites a loopback node address to the machine's external one.
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    # Otherwise Ray 2.60 writes ~/.ray/auth_token on the first ray.init(); clusters that use tokens set their own.
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no reports to the outside world
    import ray

    return ray


_ray_lock = threading.Lock()
_ray_users = 0  # holders of a Ray session that this module started (0: none started, or someone else's)


def acquire_ray(address: str | None, num_cpus: float | None, num_gpus: int | None, temp_dir: str | None,
                 log_to_driver: bool, object_store_memory: int | None) -> bool:
    """Make sure Ray is up; True when this module owns the session (then `release_ray` must follow)."""
    global _ray_users
    ray = import_ray()
    with _ray_lock:
        if ray.is_initialized():
            if _ray_users == 0:
                return False  # the caller's own session: use it, never shut it down
            _ray_users += 1
            return True
        with _keeping_sigterm_handler():
            _init_ray(ray, address, num_cpus, num_gpus, temp_dir, log_to_driver, object_store_memory)
        _ray_users = 1
        return True


@contextmanager
def _keeping_sigterm_handler() -> Iterator[None]:
    """ray.init takes SIGTERM for itself (a handler that prints a stack and aborts the driver): the caller's handler
    (tandem.run.signals, which checkpoints and then stops Ray) goes back in its place."""
    if threading.current_thread() is not threading.main_thread():  # nothing to keep: only the main one can have one
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        if previous is not None:  # None: a handler not set from Python, which cannot be put back from here
            signal.signal(signal.SIGTERM, previous)


def _init_ray(ray: Any, address: str | None, num_cpus: float | None, num_gpus: int | None, temp_dir: str | None,
              log_to_driver: bool, object_store_memory: int | None) -> None:
    if address is not None:
        ray.init(address=address, log_to_driver=log_to_driver)
    else:
        folder = Path(temp_dir or Path(tempfile.gettempdir()) / "tandem-ray")
        folder.mkdir(parents=True, exist_ok=True)
        # address="local": never attach to another Ray found running on this machine (other users' sessions).
        ray.init(address="local", num_cpus=num_cpus, num_gpus=num_gpus, _node_ip_address="127.0.0.1",
                 include_dashboard=False, _temp_dir=str(folder), log_to_driver=log_to_driver,
                 object_store_memory=object_store_memory,
                 # Ray would pre-start one idle worker per CPU, which our actors never use (their runtime_env
                 # differs): seconds of CPU on a small machine for nothing.
                 _system_config={"enable_worker_prestart": False, "prestart_worker_first_driver": False})
        _start_reaper()


def release_ray() -> None:
    """Let go of a session `acquire_ray` said this module owns: the last holder shuts Ray and its reaper down."""
    global _ray_users
    ray = import_ray()
    with _ray_lock:
        _ray_users -= 1
        if _ray_users == 0:
            ray.shutdown()
            _stop_reaper()


# A controller killed outright (SIGKILL, the OOM killer) leaves the raylet's dashboard and runtime-env agents holding
# their loopback ports for about 60 s; tandem starts reaper.py beside its own Ray to end them (it says why and how).
REAPER = Path(__file__).with_name("reaper.py")
_reaper: Any = None  # the reaper of the Ray this module started (subprocess.Popen), while it runs


def _start_reaper() -> None:
    global _reaper
    if not Path("/proc/self/stat").exists():  # Linux's /proc is how it finds the node's processes
        return
    # a session of its own: a terminal's Ctrl-C to the controller's process group must not end it before its time
    _reaper = subprocess.Popen([sys.executable, "-I", str(REAPER)], stdin=subprocess.PIPE,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def _stop_reaper() -> None:
    """Ray was shut down in order: the reaper exits without killing anything."""
    global _reaper
    if _reaper is None:
        return
    reaper, _reaper = _reaper, None
    try:
        reaper.stdin.write(b"shut down")
        reaper.stdin.close()
        reaper.wait(timeout=10)
    except (OSError, ValueError, subprocess.TimeoutExpired):
        reaper.kill()

