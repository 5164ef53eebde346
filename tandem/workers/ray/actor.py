"""What runs inside each Ray actor (`WorkerHost`), and the environment its process starts with."""
from __future__ import annotations

import os
import socket
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

from tandem.util.net import free_address
from tandem.workers.group import WorkerContext


def _loopback_ifname() -> str | None:
    return next((name for _, name in socket.if_nameindex() if name.startswith("lo")), None)


SIDE_LANE = "side"  # a second call lane per actor (see RayWorkerGroup.submit_side)


class WorkerHost:
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


def actor_runtime_env(cpus: float, user: dict | None) -> dict:
    """The runtime_env an actor of `cpus` CPUs starts with: the user's (`user`), this checkout and the driver's
    folders on its PYTHONPATH, and its OpenMP threads."""
    env = dict(user or {})
    env_vars = dict(env.get("env_vars") or {})
    extra = [p for p in env_vars.get("PYTHONPATH", os.environ.get("PYTHONPATH", "")).split(os.pathsep) if p]
    env_vars["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(_code_paths() + extra))
    # Set before the worker process starts, so that every OpenMP runtime it loads sees it.
    env_vars.setdefault("OMP_NUM_THREADS", str(max(1, int(cpus))))
    env["env_vars"] = env_vars
    return env
