"""LoRA in one process: only adapters train, the sampler samples with them, checkpoints in PEFT's format that resume
exactly and export merged, and configs PEFT cannot serve refused before any model loads."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from tandem.run import checkpoint
from tandem.config import ConfigError, load_config
from tandem.trainer import start_run, train

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))
from test_trainer import read_metrics, small_config  # noqa: E402

LORA = ("lora.enabled=true", "lora.rank=4", "lora.alpha=8", "optim.lr=1e-2")


def lora_config(model: Path, out: Path, *extra: str):
    return small_config(model, out, *LORA, *extra)


def test_lora_trains_the_adapter_only_and_the_sampler_samples_with_it(tiny_model, tmp_path):
    out = tmp_path / "run"
    # KL on: the reference is the base (adapters off), so the KL grows from 0 as the adapter moves
    train(lora_config(tiny_model, out, "algo.kl_coef=0.05", "rollout.max_logprob_diff=1e-5"))
    steps = read_metrics(out)[1:]
    assert all(s["logprob_diff_max"] <= 1e-5 for s in steps), [s["logprob_diff_max"] for s in steps]
    assert steps[0]["kl"] < 1e-9 < steps[-1]["kl"]  # B starts at zero: step 1 samples the base itself
    last = checkpoint.latest(out / "checkpoints")
    from safetensors.torch import load_file

    adapter = load_file(str(last / "adapter_model.safetensors"))
    r, n_modules = 4, 7  # q k v o gate up down of the one layer
    assert len(adapter) == 2 * n_modules and all(".lora_" in n for n in adapter)
    assert all(t.shape[0] == r or t.shape[1] == r for t in adapter.values())
    assert any(float(t.abs().max()) > 0 for n, t in adapter.items() if "lora_B" in n)  # the adapter moved
    assert not (last / "model.safetensors").exists()  # the base is never written again


def test_a_skipped_adapter_sync_is_caught(tiny_model, tmp_path, monkeypatch):
    """The engine keeps the base weights when the adapter's merge never reaches it: the per-step logprob check
    stops the run at the first step whose policy has moved."""
    from tandem.train import lora
    from tandem.workers.group import WorkerError

    monkeypatch.setattr(lora, "_merged", lambda w, layer: w)  # the sync sends the base weights, the adapter left out
    with pytest.raises(WorkerError, match="SamplerMismatch.*the sampler's logprobs differ"):
        train(lora_config(tiny_model, tmp_path / "run", "rollout.max_logprob_diff=1e-5"))


def test_lora_resume_reproduces_the_uninterrupted_run(tiny_model, tmp_path):
    extra = ("algo.kl_coef=0.05", "algo.mu=2")  # reference logprobs, old logprobs and Adam moments all matter
    full, cut = tmp_path / "full", tmp_path / "cut"
    train(lora_config(tiny_model, full, *extra))
    shutil.copytree(full, cut)
    shutil.rmtree(cut / "checkpoints" / "step-00000004")
    lines = (cut / "metrics.jsonl").read_text().splitlines()
    (cut / "metrics.jsonl").write_text("\n".join(lines[:3]) + "\n")
    torch.manual_seed(12345)
    train(lora_config(tiny_model, cut, *extra), resume=True)
    assert read_metrics(cut) == read_metrics(full)
    a = (checkpoint.latest(full / "checkpoints") / "adapter_model.safetensors").read_bytes()
    assert a == (checkpoint.latest(cut / "checkpoints") / "adapter_model.safetensors").read_bytes()


def test_saved_adapter_loads_with_peft_and_merged_export_with_transformers(tiny_model, tmp_path, capsys):
    """Both give the trainer's logprobs on a fixed prompt: the PEFT model from the checkpoint as is, and the plain
    model `tandem export` writes."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tandem.cli import main
    from tandem.modeling import load_causal_lm
    from tandem.workers.hybrid import HybridWorker

    out = tmp_path / "run"
    cfg = lora_config(tiny_model, out, "run.steps=2")
    train(cfg)
    last = checkpoint.latest(out / "checkpoints")
    worker = HybridWorker(cfg)  # the trainer's model, resumed from the checkpoint
    worker.restore(str(last))
    ids = torch.tensor([[5, 17, 42, 9, 33, 101, 7]])

    def logprobs(model) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(input_ids=ids).logits.float(), -1)

    worker.policy.model.eval()
    expected = logprobs(worker.policy.model)
    base = logprobs(load_causal_lm(tiny_model))
    assert (expected - base).abs().max() > 1e-4  # the adapter changes the model
    peft = PeftModel.from_pretrained(load_causal_lm(tiny_model), str(last)).eval()
    torch.testing.assert_close(logprobs(peft), expected, rtol=0, atol=1e-5)
    merged = tmp_path / "merged"
    assert main(["export", str(last), str(merged)]) == 0
    plain = AutoModelForCausalLM.from_pretrained(str(merged)).eval()
    assert not any("lora" in n for n, _ in plain.named_parameters())
    torch.testing.assert_close(logprobs(plain), expected, rtol=0, atol=1e-5)
    # the engine's merge is the export's: the hf engine's weights after the last sync are the exported ones
    worker.sync_weights(2)
    exported = dict(plain.named_parameters())
    for name, w in worker.engine.weights().items():
        torch.testing.assert_close(w, exported[name].detach(), rtol=0, atol=1e-6, msg=name)
    worker.close()
    assert main(["eval", f"model.path={last}"]) == 2  # an adapter is not a model: the error says to export it
    # an existing folder is refused (exit 2, naming it) and left as it was, unless --force replaces it whole
    (merged / "mine.txt").write_text("keep")
    capsys.readouterr()
    assert main(["export", str(last), str(merged)]) == 2
    assert f"{merged} exists already" in capsys.readouterr().err and (merged / "mine.txt").read_text() == "keep"
    assert main(["export", str(last), str(merged), "--force"]) == 0
    assert not (merged / "mine.txt").exists() and (merged / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged", "run"]  # no temporary folder left beside it
    # a damaged checkpoint is not exported: its checksums name the file
    raw = bytearray((last / "adapter_model.safetensors").read_bytes())
    raw[-3] ^= 1
    (last / "adapter_model.safetensors").write_bytes(raw)
    assert main(["export", str(last), str(tmp_path / "other")]) == 2
    assert "adapter_model.safetensors: checksum mismatch" in capsys.readouterr().err


@pytest.mark.parametrize("override, words", [
    ("lora.target_modules=[q_proj, qkv]", r"lora.target_modules: \['qkv'\] match no module.*linear layers are"),
    ("lora.target_modules=[input_layernorm]", r"lora: PEFT cannot put adapters on this qwen2 model"),
    ("lora.rank=0", r"lora.rank"),
    ("placement.tensor_parallel=2", r"lora.enabled with placement.tensor_parallel"),
])
def test_bad_lora_configs_are_refused_before_any_model_loads(tiny_model, tmp_path, monkeypatch, override, words):
    from tandem import modeling

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the config was refused")

    monkeypatch.setattr(modeling, "load_causal_lm", no_loading)
    extra = ("placement.backend=ray", "placement.workers=2") if "tensor_parallel" in override else ()
    with pytest.raises(ConfigError, match=words):
        start_run(lora_config(tiny_model, tmp_path / "run", override, *extra), claim_output_dir=False)


def test_lora_defaults_per_architecture():
    from tandem.architectures import lora_targets

    assert lora_targets("qwen2") == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert lora_targets("phi3") == ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    assert lora_targets("mixtral") == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert lora_targets("some_new_model") == "all-linear"
    assert load_config(None, []).lora.enabled is False
