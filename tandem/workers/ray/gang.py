"""Started Ray groups as the controller calls them: `RayWorkerGroup`, its calls in flight, their failures told.

The groups started together are one gang: they share one fate (a failure kills them all) and the Ray session."""
from __future__ import annotations

import re
import threading
import time
import weakref
from typing import Any, Sequence

from tandem.workers.group import Method, WorkerError, method_name
from tandem.workers.ray.actor import SIDE_LANE
from tandem.workers.ray.session import import_ray, release_ray

CLOSE_TIMEOUT_S = 10.0  # a worker's close() is best effort: a hung one must not hang shutdown
FAILURE_GRACE_S = 2.0  # after a first failure, how long the other workers' outcomes may take to arrive
# A worker on a node that went down is first only "unavailable" to Ray: its node is declared dead once its health
# checks fail (about 15 s at Ray's defaults). The report waits that long, at most, to say which it was.
UNREACHABLE_GRACE_S = 30.0
# A call's arguments at least this large (pickled) go to a group's actors as one object-store ref: Ray inlines
# smaller ones in each call (its max_direct_call_object_size, 100 KiB), which is cheaper than a put and a fetch.
SHARED_ARGS_MIN_BYTES = 100 * 1024


class Gang:
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
            release_ray()


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

    def __init__(self, gang: Gang, method: str, entries: list[tuple[RayWorkerGroup, int, Any]],
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
            msg = (f"worker {rank}/{group.size} of {group.name!r} was stopped in {self.method} "
                   f"by an earlier failure: {earlier}")
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

    def __init__(self, gang: Gang, name: str, actors: list[Any], placement: Any, global_ranks: list[int],
                 call_timeout_s: float | None):
        self.gang, self.name, self.size = gang, name, len(actors)
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
