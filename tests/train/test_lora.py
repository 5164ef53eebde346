"""LoRA in one process: only adapters train, the sampler samples with them, checkpoints in PEFT's format that resume
exactly and export merged, an MoE's stacked experts adapted and merged as PEFT does, and configs PEFT cannot serve
refused before any model loads."""
from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

from tandem.run import checkpoint
from tandem.config import ConfigError, load_config
from tandem.trainer import start_run, train

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_trainer import read_metrics, small_config  # noqa: E402
import zoo_models  # noqa: E402

LORA = ("lora.enabled=true", "lora.rank=4", "lora.alpha=8", "optim.lr=1e-2")


def lora_config(model: Path, out: Path, *extra: str):
    return small_config(model, out, *LORA, *extra)


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory) -> Path:
    """A tiny random Qwen3-MoE (4 experts, top 2; tests/zoo_models.py): LoRA's defaults adapt its attention and
    its stacked experts."""
    return zoo_models.build(tmp_path_factory.mktemp("moe") / "qwen3_moe", "qwen3_moe")


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


@pytest.mark.parametrize("model", ["tiny_model", "moe_model"])
def test_saved_adapter_loads_with_peft_and_merged_export_with_transformers(model, request, tmp_path, capsys):
    """Both give the trainer's logprobs on a fixed prompt: the PEFT model from the checkpoint as is, and the plain
    model `tandem export` writes. On the MoE, the adapter holds one adapter per expert of the stacked experts, in
    PEFT's own file names (its nested wrappers), and a resumed trainer reads them back under tandem's."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tandem.cli import main
    from tandem.modeling import load_causal_lm
    from tandem.workers.hybrid import HybridWorker

    tiny_model = request.getfixturevalue(model)
    out = tmp_path / "run"
    cfg = lora_config(tiny_model, out, "run.steps=2")
    train(cfg)
    last = checkpoint.latest(out / "checkpoints")
    if model == "moe_model":
        from safetensors.torch import load_file

        saved = load_file(str(last / "adapter_model.safetensors"))
        experts = {n: tuple(t.shape) for n, t in saved.items() if ".mlp.experts." in n}
        # per layer, gate_up [E=4, 2I=64, H=64] and down [4, H, I=32]: A [E*r, in], B [out, r*E], r = 4
        assert sorted(experts.values()) == sorted([(16, 64), (64, 16), (16, 32), (64, 16)] * 2), experts
        assert all(float(t.abs().max()) > 0 for n, t in saved.items() if "lora_B" in n)  # every adapter moved
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
    assert "library_name: peft" in (last / "README.md").read_text()  # each folder's card says what it holds
    card = (merged / "README.md").read_text()
    assert "library_name: transformers" in card and "merged into the base (`tandem export`)" in card
    assert f"base_model: {tiny_model}" in card
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


def test_lora_on_the_experts_is_refused_before_any_model_loads_where_it_cannot_run(moe_model, tiny_model, tmp_path,
                                                                                  monkeypatch):
    from tandem import modeling

    monkeypatch.setattr(modeling, "load_causal_lm", lambda *a, **k: pytest.fail("a model loaded"))
    cases = [
        (moe_model, ("lora.dropout=0.1",), r"lora.dropout: 0.1 with adapters on parameters \(\['mlp.experts"),
        (moe_model, ("lora.target_parameters=[mlp.experts.up_proj]",),
         r"\['mlp.experts.up_proj'\] match no parameter.*stacked \(expert\) parameters are \["
         r"'mlp.experts.down_proj', 'mlp.experts.gate_up_proj'\]"),
        (tiny_model, ("lora.target_parameters=[mlp.experts.gate_up_proj]",), "which has no stacked"),
        (moe_model, ("placement.backend=ray", "placement.workers=2", "placement.expert_parallel=2"),
         r"lora.enabled with placement.expert_parallel: 2 adapts the experts"),
    ]
    for model, extra, words in cases:
        with pytest.raises(ConfigError, match=words):
            start_run(lora_config(model, tmp_path / "run", *extra), claim_output_dir=False)
    # the attention alone under EP is accepted (its training measured by hand: docs/design-notes.md, "LoRA")
    lora_config(moe_model, tmp_path / "run", "placement.backend=ray", "placement.workers=2",
                "placement.expert_parallel=2", "lora.target_modules=[q_proj, v_proj]")


def test_the_experts_merge_is_peft_s_delta_and_a_shard_merges_its_own_experts():
    """merge_experts against PEFT's own delta of its stacked-parameter wrapper (random A and B): the
    trainer's merge and every sampler's are this function, and a rank holding experts 2..3 of 4 gets their rows."""
    from peft import LoraConfig as PeftLoraConfig, get_peft_model
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from tandem.rollout.adapter import merge_experts
    from tandem.train.lora import adapted

    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=32, hidden_size=16, moe_intermediate_size=8, num_hidden_layers=1,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=4,
                            num_experts_per_tok=2)
    model = Qwen3MoeForCausalLM(config).double()
    get_peft_model(model, PeftLoraConfig(r=3, lora_alpha=5, target_modules=[],
                                         target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))
    layers = adapted(model)
    assert list(layers) == ["model.layers.0.mlp.experts.down_proj", "model.layers.0.mlp.experts.gate_up_proj"]
    for layer in layers.values():
        a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
        with torch.no_grad():
            b.normal_()
        w, scale = layer.get_param(), layer.scaling["default"]
        merged = merge_experts(w.detach(), a.detach(), b.detach(), scale)
        # the products in fp32, as `merge`'s: agreement to fp32 rounding (an expert's A or B columns taken in
        # another order differ by O(1))
        torch.testing.assert_close(merged - w, layer.get_delta_weight("default").detach(), rtol=1e-5, atol=1e-6)
        shard = merge_experts(w.detach()[2:], a.detach(), b.detach(), scale, first=2, experts=4)
        assert torch.equal(shard, merged[2:])


def test_a_sampler_merges_the_experts_as_the_trainer_does_under_either_engine_s_names(moe_model, tmp_path):
    """A split sampler gets the adapter alone; its merge into the base it assembles from the checkpoint's per-expert
    tensors is, bit for bit, what the trainer's merged weights give an engine: by the trainer's stacked names (the
    hf engine) and cut into the checkpoint's per-expert names (vLLM). An adapter missing an expert tensor, or with
    one mis-shaped, is refused naming it."""
    from tandem.architectures import profile
    from tandem.config import LoraConfig as Lora
    from tandem.modeling import load_causal_lm
    from tandem.rollout.adapter import A_SUFFIX
    from tandem.sync.convert import ToCheckpoint
    from tandem.train.lora import adapter_weights, merged_weights, wrap
    from tandem.workers.rollout import merged_adapter

    model = load_causal_lm(moe_model)
    wrap(model, Lora(enabled=True, rank=4, alpha=8), profile(moe_model), seed=0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_()
    adapter = adapter_weights(model)
    stems = [n.removesuffix(A_SUFFIX) for n in adapter if n.endswith(A_SUFFIX)]
    fused = dict(merged_weights(model))
    per_expert = dict(ToCheckpoint.of_model(model, fused.items()).views(fused.items()))
    cfg = lora_config(moe_model, tmp_path / "run")
    for want, expert in ((fused, "model.layers.1.mlp.experts.down_proj"),
                         (per_expert, "model.layers.1.mlp.experts.3.down_proj.weight")):
        got = dict(merged_adapter(cfg, stems, torch.float32, "cpu", set(want)).merged(adapter))
        assert expert in got and got.keys() <= want.keys()
        assert [n for n, t in got.items() if not torch.equal(t, want[n])] == []
    sampler = merged_adapter(cfg, stems, torch.float32, "cpu", set(per_expert))
    expert_a = "model.layers.1.mlp.experts.down_proj" + A_SUFFIX
    with pytest.raises(ValueError, match=re.escape(expert_a)):
        sampler.merged({n: t for n, t in adapter.items() if n != expert_a})
    with pytest.raises(ValueError, match=re.escape(expert_a)):
        sampler.merged(dict(adapter, **{expert_a: adapter[expert_a][:-4]}))  # one expert's rows short


def test_lora_defaults_per_architecture():
    from tandem.architectures import lora_targets

    assert lora_targets("qwen2") == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert lora_targets("phi3") == ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    assert lora_targets("mixtral") == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert lora_targets("some_new_model") == "all-linear"
    from tandem.architectures import lora_parameter_targets

    assert lora_parameter_targets("qwen3_moe") == lora_parameter_targets("mixtral") == [
        "mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    assert lora_parameter_targets("qwen2") == lora_parameter_targets("some_new_model") == []
    assert load_config(None, []).lora.enabled is False
