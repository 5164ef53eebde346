"""Multi-node on a simulated cluster: two Ray nodes on this machine (Ray's own `cluster_utils.Cluster`, loopback
only), joined through `placement.ray_address`. Split placement puts the trainer on one node and the sampler on the
other by per-role Ray resources, weights cross over the weight channel, and the sampler node's death stops the run
by name, with nothing of the run left behind."""
from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before `import ray`: stay on loopback
os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # no ~/.ray/auth_token
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
pytest.importorskip("ray")

from procs import descendants  # noqa: E402
from test_placement import _assert_intact, read_metrics, small_config  # noqa: E402

from tandem.workers import placement  # noqa: E402
from tandem.workers.group import WorkerError  # noqa: E402
from tandem.workers.ray.gang import RayWorkerGroup  # noqa: E402

# No idle workers started ahead (seconds of CPU here for nothing). Ray's health checks keep their defaults, as on a
# real cluster: a node that stops answering is declared dead about 15 s later, and until then its actors are only
# "unavailable" (the run's report waits for the verdict).
SYSTEM_CONFIG = {"enable_worker_prestart": False, "prestart_worker_first_driver": False}


@dataclass
class TwoNodes:
    cluster: object  # ray.cluster_utils.Cluster
    a: object  # the head node (GCS, the driver's raylet): trainers, resource tandem_node_a
    b: object  # a second raylet: samplers, resource tandem_node_b
    folder: str
    closed: bool = field(default=False)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.cluster.shutdown()


@pytest.fixture(scope="module")
def nodes():
    import ray
    from ray.cluster_utils import Cluster

    assert not ray.is_initialized(), "an earlier test left a Ray session up: the run would reuse it"
    folder = tempfile.mkdtemp(prefix="tandem-mn-")  # short: Ray's socket paths live below it
    # Cluster writes the head's address to $RAY_TMPDIR/ray/ray_current_cluster: here, not in the shared /tmp/ray
    os.makedirs(os.path.join(folder, "ray"))
    old_tmpdir = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = folder
    common = dict(num_cpus=2, node_ip_address="127.0.0.1", temp_dir=folder, object_store_memory=80 << 20)
    cluster = Cluster(initialize_head=True, connect=False, shutdown_at_exit=True, head_node_args=dict(
        resources={"tandem_node_a": 1}, include_dashboard=False, _system_config=SYSTEM_CONFIG, **common))
    two = TwoNodes(cluster, cluster.head_node, None, folder)
    try:
        # 2 CPUs on each node: either could hold both workers, so where they go is the resources' doing
        two.b = cluster.add_node(resources={"tandem_node_b": 1}, **common)
        cluster.wait_for_nodes()
        yield two
    finally:
        try:
            if ray.is_initialized():  # a run that kept its connection (the test fails on it): the head cannot go first
                ray.shutdown()
            two.close()
        finally:
            if old_tmpdir is None:
                os.environ.pop("RAY_TMPDIR", None)
            else:
                os.environ["RAY_TMPDIR"] = old_tmpdir
            shutil.rmtree(folder, ignore_errors=True)


def _tree(root: int) -> list[int]:
    """`root` and every live process below it, read from /proc."""
    kids: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            kids.setdefault(int(stat.read_text().rsplit(")", 1)[1].split()[1]), []).append(int(stat.parent.name))
        except (OSError, ValueError):
            continue
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(kids.get(pid, []))
    return found


def _power_off(cluster, node) -> list[int]:
    """The node dies as a machine does: its raylet and every process under it (its actors) SIGKILLed at once, then
    the cluster utility forgets the node. Returns the pids killed."""
    pids = [p for info in node.all_processes.values() for i in info for p in _tree(i.process.pid)]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    cluster.remove_node(node, allow_graceful=False)
    return pids


def _reserved(state, node: str, which: str = "available") -> dict[str, float]:
    """A node's CPUs and tandem's custom resources, free or in all (GCS's view)."""
    per_node = state.available_resources_per_node() if which == "available" else state.total_resources_per_node()
    return {k: v for k, v in per_node.get(node, {}).items() if k == "CPU" or k.startswith("tandem_node")}


