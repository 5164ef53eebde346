"""Vision-language models (the hf engine in one process), on the vision demo's tiny
Idefics3 untrained: the images reach the engine's prefill and the trainer's forwards, engine and trainer agree on every
sampled token in both layouts, two pictures under the same question stay two prompts, and what is not built yet is
refused before any model loads."""
from __future__ import annotations

import dataclasses
import io
from pathlib import Path

import pytest
import torch
from PIL import Image as PILImage

from tandem.data.images import Image
from tandem.data.sources import Prompt
from tandem.run.vision import VisionPrompts
from tandem.architectures import profile_of
from tandem.modeling import load_causal_lm, load_processor
from tandem.rollout.base import Sampling
from tandem.rollout.hf import HFEngine
from tandem.samples import Completion, ModelPrompt, Samples
from tandem.train.batch import make_micro_batches
from tandem.train.logprobs import token_logprobs


def _png(color: tuple[int, int, int], size: tuple[int, int] = (64, 64)) -> bytes:
    out = io.BytesIO()
    PILImage.new("RGB", size, color).save(out, "PNG")
    return out.getvalue()


def _prompts(vision: VisionPrompts) -> list[Prompt]:
    """Three prompts: the first two the same question over different pictures (the same ids), the third another."""
    rows = [{"question": "<image>Colour:", "_images": [Image("red.png", _png((230, 20, 20)))]},
            {"question": "<image>Colour:", "_images": [Image("blue.png", _png((20, 20, 230)))]},
            {"question": "<image>", "_images": [Image("green.png", _png((20, 200, 20), (40, 64)))]}]
    return [Prompt(vision.ids(row), row) for row in rows]


def _sampled(vlm: Path, prompts: list[Prompt], vision: VisionPrompts) -> Samples:
    engine = HFEngine(str(vlm), seed=0)
    pictured = [ModelPrompt(p.ids, vision.images(p)) for p in prompts]
    comps = engine.generate(pictured, Sampling(n=4, temperature=1.0, max_new_tokens=6, seed=3))
    assert all(c.images is pictured[c.prompt_index].images for c in comps)  # each holds its prompt's images
    return Samples.of_call(comps, len(prompts))


def test_engine_and_trainer_agree_on_image_prompts_in_every_layout(vlm):
    """The sampler's logprob of every sampled token equals the trainer's, per row, prompt-once (where the
    picture runs once per group) and padding-free (the rows end to end, pictures in order) within 1e-5, and the
    layouts give the same gradients. The first two prompts
    have the same ids and other pictures: prompt-once keeps them apart (3 distinct prompts). Red if the engine or a
    layout dropped the images (the pictures change the logprobs: checked), or prompts were told apart by ids
    alone."""
    vision = VisionPrompts(load_processor(vlm), chat_template=False, system_prompt="")
    prompts = _prompts(vision)
    assert prompts[0].ids == prompts[1].ids and len(prompts[0].ids) > 4  # the picture's tokens are expanded
    samples = _sampled(vlm, prompts, vision)
    model = load_causal_lm(vlm)
    assert profile_of(model).packs
    grads = []
    for share, packed in ((False, False), (True, False), (False, True)):
        (mb,) = make_micro_batches(samples, 4096, 0, by_prompt=share, packed=packed)
        if share:
            assert int(mb.shared.of_row.max()) + 1 == 3
        model.zero_grad()
        logp, _ = token_logprobs(model, mb, 1.0, share_prompts=share)
        assert ((logp.detach() - mb.sampler_logprobs).abs() * mb.mask).max() < 1e-5
        (logp * mb.mask).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert any("vision" in n for n in grads[0])
    for other in grads[1:]:
        assert grads[0].keys() == other.keys()
        for name, g in grads[0].items():
            assert (g - other[name]).abs().max() < 1e-5 * max(1.0, float(g.abs().max())), name
    # the pictures matter: the same tokens after the blue picture instead of the red one
    blue = samples.completions[4].images  # the second prompt's (rows 4-7)
    swapped = Samples([dataclasses.replace(c, images=blue) if c.prompt_index == 0 else c
                       for c in samples.completions], samples.group, 3)
    (mb,), (swapped,) = (make_micro_batches(s, 4096, 0) for s in (samples, swapped))
    with torch.no_grad():
        same, other = (token_logprobs(model, m, 1.0)[0] for m in (mb, swapped))
    assert ((same - other).abs() * mb.mask)[:4].max() > 1e-4


