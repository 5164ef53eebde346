"""model.freeze_vision, LoRA and the pixel limits on a vision-language model, on the vision demo's tiny
Idefics3 (random weights): the vision side (tower and connector) keeps its weights while the language model trains, a
weight sync sends it once (at every sync into an engine that drops its weights while it sleeps), LoRA adapts the
language model only, and data.max_pixels / min_pixels become the image processor's resize bounds."""
from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image as PILImage

from train.test_vision import _prompts, _sampled
from tandem.config import AlgoConfig, DataConfig, LoraConfig, OptimConfig, load_config
from tandem.data.images import Image, image_resize
from tandem.modeling import load_causal_lm, load_processor
from tandem.run.vision import VisionPrompts
from tandem.train.batch import make_micro_batches
from tandem.train.lora import adapted
from tandem.train.policy import Policy


def vision_side(model) -> dict:
    """The parameters outside the language model (transformers' `get_decoder`) and the head, by name: what the
    profile's tower and connector paths (`ModelProfile.vision_side`) must name, found another way."""
    language = {id(p) for p in model.get_decoder().parameters()}
    language |= {id(p) for p in model.get_output_embeddings().parameters()}
    return {n: p for n, p in model.named_parameters() if id(p) not in language}

IDEFICS3 = {"image_processor_type": "Idefics3ImageProcessor", "size": {"longest_edge": 1456},
            "max_image_size": {"longest_edge": 364}, "do_image_splitting": True}  # SmolVLM's checkpoints' own
QWEN2_VL = {"image_processor_type": "Qwen2VLImageProcessor", "size": {"shortest_edge": 3136, "longest_edge": 12845056}}


def tiling_copy(vlm: Path, folder: Path) -> Path:
    """The tiny Idefics3 with an image processor that splits images into tiles of its 64-pixel side after resizing
    their longest edge to 128 (SmolVLM's way), so that the pixel bounds change how many image tokens a prompt has."""
    shutil.copytree(vlm, folder)
    path = folder / "processor_config.json"
    config = json.loads(path.read_text())
    config["image_processor"].update(do_image_splitting=True, size={"longest_edge": 128})
    path.write_text(json.dumps(config))
    return folder


def picture_row(size: tuple[int, int] = (64, 48)) -> dict:
    """A prompt with one picture of `size` (within max_pixels 64 x 64: the tiling processor's own resize would grow
    it to 128 x 96, four tiles)."""
    out = io.BytesIO()
    PILImage.new("RGB", size, (230, 20, 20)).save(out, "PNG")
    return {"question": "<image>Colour:", "_images": [Image("red.png", out.getvalue())]}


