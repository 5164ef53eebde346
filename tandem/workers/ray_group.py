"""The `ray` worker-group backend: workers as Ray actors in placement groups, joined by one torch.distributed world."""
from __future__ import annotations

import logging
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from tandem.util.net import free_address
from tandem.workers.group import Method, WorkerContext, WorkerError, method_name

log = logging.getLogger("tandem.workers.ray_group")

CLOSE_TIMEOUT_S = 10.0  # a worker's close() is best effort: a hung one must not hang shutdown
FAILURE_GRACE_S = 2.0  # after a first failure, how long the other workers' outcomes may take to arrive
# A worker on a node that went down is first only "unavailable" to Ray: its node is declared dead once its health
# checks fail (about 15 s at Ray's defaults). The report waits that long, at most, to say which it was.
UNREACHABLE_GRACE_S = 30.0
# A call's arguments at least this large (pickled) go to a group's actors as one object-store ref: Ray inlines
# smaller ones in each call (its max_direct_call_object_size, 100 KiB), which is cheaper than a put and a fetch.
SHARED_ARGS_MIN_BYTES = 100 * 1024


def import_ray() -> Any:
    """Import Ray with this project's safe defaults (the caller's environment wins where it sets them)."""
    # Read once, at import: without it Ray rewrites a loopback node address to the machine's external one.
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    # Otherwise Ray 2.60 writes ~/.ray/auth_token on the first ray.init(); clusters that use tokens set their own.
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no reports to the outside world
    import ray

    return ray


# ---------------------------------------------------------------- the Ray session, shared by reference count

_ray_lock = threading.Lock()
_ray_users = 0  # holders of a Ray session that this module started (0: none started, or someone else's)


def _acquire_ray(address: str | None, num_cpus: float | None, num_gpus: int | None, temp_dir: str | None,
                 log_to_driver: bool, object_store_memory: int | None) -> bool:
    """Make sure Ray is up; True when this module owns the session (then `_release_ray` must follow)."""
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


def _release_ray() -> None:
    global _ray_users
    ray = import_ray()
    with _ray_lock:
        _ray_users -= 1
        if _ray_users == 0:
            ray.shutdown()
            _stop_reaper()


# A controller killed outright (SIGKILL, the OOM killer) leaves the raylet's dashboard and runtime-env agents holding
# their loopback ports for about 60 s; tandem starts ray_reaper.py beside its own Ray to end them (it says why and how).
REAPER = Path(__file__).with_name("ray_reaper.py")
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


# ---------------------------------------------------------------- what runs inside each actor

def _loopback_ifname() -> str | None:
    return next((name for _, name in socket.if_nameindex() if name.startswith("lo")), None)


SIDE_LANE = "side"  # a second call lane per actor (see RayWorkerGroup.submit_side)


class _Host:
    """One actor: pins itself to its share, joins the process group, builds the worker and runs its methods."""

    def __init__(self, cpus: float, gpus: float):
        import torch

        torch.set_num_threads(max(1, int(cpus)))  # OMP_NUM_THREADS came with the runtime_env
        self.device = "cuda" if gpus > 0 else "cpu"
        self.worker: Any = None

    def address(self) -> tuple[str, int]:
        """This node's address and a port free on it, for the process group's rendezvous."""
        import ray

        return free_address(ray.util.get_node_ip_address())

    def setup(self, factory: Callable[[WorkerContext], Any], ctx: WorkerContext, backend: str | None,
              master: tuple[str, int], timeout_s: float, groups: list[tuple[str, list[int]]]) -> None:
        import torch
        import torch.distributed as dist

        ctx.device = self.device
        if self.device == "cuda":
            torch.cuda.set_device(0)  # Ray narrowed CUDA_VISIBLE_DEVICES to this actor's GPU
        if backend is not None:
            ip, port = master
            if ip.startswith("127.") or ip == "::1":
                # Gloo and NCCL pick an interface from the host name, which may resolve off the machine.
                lo = _loopback_ifname()
                if lo:
                    os.environ.setdefault("GLOO_SOCKET_IFNAME", lo)
                    os.environ.setdefault("NCCL_SOCKET_IFNAME", lo)
            host = f"[{ip}]" if ":" in ip else ip
            timeout = timedelta(seconds=timeout_s)
            dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=ctx.global_rank,
                                    world_size=ctx.world_size, timeout=timeout)
            if len(groups) == 1:
                ctx.group = dist.group.WORLD
            else:
                # new_group is collective over the whole world: every rank creates every group, in one order.
                for name, ranks in groups:
                    pg = dist.new_group(ranks, timeout=timeout)
                    if name == ctx.name:
                        ctx.group = pg
        self.worker = factory(ctx)

    def call(self, method: str, args: tuple, kwargs: dict) -> Any:
        return getattr(self.worker, method)(*args, **kwargs)

    def close(self) -> None:
        close = getattr(self.worker, "close", None)
        if close is not None:
            close()


