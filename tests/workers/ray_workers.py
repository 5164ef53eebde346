"""A small worker for the Ray worker-group tests: reports where it sits and runs collectives on request."""
from __future__ import annotations

import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist

from tandem.workers.group import WorkerContext


class ProbeWorker:
    def __init__(self, ctx: WorkerContext, marker_dir: str | None = None):
        self.ctx, self.marker_dir = ctx, marker_dir

    def info(self) -> dict:
        import tandem

        c = self.ctx
        return dict(rank=c.rank, size=c.size, global_rank=c.global_rank, world_size=c.world_size, name=c.name,
                    group_ranks=c.group_ranks, device=c.device, pid=os.getpid(), threads=torch.get_num_threads(),
                    omp=os.environ.get("OMP_NUM_THREADS"), tandem=tandem.__file__,
                    group_is_world=c.group is dist.group.WORLD, in_a_world=dist.is_initialized())

    def add(self, x: int, y: int = 0) -> int:
        return x + y + 100 * self.ctx.rank

    def total(self, values: list, offset: int = 0) -> int:
        return sum(values) + offset + 100 * self.ctx.rank

    def all_reduce(self, value: float, world: bool = False) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, group=None if world else self.ctx.group)
        return t.item()

    def broadcast_from(self, src: int, value: float) -> float:
        """Over the default (world) group: the global rank `src` sends `value` to every other rank."""
        t = torch.tensor([value if self.ctx.global_rank == src else -1.0], dtype=torch.float64)
        dist.broadcast(t, src=src)
        return t.item()

    def raise_on(self, rank: int) -> int:
        if self.ctx.rank == rank:
            raise ValueError(f"boom on rank {rank}")
        return self.ctx.rank

    def exit_on(self, rank: int) -> float:
        """`rank` ends its process mid-method while the others wait for it in a collective."""
        if self.ctx.rank == rank:
            time.sleep(0.5)
            os._exit(1)
        return self.all_reduce(1.0)

    def sleep(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.ctx.rank

    def close(self) -> None:
        if self.marker_dir:
            Path(self.marker_dir, f"closed-{self.ctx.name}-{self.ctx.rank}").write_text("")


def start_group(name: str, factory, size: int = 1, *, cpus_per_worker: float = 1, gpus_per_worker: float = 0,
                **options):
    """One group alone: `start_groups` with one spec (its `ctx.group` is the WORLD group)."""
    from tandem.workers.ray.group import GroupSpec, start_groups

    return start_groups([GroupSpec(name, factory, size, cpus_per_worker, gpus_per_worker)], **options)[0]


@contextmanager
def ray_session(*, address: str | None = None, num_cpus: float | None = None, num_gpus: int | None = None,
                temp_dir: str | None = None, log_to_driver: bool = True,
                object_store_memory: int | None = None) -> Iterator[None]:
    """Hold one Ray session across several tests' `start_groups` (each ray.init costs seconds); shut down on exit
    if this opened it."""
    from tandem.workers.ray.session import acquire_ray, release_ray

    owned = acquire_ray(address, num_cpus, num_gpus, temp_dir, log_to_driver, object_store_memory)
    try:
        yield
    finally:
        if owned:
            release_ray()