def _listening() -> set[int]:
    """TCP ports this process or one of its descendants (the run's, the cluster's) listens on. Not a bind test,
    which would also trip on the port's reuse by an outgoing connection (it is an ephemeral one); not every
    listener of the machine, which may be another program's that drew the same ephemeral port (seen once, with a
    vLLM experiment running beside the suite)."""
    sockets = set()
    for pid in [os.getpid()] + [p for p, _ in descendants()]:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue  # gone meanwhile
        for fd in fds:
            try:
                link = os.readlink(fd)
            except OSError:
                continue  # closed meanwhile (the listing's own descriptor among them)
            if link.startswith("socket:["):
                sockets.add(link[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in sockets:  # LISTEN, held by one of them
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def _alive(pid: int) -> bool:
    try:
        return "Z" not in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False


def _wait_gone(pids, seconds: float = 20) -> list[int]:
    deadline = time.monotonic() + seconds
    while (alive := [p for p in pids if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive


def test_split_run_across_two_nodes_trains_then_stops_when_the_sampler_node_dies(nodes, tiny_model, tmp_path,
                                                                                  monkeypatch):
    """A split run (1 trainer, 1 `hf` sampler, sync schedule) on the two-node cluster: `placement.train_resources`
    and `rollout_resources` put the trainer on node A and the sampler on node B; it trains two steps with every
    step's sampler logprobs within 1e-5 of the trainer's, and at the step-2 checkpoint the weights the sampler
    received over the channel are the trainer's, bit for bit. Then node B loses power: the run stops with a
    WorkerError naming the sampler and its node, the checkpoint is intact, no actor, placement group or process of
    the run is left, and the cluster's surviving node has all its resources back."""
    import ray
    from safetensors.torch import load_file

    a, b = nodes.a.node_id, nodes.b.node_id
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "core"))  # toy_rewards, in the driver
    cfg = small_config(tiny_model, tmp_path, "placement.mode=split", f"placement.ray_address={nodes.cluster.address}",
                       "placement.train_resources={tandem_node_a: 1}", "placement.rollout_resources={tandem_node_b: 1}",
                       "run.steps=4", "run.save_every=2", "rollout.max_logprob_diff=1e-5",
                       "rewards=[{name: 'toy_rewards:text_length'}]")  # a reward with spread: the updates move weights
    seen: dict = {}
    build, save, free_address = placement.build, placement.Placement.save, RayWorkerGroup.free_address
    group_shutdown = RayWorkerGroup.shutdown

    def build_and_record(c, model):
        built = build(c, model)
        for g in built.groups:
            seen[g.name] = ray.get([actor.__ray_call__.remote(
                lambda _: (ray.get_runtime_context().get_node_id(), os.getpid())) for actor in g.actors])
        return built

    def recording_address(self, rank: int = 0):  # the weight channel's rendezvous, on trainer 0's node
        seen["channel"] = free_address(self, rank)
        return seen["channel"]

    def shutdown_and_look(self) -> None:  # the group's actors and placement, as the cluster sees them right after
        group_shutdown(self)
        if ray.is_initialized():  # not the last group: the run's job is still connected, and Ray frees nothing itself
            gcs = nodes.cluster.global_state
            seen.setdefault("groups left", {})[self.name] = (
                [gcs.actor_table(actor._actor_id.hex())["State"] for actor in self.actors],
                gcs.placement_group_table(self.placement.id)["state"])

    def save_check_and_kill(self, folder: str) -> None:
        save(self, folder)
        if "killed" in seen:
            return
        # step 2's update and sync are done and nothing is queued behind them: the sampler holds version 2, staged
        # for its next generate, as received over the channel
        seen["trainer"] = ray.get(self.trainers.actors[0].__ray_call__.remote(
            lambda host: host.worker.policy.full_state_dict()))
        seen["sampler"] = ray.get(self.samplers.actors[0].__ray_call__.remote(
            lambda host: (host.worker._staged[0], dict(host.worker._staged[1]))))
        seen["killed"] = _power_off(nodes.cluster, nodes.b)
        seen["killed_at"] = time.monotonic()

    monkeypatch.setattr(placement, "build", build_and_record)
    monkeypatch.setattr(placement.Placement, "save", save_check_and_kill)
    monkeypatch.setattr(RayWorkerGroup, "free_address", recording_address)
    monkeypatch.setattr(RayWorkerGroup, "shutdown", shutdown_and_look)
    with pytest.raises(WorkerError) as stopped:
        from tandem.trainer import train

        train(cfg)
    assert "killed_at" in seen, f"the run stopped before its step-2 checkpoint: {stopped.value}"
    took = time.monotonic() - seen["killed_at"]

    # each role ran on the node its resources name (the workers say where they are), and it was asked for: the
    # run's placement groups reserved those resources (without them, Ray may still put each role there by chance)
    assert [n for n, _ in seen["trainers"]] == [a] and [n for n, _ in seen["samplers"]] == [b], (seen, a, b)
    groups = nodes.cluster.global_state.placement_group_table().values()
    bundles = sorted(sorted(pg["bundles"][0].items()) for pg in groups)
    assert bundles == [[("CPU", 1.0), ("tandem_node_a", 1.0)], [("CPU", 1.0), ("tandem_node_b", 1.0)]], bundles
    # the run trained: two steps logged, each sampled with the trainer's weights (the per-step check), each sync
    # carrying the whole model over the channel
    rows = [r for r in read_metrics(tmp_path) if r["step"] > 0]
    initial = load_file(str(tiny_model / "model.safetensors"))  # each tensor once (the head is tied)
    model_bytes = sum(t.numel() * t.element_size() for t in initial.values())
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["logprob_diff_max"] <= 1e-5 and r["sync/bytes"] == model_bytes for r in rows), rows
    # the sampler's weights after sync 2 are the trainer's, and they moved away from the initial model
    version, staged = seen["sampler"]
    assert version == 2 and staged.keys() == initial.keys()  # every tensor of the model (the tied head aliased)
    for name, w in staged.items():
        assert torch.equal(w, seen["trainer"][name]), name
    assert any(not torch.equal(w, initial[n]) for n, w in staged.items())
    _assert_intact(tmp_path, 2)

    # the node's death stopped the run promptly, naming the sampler, the phase and the node
    message = str(stopped.value)
    assert message.startswith("worker 0/1 of 'samplers' died in generate: "), message
    assert f"its node {b} died" in message, message
    assert took < 45, took  # Ray's verdict on the node (about 15 s), then the stop

    # nothing of the run is left: its processes, its actors and placement groups in the cluster, their resources
    run_pids = [p for g in ("trainers", "samplers") for _, p in seen[g]] + seen["killed"]
    assert not _wait_gone(run_pids)
    state = nodes.cluster.global_state
    assert {v["State"] for v in state.actor_table(None).values()} == {"DEAD"}
    assert {v["state"] for v in state.placement_group_table().values()} == {"REMOVED"}
    # ... ended by the run itself, not only by Ray when the run's job ended
    assert seen["groups left"] == {"trainers": (["DEAD"], "REMOVED")}, seen["groups left"]
    assert state._live_node_ids() == {a}
    deadline = time.monotonic() + 10  # the raylet reports its resources every few hundred ms
    while (free := _reserved(state, a)) != (want := _reserved(state, a, "total")) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert free == want == {"CPU": 2.0, "tandem_node_a": 1.0}
    assert not ray.is_initialized()  # the run's own connection to the cluster is closed
    host, port = seen["channel"]
    assert host == "127.0.0.1" and port not in _listening()  # nothing listens on the weight channel's port

    # and the cluster's own processes go with it
    nodes.close()
    deadline = time.monotonic() + 20
    while (left := [f"{p} {c}" for p, c in descendants() if "ray" in c.lower()]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left


@pytest.mark.parametrize("overrides, error", [
    (["placement.backend=ray", "placement.mode=split", "placement.train_resources={CPU: 1}"],
     "placement.train_resources: 'CPU' is placement.cpus_per_worker's"),
    (["placement.backend=ray", "placement.mode=split", "placement.rollout_resources={sampler_node: 0}"],
     "placement.rollout_resources: sampler_node=0.0 reserves nothing"),
    (["placement.train_resources={trainer_node: 1}"], "need placement.backend: ray"),
    (["placement.backend=ray", "placement.rollout_resources={sampler_node: 1}"],
     "placement.rollout_resources: colocated workers sample where they train"),
])
def test_role_resources_are_checked_before_anything_starts(overrides, error):
    from tandem.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=error):
        load_config(None, overrides)
