"""A sampler generates with the policy version the controller asks for, waiting for weights still on their way."""
from __future__ import annotations

import threading

import pytest
import torch

from tandem.config import load_config
from tandem.rollout import Sampling
from tandem.workers.rollout import RolloutWorker

PROMPTS = [[5, 6, 7], [8, 9]]
SAMPLING = Sampling(n=2, max_new_tokens=3, seed=0)


class _AnnouncedChannel:
    """The weight channel as the samplers see it once trainer 0 has announced the version (the transfer itself is
    the monkeypatched reshard)."""

    def expect(self, version: int) -> None:
        pass


def _worker(model, tmp_path) -> RolloutWorker:
    cfg = load_config(None, [f"model.path={model}", f"run.output_dir={tmp_path}"])
    worker = RolloutWorker(cfg)
    worker._channel = _AnnouncedChannel()
    return worker


def _in_thread(fn):
    box: dict = {}

    def run():
        try:
            box["result"] = fn()
        except BaseException as exc:
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def test_generate_waits_for_the_version_asked_and_loads_it(tiny_model, tmp_path, monkeypatch):
    worker = _worker(tiny_model, tmp_path)
    new = {n: torch.randn_like(p) for n, p in worker.engine.weights().items()}
    sent = threading.Event()

    def fake_reshard(*args, **kwargs):
        sent.wait(30)
        return dict(new)

    monkeypatch.setattr("tandem.sync.reshard.Resharder.run", fake_reshard)
    t, box = _in_thread(lambda: worker.generate(PROMPTS, SAMPLING, min_version=1))
    t.join(0.5)
    assert t.is_alive()  # version 1 has not arrived: no sampling with version 0's weights
    receiver, _ = _in_thread(lambda: worker.receive_weights(1))
    sent.set()
    receiver.join(30)
    t.join(30)
    gen = box["result"]
    assert gen.version == 1 and len(gen.samples) == 4
    assert gen.idle_seconds >= 0.5  # the wait for weights is the sampler's idle time
    for name, w in worker.engine.weights().items():
        assert torch.equal(w, new[name]), name
    # a version already held does not wait
    assert worker.generate(PROMPTS, SAMPLING, min_version=1).version == 1


def test_a_failed_receive_fails_the_generate_waiting_for_it(tiny_model, tmp_path, monkeypatch):
    worker = _worker(tiny_model, tmp_path)

    def broken_reshard(*args, **kwargs):
        raise ConnectionError("Connection closed by peer")

    monkeypatch.setattr("tandem.sync.reshard.Resharder.run", broken_reshard)
    t, box = _in_thread(lambda: worker.generate(PROMPTS, SAMPLING, min_version=1))
    with pytest.raises(ConnectionError):
        worker.receive_weights(1)
    t.join(30)
    assert not t.is_alive()
    assert isinstance(box.get("error"), RuntimeError)
    assert "policy version 1" in str(box["error"]) and "Connection closed by peer" in str(box["error"])