def _update(policy: Policy, samples) -> None:
    """One update of `policy` on `samples` (groups of 4), the rows of each group advantaged +1 / -1 in turn."""
    mbs = make_micro_batches(samples, 4096, 0, by_prompt=policy.share_prompts)
    policy.update(policy.prepare([mbs], len(samples)), torch.tensor([1.0, -1.0]).repeat(len(samples) // 2))


def _moved(policy: Policy, before: dict[str, torch.Tensor]) -> set[str]:
    return {n for n, p in policy.model.named_parameters() if n in before and not torch.equal(p.detach(), before[n])}


@pytest.mark.parametrize("freeze", [True, False])
def test_a_frozen_vision_side_keeps_its_weights_while_the_language_model_trains(vlm, freeze):
    """The vision side is the tower and the connector, nothing of the language model or its head. Frozen: after an
    update it is as loaded, has no optimizer state, and is what `Policy.frozen` names (the weights a sync sends once);
    the language model moved. Not frozen (the red case of each check): the tower moves too."""
    vision = VisionPrompts(load_processor(vlm), chat_template=False, system_prompt="")
    samples = _sampled(vlm, _prompts(vision), vision)
    policy = Policy(str(vlm), "float32", False, AlgoConfig(), OptimConfig(lr=1e-2), 10, 1.0, 6, freeze_vision=freeze)
    side = vision_side(policy.model)
    assert {n.split(".")[1] for n in side} == {"vision_model", "connector"}
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    _update(policy, samples)
    moved = _moved(policy, before)
    assert moved - set(side), "the language model did not train"
    if freeze:
        assert not moved & set(side) and policy.frozen == set(side)
        assert not any(p in policy.optimizer.state for p in side.values()) and policy.optimizer.state
    else:
        assert moved & set(side) and not policy.frozen


def text_length(completion: str, prompt: str, row) -> float:
    """A reward the untrained model's completions differ by (colors_exact scores them all 0, which trains nothing)."""
    return float(len(completion))


text_length.inline = True

RUN = [f"rewards=[{{name: '{__name__}:text_length'}}]", "reward_pool.workers=0"]  # a model that moves at each step


def _run(vlm: Path, out: Path, *extra: str) -> list[dict]:
    """Three GRPO steps on the colors task in one process, rewarded by `text_length`; each step's metrics (the
    language model moved at each)."""
    from tandem.trainer import train

    train(load_config(None, [
        f"model.path={vlm}", "data.task=colors", f"run.output_dir={out}", "run.steps=3", "run.save_every=0",
        "run.progress=false", "run.report_to=[]", "run.plots=false", "batch.prompts_per_step=2", "batch.group_size=4",
        "rollout.max_new_tokens=4", "data.eval_size=2", "optim.lr=1e-2", *RUN, *extra]))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["step"] > 0]
    assert all(r["grad_norm"] > 0 for r in rows), [r["grad_norm"] for r in rows]
    return rows


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_a_run_syncs_the_frozen_vision_side_once(vlm, tmp_path):
    """`sync/bytes`: the first sync sends the whole model, the next ones the whole less the vision side; into an hf
    engine that frees its weights while it sleeps (placement.offload), every sync sends the whole model. The engine
    samples as the trainer scores after every sync (logprob_diff < 1e-5)."""
    model = load_causal_lm(vlm)
    whole, tower = _bytes(model.parameters()), _bytes(vision_side(model).values())
    for extra, sent in (([], [whole, whole - tower, whole - tower]), (["placement.offload=true"], [whole] * 3)):
        rows = _run(vlm, tmp_path / "-".join(["run", *extra]), *extra)
        assert [r["sync/bytes"] for r in rows] == sent, extra
        assert all(r["logprob_diff"] < 1e-5 for r in rows), [r["logprob_diff"] for r in rows]


def test_lora_on_a_vision_model_adapts_its_language_model_only(vlm, tmp_path):
    """The default targets (the language model's attention and MLP projections) within the language model only:
    the tower's own q/k/v projections get none. An update moves adapters alone; the vision side is `frozen` without
    model.freeze_vision (LoRA trains nothing of it). A run with LoRA keeps engine and trainer equal, sending the vision
    side once; its checkpoint exports as a vision-language model with its processor."""
    vision = VisionPrompts(load_processor(vlm), chat_template=False, system_prompt="")
    samples = _sampled(vlm, _prompts(vision), vision)
    policy = Policy(str(vlm), "float32", False, AlgoConfig(), OptimConfig(lr=1e-2), 10, 1.0, 6,
                    lora=LoraConfig(enabled=True), freeze_vision=False)
    assert adapted(policy.model) and all(n.startswith("model.text_model.") for n in adapted(policy.model))
    assert policy.frozen == set(vision_side(policy.model))
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    _update(policy, samples)
    moved = _moved(policy, before)
    assert moved and all(".lora_" in n and n.startswith("model.text_model.") for n in moved), sorted(moved)[:4]
    rows = _run(vlm, tmp_path, "lora.enabled=true")
    model = load_causal_lm(vlm)
    whole, tower = _bytes(model.parameters()), _bytes(vision_side(model).values())
    assert [r["sync/bytes"] for r in rows] == [whole, whole - tower, whole - tower]
    # `tandem export`: the merged vision-language model with its processor, loaded as one
    from tandem.run.checkpoint import latest
    from tandem.run.export import export_merged

    merged = export_merged(str(latest(tmp_path / "checkpoints")), str(tmp_path / "merged"))
    assert load_processor(merged).image_processor is not None
    assert type(load_causal_lm(merged)).__name__ == "Idefics3ForConditionalGeneration"
    assert "AutoModelForImageTextToText.from_pretrained(FOLDER)" in (merged / "README.md").read_text()
    assert all(r["logprob_diff"] < 1e-5 for r in rows), [r["logprob_diff"] for r in rows]


def _resize(image_processor: dict, **limits) -> dict:
    data = DataConfig(**limits)  # its defaults, and its check that min_pixels <= max_pixels
    return image_resize(data.max_pixels, data.min_pixels, image_processor)


def test_the_pixel_limits_bound_the_image_processors_own_resize():
    """Qwen2-VL's bounds are pixel counts, Idefics3's a longest edge (whole tiles where it splits images); the
    limits only tighten the processor's own bounds, and a processor that resizes to one size takes none."""
    assert _resize(QWEN2_VL) == {} and _resize(IDEFICS3) == {}
    assert _resize(QWEN2_VL, max_pixels=1003520, min_pixels=200704) == {
        "size": {"shortest_edge": 200704, "longest_edge": 1003520}}
    assert _resize(QWEN2_VL, max_pixels=1000) == {"size": {"shortest_edge": 1000, "longest_edge": 1000}}
    assert _resize(IDEFICS3, max_pixels=1000 * 1000) == {"size": {"longest_edge": 728}}  # 2 tiles
    one_image = dict(IDEFICS3, do_image_splitting=False)
    assert _resize(one_image, max_pixels=1000 * 1000) == {"size": {"longest_edge": 1000}}
    assert _resize(IDEFICS3, min_pixels=2000 * 2000) == {"size": {"longest_edge": 2000}}
    gemma = {"image_processor_type": "Gemma3ImageProcessor", "size": {"height": 896, "width": 896}}
    assert _resize(gemma, max_pixels=100 * 100) == {}


def test_the_trainers_processor_resizes_within_data_max_pixels(vlm, tmp_path):
    """The run's prompt renderer calls the processor with the bounds: a 64 x 48 picture the tiling processor would
    grow to four tiles stays one image under data.max_pixels 64 x 64 (fewer tokens, fewer pixel values)."""
    from tandem.architectures import profile
    from tandem.trainer import _vision

    model = tiling_copy(vlm, tmp_path / "tiling")
    row = picture_row()
    own, bounded = (_vision(load_config(None, [f"model.path={model}", "data.task=colors", *extra]), profile(model))
                    for extra in ([], ["data.max_pixels=4096"]))
    assert own.resize == {} and bounded.resize == {"size": {"longest_edge": 64}}
    assert len(bounded.ids(row)) < len(own.ids(row))
    assert bounded.encode(row)["pixel_values"].shape[1] == 1 < own.encode(row)["pixel_values"].shape[1]
