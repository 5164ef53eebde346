"""Worker groups: the controller's one way to reach workers, whether they live in this process or on Ray."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Protocol, Sequence, TypeVar

R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)
# A worker method, named by the role's method itself (`TrainWorker.prepare`: renames and typos fail where they are
# written, and the call reads as what it runs) or by its name.
Method = Callable[..., Any] | str


def method_name(method: Method) -> str:
    return method if isinstance(method, str) else method.__name__


@dataclass
class WorkerContext:
    """Where a worker sits: handed to every worker factory, by every backend.

    `group` is the torch.distributed process group of this worker group's members (None when the group has one
    worker and no process group was started). Several groups started together (split placement: trainers and
    samplers) share one default process group of `world_size` ranks; `group_ranks` names each group's global
    ranks, in group-rank order, so code that spans groups (weight broadcast) can address the others. A group
    started outside that world (Ray's `join_world=False`: vLLM samplers) has `group` None; its global ranks come
    after the world's `world_size` ranks and number it for a weight channel of its own.
    """

    rank: int = 0
    size: int = 1
    global_rank: int = 0
    world_size: int = 1
    group: Any = None
    group_ranks: dict[str, list[int]] = field(default_factory=dict)
    name: str = "workers"
    device: str = "cpu"


class WorkerError(RuntimeError):
    """A worker failed; the message names the worker and the method (the phase) it was running."""


class Pending(Protocol[R_co]):
    """Work in flight: a call on every worker of a group (its result: one per worker, in rank order), or what the
    controller makes of one (`Mapped`). Asynchronous sampling overlaps it with training."""

    def done(self) -> bool:
        """Whether `get` would return (or raise) at once."""
        ...

    def get(self, timeout: float | None = None) -> R_co:
        """The result; raises WorkerError if a worker failed, TimeoutError if `timeout` seconds pass first (the
        call keeps running)."""
        ...


class Mapped(Generic[R]):
    """A Pending whose result is `fn` of another's (the placement merges its samplers' shares this way)."""

    def __init__(self, pending: Pending, fn: Callable[[Any], R]):
        self.pending, self.fn = pending, fn

    def done(self) -> bool:
        return self.pending.done()

    def get(self, timeout: float | None = None) -> R:
        return self.fn(self.pending.get(timeout))


class Completed:
    """A Pending that finished when it was made: the local backend runs calls eagerly."""

    def __init__(self, results: list[Any] | None = None, error: WorkerError | None = None):
        self.results, self.error = results, error

    def done(self) -> bool:
        return True

    def get(self, timeout: float | None = None) -> list[Any]:
        if self.error is not None:
            raise self.error
        return list(self.results or [])


class WorkerGroup(Protocol):
    """Workers of one role, local or on Ray: everything the placement calls on them."""

    size: int
    global_ranks: list[int]  # each worker's rank in the run's numbering (the weight channel's ranks)

    def call(self, method: Method, *args: Any, **kwargs: Any) -> list[Any]:
        """Run `method(*args, **kwargs)` on every worker; one result per worker, in rank order."""
        ...

    def call_each(self, method: Method, per_worker_args: Sequence[tuple]) -> list[Any]:
        """Run `method(*per_worker_args[rank])` on each worker; one result per worker, in rank order."""
        ...

    def submit(self, method: Method, *args: Any, **kwargs: Any) -> Pending[list[Any]]:
        """Start `call(method, ...)` and return at once; `call` is `submit(...).get()`. Each worker runs its
        calls in the order they were submitted."""
        ...

    def submit_side(self, method: Method, *args: Any, **kwargs: Any) -> Pending[list[Any]]:
        """Like submit, but on each worker's side lane: it may run while a main-lane call is still working (the
        samplers receive weights this way while they generate)."""
        ...

    def submit_each(self, method: Method, per_worker_args: Sequence[tuple]) -> Pending[list[Any]]:
        """Start `call_each(method, ...)` and return at once."""
        ...

    def free_address(self, rank: int = 0) -> tuple[str, int]:
        """Worker `rank`'s host and a port free there: the rendezvous of a group of the workers' own."""
        ...

    def shutdown(self) -> None:
        ...


def local_device() -> str:
    """The device of the local backend's one worker: the visible GPU when there is one (CUDA_VISIBLE_DEVICES=""
    keeps a run on the CPU), else the CPU. Ray workers get theirs from placement.gpus_per_worker."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


class LocalWorkerGroup:
    """Workers as plain objects in this process (the embedded default is this with size 1)."""

    def __init__(self, factory: Callable[[WorkerContext], Any], size: int = 1, name: str = "workers"):
        if size != 1:
            raise ValueError("the local backend runs one worker; use placement.backend: ray for more")
        self.size, self.global_ranks = size, [0]
        self.workers = [factory(WorkerContext(name=name, group_ranks={name: [0]}, device=local_device()))]

    def _run(self, rank: int, method: Method, args: tuple, kwargs: dict) -> Any:
        name = method_name(method)
        try:
            return getattr(self.workers[rank], name)(*args, **kwargs)
        except Exception as exc:
            raise WorkerError(f"worker {rank}/{self.size} failed in {name}: {exc!r}") from exc

    def call(self, method: Method, *args: Any, **kwargs: Any) -> list[Any]:
        return [self._run(r, method, args, kwargs) for r in range(self.size)]

    def call_each(self, method: Method, per_worker_args: Sequence[tuple]) -> list[Any]:
        if len(per_worker_args) != self.size:
            raise ValueError(f"call_each({method_name(method)}): {len(per_worker_args)} argument tuples for "
                             f"{self.size} workers")
        return [self._run(r, method, tuple(a), {}) for r, a in enumerate(per_worker_args)]

    def submit(self, method: Method, *args: Any, **kwargs: Any) -> Completed:
        try:
            return Completed(self.call(method, *args, **kwargs))
        except WorkerError as exc:
            return Completed(error=exc)

    submit_side = submit  # calls run at once here: there is no lane to overlap

    def submit_each(self, method: Method, per_worker_args: Sequence[tuple]) -> Completed:
        try:
            return Completed(self.call_each(method, per_worker_args))
        except WorkerError as exc:
            return Completed(error=exc)

    def free_address(self, rank: int = 0) -> tuple[str, int]:
        from tandem.util.net import free_address

        return free_address()

    def shutdown(self) -> None:
        for w in self.workers:
            close = getattr(w, "close", None)
            if close:
                close()
        self.workers = []
