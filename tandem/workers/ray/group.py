"""The `ray` worker-group backend: workers as Ray actors in placement groups, joined by one torch.distributed world.

Here the groups are placed and started (`start_groups`); below it, `gang` holds the started groups as the controller
calls them, `actor` what runs inside each actor, `session` the Ray session and its reaper (`reaper.py`).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from tandem.workers.group import WorkerContext
from tandem.workers.ray.actor import SIDE_LANE, WorkerHost, actor_runtime_env
from tandem.workers.ray.gang import Gang, RayPending, RayWorkerGroup
from tandem.workers.ray.session import acquire_ray, import_ray, release_ray

log = logging.getLogger("tandem.workers.ray.group")


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
    owns = acquire_ray(address, num_cpus, num_gpus, temp_dir, log_to_driver, object_store_memory)
    gang = Gang(owns)
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
            release_ray()
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


def _start_actors(gang: Gang, specs: list[GroupSpec], placements: list[Any], call_timeout_s: float | None,
                  runtime_env: dict | None) -> None:
    """An actor per worker in its bundle, numbered group after group; the groups go into `gang.groups`."""
    ray = import_ray()
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    host = ray.remote(concurrency_groups={SIDE_LANE: 1})(WorkerHost)
    first = 0
    for s, placement in zip(specs, placements):
        actors = [host.options(num_cpus=s.cpus_per_worker, num_gpus=s.gpus_per_worker, max_restarts=0,
                               runtime_env=actor_runtime_env(s.cpus_per_worker, runtime_env),
                               scheduling_strategy=PlacementGroupSchedulingStrategy(
                                   placement, placement_group_bundle_index=i)).remote(s.cpus_per_worker,
                                                                                      s.gpus_per_worker)
                  for i in range(s.size)]
        gang.groups.append(RayWorkerGroup(gang, s.name, actors, placement, list(range(first, first + s.size)),
                                          call_timeout_s))
        first += s.size


def _set_up(gang: Gang, specs: list[GroupSpec], backend: str | None, pg_timeout_s: float,
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