# ---------------------------------------------------------------- the driver's side

@dataclass(frozen=True)
class GroupSpec:
    """One group of `start_groups`: `size` workers built by `factory(ctx)`, each with its own share."""

    name: str
    factory: Callable[[WorkerContext], Any]
    size: int = 1
    cpus_per_worker: float = 1
    gpus_per_worker: float = 0
    # False: these workers join no torch.distributed world (ctx.group None). vLLM samplers need that: an engine
    # adopts a world it finds and makes collective calls over it that the other groups never make.
    join_world: bool = True
    # Ray custom resources each worker reserves beside its CPUs and GPUs (in its placement bundle): only nodes that
    # have them can hold it, which is how a group goes to chosen nodes, e.g. {"trainer_node": 1}
    resources: dict[str, float] = field(default_factory=dict)
    resources_from: str = "resources"  # the setting they come from, for messages (placement.train_resources)


class PlacementError(ValueError):
    """The Ray cluster cannot hold the workers asked for: none started, so the run trained and saved nothing. A
    ValueError, as a config's are: the command line reports it in one line, with no --resume to suggest."""


class _Gang:
    """The groups started together: they share actors' fate (a failure kills them all) and the Ray session."""

    def __init__(self, owns_ray: bool):
        self.owns_ray = owns_ray
        self.groups: list[RayWorkerGroup] = []
        self.broken: str | None = None
        self.lock = threading.Lock()
        self.in_flight: weakref.WeakSet[RayPending] = weakref.WeakSet()  # calls the controller may still wait on

    def death_elsewhere(self, besides: RayPending) -> tuple[RayPending, int, BaseException] | None:
        """A worker that died in another call in flight (waiting up to FAILURE_GRACE_S for one to show): when a
        call fails because its peer died (a sampler waiting for weights from a dead trainer), the death is the
        cause to report."""
        ray = import_ray()
        refs = {ref: (p, i) for p in list(self.in_flight) if p is not besides for ref, i in p._waiting.items()}
        deadline = time.monotonic() + FAILURE_GRACE_S
        while refs:
            ready, _ = ray.wait(list(refs), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                return None
            p, i = refs.pop(ready[0])
            try:
                ray.get(ready[0])
            except Exception as exc:
                if _describe(exc)[0] == "died":
                    return p, i, exc
        return None

    def fail(self, reason: str) -> None:
        """Kill every actor: survivors may sit in a collective waiting for the failed one, forever."""
        ray = import_ray()
        with self.lock:
            if self.broken is not None:
                return
            self.broken = reason
        for g in self.groups:
            for actor in g.actors:
                try:
                    ray.kill(actor, no_restart=True)
                except Exception:  # already gone
                    pass

    def released(self) -> None:
        with self.lock:
            last = all(g.closed for g in self.groups)
        if last and self.owns_ray:
            self.owns_ray = False
            _release_ray()


def _settled(actor: Any, exc: BaseException, wait_s: float = UNREACHABLE_GRACE_S) -> BaseException:
    """What became of an actor Ray called unavailable (its node stopped answering): Ray's verdict once its health
    checks settle it, asked by calling the actor (a dead one's call fails with the cause); `exc` itself if the actor
    answers, or nothing is settled within `wait_s`."""
    ray = import_ray()
    if not isinstance(exc, ray.exceptions.ActorUnavailableError):
        return exc
    deadline = time.monotonic() + wait_s
    while (left := deadline - time.monotonic()) > 0:
        try:
            ray.get(actor.address.remote(), timeout=left)
            return exc  # it answers: the call was lost on the way
        except ray.exceptions.ActorUnavailableError:
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
        except ray.exceptions.GetTimeoutError:
            return exc
        except Exception as verdict:
            return verdict
    return exc


def _describe(exc: BaseException) -> tuple[str, str]:
    """('died' or 'failed', one line): the remote traceback's last line, or why the actor's process ended."""
    ray = import_ray()
    exceptions = ray.exceptions
    if isinstance(exc, exceptions.ActorUnavailableError):  # not declared dead (yet): say no more than Ray knows
        text = " ".join(str(exc).split())
        return "died", f"unreachable (its process or its node stopped answering): {text[:200]}"
    if isinstance(exc, exceptions.RayTaskError):
        lines = [line for line in str(exc).splitlines() if line.strip()]
        return "failed", lines[-1].strip() if lines else type(exc).__name__
    if isinstance(exc, (exceptions.RayActorError, exceptions.WorkerCrashedError, exceptions.OutOfMemoryError)):
        # Ray's message is a page long; keep the process and Ray's reason, which name the cause well enough.
        text = " ".join(str(exc).split())
        pid, ip = re.search(r"\bpid: (\d+)", text), re.search(r"\bip: (\S+)", text)
        detail = re.search(r"exit detail: (.+?\.)(?: |$)", text)
        where = f"process {pid.group(1)}" + (f" on {ip.group(1)}" if ip else "") if pid else "its process"
        node = re.search(r"its node has died\. Node Id: (\w+)\s*(.*)", text)
        if node:  # the whole node went (machine, raylet): which one, and why Ray thinks so
            why = f" ({node.group(2)[:200]})" if node.group(2) else ""
            return "died", f"{where} ended: its node {node.group(1)} died{why}"
        return "died", f"{where} ended: {detail.group(1) if detail else text[:200]}"
    return "failed", f"{type(exc).__name__}: {exc}"


class RayPending:
    """Futures of one call on some workers; `get` returns results in rank order or raises WorkerError."""

    def __init__(self, gang: _Gang, method: str, entries: list[tuple[RayWorkerGroup, int, Any]],
                 call_timeout_s: float | None):
        self.gang, self.method = gang, method
        self._entries = entries
        self._waiting = {ref: i for i, (_, _, ref) in enumerate(entries)}
        self._results: list[Any] = [None] * len(entries)
        self._error: WorkerError | None = None
        self._started = time.monotonic()
        self._deadline = None if call_timeout_s is None else self._started + call_timeout_s
        gang.in_flight.add(self)

    def _poll(self, until: float | None) -> bool:
        """Collect finished futures until all are in, one has failed, or `until` passes; True when settled."""
        ray = import_ray()
        while self._waiting and self._error is None:
            left = None if until is None else max(0.0, until - time.monotonic())
            # num_returns=1: the first failure is seen at once, even while other workers stay blocked.
            ready, _ = ray.wait(list(self._waiting), num_returns=1, timeout=left)
            if not ready:
                return False
            failures = self._collect(ready)
            if failures and self._waiting:
                # A worker's death often surfaces first as a peer's collective error (connection closed): give
                # the others a moment, so that the death, the cause, is what gets reported.
                more, _ = ray.wait(list(self._waiting), num_returns=len(self._waiting), timeout=FAILURE_GRACE_S)
                failures += self._collect(more)
            if failures:
                self._fail(failures)
        return True

    def _collect(self, ready: list[Any]) -> list[tuple[int, BaseException]]:
        ray = import_ray()
        failures = []
        for ref in ready:
            i = self._waiting.pop(ref)
            try:
                self._results[i] = ray.get(ref)
            except Exception as exc:
                failures.append((i, exc))
        return failures

    def _fail(self, failures: list[tuple[int, BaseException]]) -> None:
        described = [(i, exc, *_describe(exc)) for i, exc in failures]
        i, exc, kind, line = next((d for d in described if d[2] == "died"), described[0])
        group, rank, _ = self._entries[i]
        earlier = self.gang.broken
        if earlier is not None:
            msg = f"worker {rank}/{group.size} of {group.name!r} was stopped in {self.method} by an earlier failure: {earlier}"
        else:
            exc = _settled(group.actors[rank], exc)
            kind, line = _describe(exc)
            msg = f"worker {rank}/{group.size} of {group.name!r} {kind} in {self.method}: {line}"
            if len(failures) > 1:
                msg += f" (and {len(failures) - 1} more of this call's workers failed)"
            death = None if kind == "died" else self.gang.death_elsewhere(self)
            if death is not None:
                other, j, exc = death
                dead_group, dead_rank, _ = other._entries[j]
                exc = _settled(dead_group.actors[dead_rank], exc)
                msg = (f"worker {dead_rank}/{dead_group.size} of {dead_group.name!r} died in {other.method}: "
                       f"{_describe(exc)[1]} (then {msg})")
            self.gang.fail(msg)
        self._error = WorkerError(msg)
        self._error.__cause__ = exc

    def _time_out(self) -> None:
        running = {}
        for i in self._waiting.values():
            group, rank, _ = self._entries[i]
            running.setdefault(group.name, []).append(rank)
        which = "; ".join(f"ranks {sorted(r)} of {n!r}" for n, r in running.items())
        elapsed = time.monotonic() - self._started
        msg = f"{self.method} timed out after {elapsed:.0f} s; still running: {which}"
        self.gang.fail(msg)
        self._error = WorkerError(msg)

    def done(self) -> bool:
        if self._error is None and not self._poll(time.monotonic()):
            if self._deadline is not None and time.monotonic() >= self._deadline:
                self._time_out()
                return True
            return False
        return True

    def get(self, timeout: float | None = None) -> list[Any]:
        until = None if timeout is None else time.monotonic() + timeout
        # ray.wait may return a hair early: decide up front whether this wait ends at the call's deadline.
        at_deadline = self._deadline is not None and (until is None or self._deadline <= until)
        if at_deadline:
            until = self._deadline
        if self._error is None and not self._poll(until):
            if at_deadline:
                self._time_out()
            else:
                raise TimeoutError(f"{self.method} still running after {timeout} s")
        if self._error is not None:
            raise self._error
        return list(self._results)


class RayWorkerGroup:
    """`size` workers as Ray actors in one placement group; called exactly like LocalWorkerGroup.

    Build them with `start_groups`: several groups share one torch.distributed world.
    """

    def __init__(self, gang: _Gang, spec: GroupSpec, actors: list[Any], placement: Any, global_ranks: list[int],
                 call_timeout_s: float | None):
        self.gang, self.name, self.size = gang, spec.name, spec.size
        self.actors, self.placement, self.global_ranks = actors, placement, global_ranks
        self.call_timeout_s = call_timeout_s
        self.closed = False

    def _check(self, method: str) -> None:
        if self.closed:
            raise WorkerError(f"{method} on {self.name!r}: the group is shut down")
        if self.gang.broken is not None:
            raise WorkerError(f"{method} on {self.name!r}: the group is unusable since a failure killed its "
                              f"workers ({self.gang.broken})")

    def _pending(self, method: str, refs: list[Any]) -> RayPending:
        entries = [(self, rank, ref) for rank, ref in enumerate(refs)]
        return RayPending(self.gang, method, entries, self.call_timeout_s)

    def _shared(self, value: tuple | dict) -> Any:
        """A call's positional tuple or keyword dict as it goes to every actor: a large one as one object-store ref
        (serialized and stored once, where Ray would store a copy per actor's call; Ray hands each actor the value
        behind a ref given as an argument), a small one inline."""
        if len(self.actors) < 2 or not value or not _pickles_beyond(value, SHARED_ARGS_MIN_BYTES):
            return value
        return import_ray().put(value)

    def submit(self, method: Method, *args: Any, **kwargs: Any) -> RayPending:
        method = method_name(method)
        self._check(method)
        args, kwargs = self._shared(args), self._shared(kwargs)
        return self._pending(method, [a.call.remote(method, args, kwargs) for a in self.actors])

    def submit_side(self, method: Method, *args: Any, **kwargs: Any) -> RayPending:
        """Like submit, but on each actor's side lane: it runs while a main-lane call is still working (one side
        call at a time). Asynchronous sampling receives weights this way while the sampler generates."""
        method = method_name(method)
        self._check(method)
        args, kwargs = self._shared(args), self._shared(kwargs)
        return self._pending(method, [a.call.options(concurrency_group=SIDE_LANE).remote(method, args, kwargs)
                                      for a in self.actors])

    def submit_each(self, method: Method, per_worker_args: Sequence[tuple]) -> RayPending:
        method = method_name(method)
        if len(per_worker_args) != self.size:
            raise ValueError(f"call_each({method}): {len(per_worker_args)} argument tuples for {self.size} workers")
        self._check(method)
        return self._pending(method, [a.call.remote(method, tuple(args), {})
                                      for a, args in zip(self.actors, per_worker_args)])

    def free_address(self, rank: int = 0) -> tuple[str, int]:
        """The node address of worker `rank` and a port free there: a rendezvous for a group of the workers' own
        (the weight channel, hosted by that worker)."""
        self._check("free_address")
        return RayPending(self.gang, "free_address", [(self, rank, self.actors[rank].address.remote())],
                          self.call_timeout_s).get()[0]

    def call(self, method: Method, *args: Any, **kwargs: Any) -> list[Any]:
        return self.submit(method, *args, **kwargs).get()

    def call_each(self, method: Method, per_worker_args: Sequence[tuple]) -> list[Any]:
        return self.submit_each(method, per_worker_args).get()

    def shutdown(self) -> None:
        """Close the workers (best effort, bounded), kill the actors, free the placement, and stop Ray if the
        group started it and no group started with it is still up. Workers still running a call (one a stop
        abandoned: samples nobody will use) are killed without a close, which would wait behind that call."""
        if self.closed:
            return
        ray = import_ray()
        if self.gang.broken is None and not self._busy():
            refs = [a.close.remote() for a in self.actors]
            ray.wait(refs, num_returns=len(refs), timeout=CLOSE_TIMEOUT_S)
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:
                pass
        try:
            ray.util.remove_placement_group(self.placement)
        except Exception:
            pass
        self.closed = True
        self.gang.released()

    def _busy(self) -> bool:
        ray = import_ray()
        refs = [ref for p in list(self.gang.in_flight) for ref, i in list(p._waiting.items())
                if p._entries[i][0] is self]
        return bool(refs) and len(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) < len(refs)

    def __repr__(self) -> str:
        return f"RayWorkerGroup({self.name!r}, size={self.size}, global_ranks={self.global_ranks})"


class _Full(Exception):
    pass


class _CountingSink:
    """A file for a pickler that keeps nothing and stops it once more than `limit` bytes were written."""

    def __init__(self, limit: int):
        self.left = limit

    def write(self, data: Any) -> int:
        n = memoryview(data).nbytes
        self.left -= n
        if self.left < 0:
            raise _Full
        return n


def _pickles_beyond(value: Any, limit: int) -> bool:
    """Whether `value` pickles to more than `limit` bytes, at the cost of pickling at most about `limit` of them.
    A value this pickler refuses (one only Ray's serializer knows) counts as small: it goes inline, as before."""
    from ray import cloudpickle

    try:
        cloudpickle.Pickler(_CountingSink(limit), protocol=5).dump(value)
    except _Full:
        return True
    except Exception:
        return False
    return False


def _code_paths() -> list[str]:
    """Folders the actors need on their path to import what the driver imports: this checkout's `tandem` first,
    then the driver's own additions (a test's folder), but not the interpreter's or the environment's."""
    import tandem

    system = {Path(p).resolve() for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    paths = [str(Path(tandem.__file__).resolve().parents[1])]
    for entry in sys.path:
        if not entry or not os.path.isdir(entry):
            continue
        resolved = Path(entry).resolve()
        if any(resolved == s or s in resolved.parents for s in system) or str(resolved) in paths:
            continue
        paths.append(str(resolved))
    return paths


def _runtime_env(cpus: float, user: dict | None) -> dict:
    env = dict(user or {})
    env_vars = dict(env.get("env_vars") or {})
    extra = [p for p in env_vars.get("PYTHONPATH", os.environ.get("PYTHONPATH", "")).split(os.pathsep) if p]
    env_vars["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(_code_paths() + extra))
    # Set before the worker process starts, so that every OpenMP runtime it loads sees it.
    env_vars.setdefault("OMP_NUM_THREADS", str(max(1, int(cpus))))
    env["env_vars"] = env_vars
    return env


def start_groups(specs: Sequence[GroupSpec | tuple], *, backend: str | None = "auto", address: str | None = None,
                 pg_timeout_s: float = 600.0, placement_timeout_s: float = 120.0,
                 call_timeout_s: float | None = None, setup_timeout_s: float | None = None,
                 num_cpus: float | None = None, num_gpus: int | None = None, temp_dir: str | None = None,
                 log_to_driver: bool = True, object_store_memory: int | None = None,
                 runtime_env: dict | None = None) -> list[RayWorkerGroup]:
    """Start several worker groups that share one torch.distributed world.

    Global ranks run group after group (trainers 0..T-1, then samplers T..T+R-1); groups with `join_world=False`
    come last and join no world (their global ranks still number them, e.g. as ranks of a weight channel), the
    others form a world of their own ranks. `backend`: "auto" (gloo on
    CPU; with GPUs nccl for CUDA tensors and gloo for host ones, on which the trainer reduces its counts and stats
    and the resharding handshake runs), a torch.distributed backend name, or None for no process group. Each
    group's `ctx.group` is its own subgroup (the WORLD group when there is one group). Ray: `address` joins a
    running cluster; otherwise a local one is started on 127.0.0.1 (`num_cpus` defaults to what the groups
    ask for) and shut down with the last group. A failure anywhere kills every actor of every group started here.
    """
    ray = import_ray()
    specs = _checked_specs(specs)
    if backend == "auto":
        backend = "gloo" if not any(s.gpus_per_worker > 0 for s in specs) else "cpu:gloo,cuda:nccl"
    if num_cpus is None:
        num_cpus = sum(s.size * s.cpus_per_worker for s in specs)
    owns = _acquire_ray(address, num_cpus, num_gpus, temp_dir, log_to_driver, object_store_memory)
    gang = _Gang(owns)
    placements: list[Any] = []
    try:
        _check_resources(specs, fixed=owns and address is None)
        _place(specs, placement_timeout_s, placements)
        _start_actors(gang, specs, placements, call_timeout_s, runtime_env)
        _set_up(gang, specs, backend, pg_timeout_s, setup_timeout_s)
    except BaseException:
        gang.fail("start_groups did not finish")
        for placement in placements:
            try:
                ray.util.remove_placement_group(placement)
            except Exception:
                pass
        if owns:
            _release_ray()
        raise
    return gang.groups


def _checked_specs(specs: Sequence[GroupSpec | tuple]) -> list[GroupSpec]:
    specs = [s if isinstance(s, GroupSpec) else GroupSpec(*s) for s in specs]
    names = [s.name for s in specs]
    if not specs or len(set(names)) != len(names) or any(s.size < 1 for s in specs):
        raise ValueError(f"start_groups needs groups with distinct names and sizes ≥ 1, got {specs}")
    joined = [s.join_world for s in specs]
    if joined != sorted(joined, reverse=True):  # the world's ranks are then the first global ranks
        raise ValueError(f"start_groups: groups with join_world=False must come after the others, got {names}")
    for s in specs:
        if any(k in ("CPU", "GPU") or not v > 0 for k, v in s.resources.items()):
            raise ValueError(f"start_groups: group {s.name!r} resources {s.resources} must be positive custom "
                             "resources (CPUs and GPUs are cpus_per_worker and gpus_per_worker)")
    return specs


def _place(specs: list[GroupSpec], timeout_s: float, placements: list[Any]) -> None:
    """A placement group per group, one bundle per worker, all reserved before any actor starts; appended to
    `placements` as each is asked for, so that a failure frees those made."""
    ray = import_ray()
    from ray.util.placement_group import placement_group

    bundles = {s.name: {"CPU": s.cpus_per_worker, **({"GPU": s.gpus_per_worker} if s.gpus_per_worker else {}),
                        **s.resources} for s in specs}
    for s in specs:
        placements.append(placement_group([dict(bundles[s.name]) for _ in range(s.size)], strategy="PACK"))
    ready, _ = ray.wait([p.ready() for p in placements], num_returns=len(placements), timeout=timeout_s)
    if len(ready) != len(placements):
        asked = "; ".join(f"{s.name}: {s.size} x {bundles[s.name]}" for s in specs)
        raise PlacementError(f"could not place {asked} within {timeout_s:.0f} s; the cluster has "
                             f"{ray.available_resources()} free. No worker started: this run trained and saved "
                             "nothing")


def _check_resources(specs: list[GroupSpec], fixed: bool) -> None:
    """A custom resource that no live node has enough of for one worker: refused at once where the cluster's nodes
    are `fixed` (the Ray tandem started on this machine), before any wait; on a cluster of one's own, warned about,
    and then waited for (an autoscaler may yet add a node that has it)."""
    ray = import_ray()
    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    for s in specs:
        lacking = {k: v for k, v in s.resources.items() if not any(node.get(k, 0) >= v for node in nodes)}
        if not lacking:
            continue
        custom = sorted({k for node in nodes for k in node if k not in ("CPU", "GPU", "memory", "object_store_memory")})
        what = (f"{s.resources_from}: {lacking} (each {s.name} worker's), but no node of the Ray cluster has "
                f"{'that' if len(lacking) == 1 else 'those'}; its nodes have {custom or 'no custom resources'}")
        if fixed:
            raise PlacementError(f"{what}. The Ray tandem starts on this machine has no custom resource but its "
                                 f"node's own: start a cluster whose nodes have it (ray start --resources=...) and set "
                                 f"placement.ray_address, or remove it from {s.resources_from}. No worker started: "
                                 "this run trained and saved nothing")
        log.warning("%s; waiting for one that has (an autoscaler may add it)", what)


def _start_actors(gang: _Gang, specs: list[GroupSpec], placements: list[Any], call_timeout_s: float | None,
                  runtime_env: dict | None) -> None:
    """An actor per worker in its bundle, numbered group after group; the groups go into `gang.groups`."""
    ray = import_ray()
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    host = ray.remote(concurrency_groups={SIDE_LANE: 1})(_Host)
    first = 0
    for s, placement in zip(specs, placements):
        actors = [host.options(num_cpus=s.cpus_per_worker, num_gpus=s.gpus_per_worker, max_restarts=0,
                               runtime_env=_runtime_env(s.cpus_per_worker, runtime_env),
                               scheduling_strategy=PlacementGroupSchedulingStrategy(
                                   placement, placement_group_bundle_index=i)).remote(s.cpus_per_worker,
                                                                                      s.gpus_per_worker)
                  for i in range(s.size)]
        gang.groups.append(RayWorkerGroup(gang, s, actors, placement, list(range(first, first + s.size)),
                                          call_timeout_s))
        first += s.size


def _set_up(gang: _Gang, specs: list[GroupSpec], backend: str | None, pg_timeout_s: float,
            setup_timeout_s: float | None) -> None:
    """Every actor joins the world (those of join_world groups, at the first actor's address) and builds its
    worker; returns once all have."""
    first_group = gang.groups[0]
    master = RayPending(gang, "address", [(first_group, 0, first_group.actors[0].address.remote())],
                        setup_timeout_s).get()[0]
    group_ranks = {g.name: g.global_ranks for g in gang.groups}
    world = sum(s.size for s in specs if s.join_world)
    order = [(s.name, group_ranks[s.name]) for s in specs if s.join_world]
    entries = []
    for g, s in zip(gang.groups, specs):
        for rank, actor in enumerate(g.actors):
            ctx = WorkerContext(rank=rank, size=s.size, global_rank=g.global_ranks[rank], world_size=world,
                                group_ranks=group_ranks, name=s.name)
            ref = actor.setup.remote(s.factory, ctx, backend if s.join_world else None, master, pg_timeout_s,
                                     order)
            entries.append((g, rank, ref))
    RayPending(gang, "setup", entries, setup_timeout_s).get()
