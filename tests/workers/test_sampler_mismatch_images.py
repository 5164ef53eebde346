"""A sampler mismatch on prompts with images says so: the sampler may have seen other pixels or image tokens than
the trainer, so the stop does not blame the weights alone. The worker is built bare (no model): the stop's message
is what is checked."""
from __future__ import annotations

import pytest
import torch

from tandem.config import load_config
from tandem.samples import Completion, Images, Samples
from tandem.workers.train import SamplerMismatch, TrainWorker


def _worker() -> TrainWorker:
    worker = object.__new__(TrainWorker)
    worker.cfg = load_config(None, ["model.dtype=float32"])
    worker._idle_since = 0.0
    worker._lay_out = lambda samples: []
    worker.policy = type("Policy", (), {"prepare": lambda self, minis, n: _Step()})()
    return worker


class _Step:
    penalties = None
    times: dict = {}


def _samples(names: tuple[str, ...] | None) -> Samples:
    images = None if names is None else Images("k", names, {"pixel_values": torch.zeros(1)})
    done = [Completion([1, 2], [3], [-0.1], "x", "stop", 0, images=images) for _ in range(2)]
    return Samples.of_call(done, 1)


def test_a_mismatch_on_prompts_with_images_names_them_and_the_pixels():
    worker = _worker()
    worker.prepare(_samples(("a.png", "b.png", "c.png", "d.png", "e.png")))
    with pytest.raises(SamplerMismatch, match=r"The prompts hold images \(a\.png, b\.png, c\.png and 2 more\): the "
                                              r"sampler may have seen other pixels or image tokens than the trainer"):
        worker._check_sampler(1.0, 2.0, lambda: "Every one of the 3 parameters ... matches.")


def test_a_mismatch_on_text_prompts_blames_the_weights_alone():
    worker = _worker()
    worker.prepare(_samples(None))
    with pytest.raises(SamplerMismatch) as stop:
        worker._check_sampler(1.0, 2.0, None)
    assert "images" not in str(stop.value) and "A bad weight sync is the usual cause" in str(stop.value)
