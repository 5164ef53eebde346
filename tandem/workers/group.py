"""Worker groups: the controller's one way to reach workers, whether they live in this process or on Ray."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence


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


class Pending(Protocol):
    """A call in flight on every worker of a group (asynchronous sampling overlaps it with training)."""

    def done(self) -> bool:
        """Whether `get` would return (or raise) at once."""
        ...

    def get(self, timeout: float | None = None) -> list[Any]:
        """One result per worker, in rank order; raises WorkerError if a worker failed, TimeoutError if
        `timeout` seconds pass first (the call keeps running)."""
        ...


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
    size: int

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Run `method(*args, **kwargs)` on every worker; one result per worker, in rank order."""
        ...

    def call_each(self, method: str, per_worker_args: Sequence[tuple]) -> list[Any]:
        """Run `method(*per_worker_args[rank])` on each worker; one result per worker, in rank order."""
        ...

    def submit(self, method: str, *args: Any, **kwargs: Any) -> Pending:
        """Start `call(method, ...)` and return at once; `call` is `submit(...).get()`."""
        ...

    def submit_each(self, method: str, per_worker_args: Sequence[tuple]) -> Pending:
        """Start `call_each(method, ...)` and return at once."""
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
        self.size = size
        self.workers = [factory(WorkerContext(name=name, group_ranks={name: [0]}, device=local_device()))]

    def _run(self, rank: int, method: str, args: tuple, kwargs: dict) -> Any:
        try:
            return getattr(self.workers[rank], method)(*args, **kwargs)
        except Exception as exc:
            raise WorkerError(f"worker {rank}/{self.size} failed in {method}: {exc!r}") from exc

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return [self._run(r, method, args, kwargs) for r in range(self.size)]

    def call_each(self, method: str, per_worker_args: Sequence[tuple]) -> list[Any]:
        if len(per_worker_args) != self.size:
            raise ValueError(f"call_each({method}): {len(per_worker_args)} argument tuples for {self.size} workers")
        return [self._run(r, method, tuple(a), {}) for r, a in enumerate(per_worker_args)]

    def submit(self, method: str, *args: Any, **kwargs: Any) -> Completed:
        try:
            return Completed(self.call(method, *args, **kwargs))
        except WorkerError as exc:
            return Completed(error=exc)

    def submit_each(self, method: str, per_worker_args: Sequence[tuple]) -> Completed:
        try:
            return Completed(self.call_each(method, per_worker_args))
        except WorkerError as exc:
            return Completed(error=exc)

    def shutdown(self) -> None:
        for w in self.workers:
            close = getattr(w, "close", None)
            if close:
                close()
        self.workers = []