def test_a_vision_model_is_refused_where_its_images_are_not_carried_yet(vlm, monkeypatch):
    """Each placement and engine the images do not reach yet, refused before any model loads, naming the
    setting; the hf engine in one process and on Ray workers passes."""
    from tandem import modeling
    from tandem.config import ConfigError, load_config
    from tandem.run.preflight import check_supported

    monkeypatch.setattr(modeling, "load_causal_lm", lambda *a, **k: pytest.fail("a model loaded"))
    base = [f"model.path={vlm}", "data.task=colors"]
    check_supported(load_config(None, base))
    check_supported(load_config(None, base + ["placement.backend=ray", "placement.workers=2"]))
    check_supported(load_config(None, base + ["rollout.engine=vllm", "rollout.vllm.mode=server"]))
    for extra, says in ((["placement.backend=ray", "placement.mode=split", "placement.schedule=stream"],
                         "placement.schedule: stream"),
                        (["placement.backend=ray", "placement.workers=2", "placement.tensor_parallel=2"],
                         "placement.tensor_parallel: 2")):
        with pytest.raises(ConfigError, match=f"vision-language model.*{says}"):
            check_supported(load_config(None, base + extra))


def test_a_run_on_a_vision_model_trains_evaluates_and_saves_its_processor(vlm, tmp_path):
    """The loop on the colors task in one process: every sync leaves the engine's logprobs equal to the trainer's
    (1e-5: the pictures went to both), the held-out samples name their pictures (not their bytes), and the checkpoint
    holds the processor and says it is an image-text-to-text model."""
    import json

    from tandem.config import load_config
    from tandem.run.evaluation import write_samples
    from tandem.trainer import start_run, train

    overrides = [f"model.path={vlm}", "data.task=colors", "run.steps=2", "run.save_every=2", "run.progress=false",
                 "run.report_to=[]", "run.plots=false", "batch.prompts_per_step=4", "batch.group_size=4",
                 "rollout.max_new_tokens=4", "data.eval_size=4", "reward_pool.workers=0", "algo.kl_coef=0.04",
                 "rewards=[{name: colors_exact}]"]
    train(load_config(None, overrides + [f"run.output_dir={tmp_path / 'run'}"]))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["logprob_diff"] < 1e-5 for r in rows if "logprob_diff" in r) and rows[-1]["step"] == 2
    saved = tmp_path / "run" / "checkpoints" / "step-00000002"
    assert (saved / "processor_config.json").is_file() and load_processor(saved).image_processor is not None
    assert "pipeline_tag: image-text-to-text" in (saved / "README.md").read_text()
    run = start_run(load_config(None, overrides + [f"run.output_dir={tmp_path / 'eval'}"]), claim_output_dir=False)
    try:
        from tandem.trainer import run_eval

        run_eval(run)
    finally:
        run.close()
    sample = json.loads(write_samples(tmp_path / "samples.jsonl", run.last_eval).read_text().splitlines()[0])
    assert sample["images"] == ["row 1 image 0"] and "question" in sample  # a name, not the bytes


def test_a_sampled_image_placeholder_is_trained_on_as_a_token(vlm):
    """A completion that holds the image placeholder token (an untrained model samples it) is a token, as the sampler
    fed it, in every layout: prompt-once runs the prompt with its picture and the completion after it; the forward
    over whole rows (FSDP's), padded or padding-free, enters it as its own embedding, not as one more image's place.
    The three agree, logprobs and gradients within 1e-5. Red if the whole-row forward let the model count it as an
    image's place (it fails: more places than image features)."""
    vision = VisionPrompts(load_processor(vlm), chat_template=False, system_prompt="")
    prompts = _prompts(vision)[:2]
    placeholder = vision.processor.tokenizer.convert_tokens_to_ids("<image>")
    comps = [Completion(p.ids, [placeholder, 5, placeholder][:2 + j], [0.0] * (2 + j), "", "stop", k,
                        images=vision.images(p)) for k, p in enumerate(prompts) for j in range(2)]
    model, results = load_causal_lm(vlm), []
    for share, packed in ((True, False), (False, False), (False, True)):
        (mb,) = make_micro_batches(Samples.of_call(comps, 2), 4096, 0, by_prompt=share, packed=packed)
        assert (mb.shared is not None) == share
        model.zero_grad()
        logp, _ = token_logprobs(model, mb, 1.0, share_prompts=share)
        (logp * mb.mask).sum().backward()
        results.append((logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (once, once_grads) = results[0]
    assert torch.isfinite(once).all()
    for rows, row_grads in results[1:]:  # the whole rows padded, then padding-free
        assert (once - rows).abs().max() < 1e-5
        assert once_grads.keys() == row_grads.keys()
        for name, g in once_grads.items():
            assert (g - row_grads[name]).abs().max() < 1e-5 * max(1.0, float(g.abs().max())), name


def test_a_vision_models_weights_are_known_before_it_loads(vlm):
    """What checks made before any model loads look at (`weightless_model`: names and shapes on the meta device)
    is the image-text-to-text class, tower included."""
    from tandem.modeling import weightless_model

    model = weightless_model(vlm)
    names = [n for n, _ in model.named_parameters()]
    assert type(model).__name__ == "Idefics3ForConditionalGeneration" and any("vision_model" in n for n in names)
    assert all(p.device.type == "meta" for p in model.parameters())
