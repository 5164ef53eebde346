"""The model profile (tandem.architectures.profile): what each zoo architecture and vision-language family is, read
once from config.json and true of the loaded model; every refusal of the table fires from config.json alone."""
from __future__ import annotations

import dataclasses
import json
import pickle
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the zoo's builder
import zoo_models  # noqa: E402

from tandem import modeling, moe  # noqa: E402
from tandem.architectures import REFUSALS, SUPPORT, profile, profile_of  # noqa: E402
from tandem.config import ConfigError, load_config  # noqa: E402
from tandem.run.preflight import check_supported  # noqa: E402

# how each zoo architecture runs a group's prompt once in the trainer's logprobs ("" every row whole)
PROMPTS_ONCE = {"llama": "kv", "qwen3_5_text": "state"}
# the zoo architectures that train padded whatever batch.padding_free says (tests/train/test_packing.py shows why)
PADDED = ("qwen3_5_text", "qwen3_5_moe_text", "gpt_oss")


@pytest.fixture(scope="module")
def zoo(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("zoo")
    return {arch: zoo_models.build(root / arch, arch) for arch in zoo_models.ARCHITECTURES}


def _parts(p, model) -> None:
    """The profile's paths name the loaded model's language model (transformers' own `get_decoder`) and its layers."""
    assert p.module(model, p.language_model) is model.get_decoder()
    layers = p.layers(model)
    assert len(layers) == model.config.get_text_config().num_hidden_layers
    assert all(layer in set(p.module(model, p.language_model).modules()) for layer in layers)


@pytest.mark.parametrize("arch", zoo_models.ARCHITECTURES)
def test_the_profile_of_each_zoo_architecture_is_true_of_its_model(zoo, arch):
    p = profile(zoo[arch])
    assert pickle.loads(pickle.dumps(p)) == p  # it travels to workers as it is
    assert p.model_type == arch and p.support is SUPPORT[arch] and not p.images and p.vision_side(None) == {}
    model = modeling.load_causal_lm(zoo[arch])
    assert profile_of(model) == dataclasses.replace(p, path="")  # the folder's and the loaded model's agree
    _parts(p, model)
    assert p.tower_layers(model) == []
    assert p.prompts_once == PROMPTS_ONCE.get(arch, "")
    assert p.decodes_prompt_once == (arch == "llama")
    config = json.loads((zoo[arch] / "config.json").read_text())
    if SUPPORT[arch].experts:
        assert p.moe and p.experts == 4 and config[p.expert_key] == 4
        routers = moe.routers(model, dict(p.routers))
        assert len(routers) == sum(1 for layer in p.layers(model) if moe.routers(layer, dict(p.routers)))
        assert routers and p.routing(model).num_experts == p.experts
    else:
        assert not p.moe and p.experts == 0 and p.routers == () and p.routing(model) is None
    assert bool(p.unstreamable) == (arch in zoo_models.WINDOWED + zoo_models.HYBRID)
    assert p.packs == (arch not in PADDED)


def test_the_profiles_of_the_vision_language_families(vlm, qwen_vlm):
    """Idefics3 (a tower and a connector around a Llama) and Qwen2.5-VL (3-D positions; its connector inside the
    tower): the paths name the loaded model's parts, the vision side is everything outside the language model and
    the head, and prompts run once through the KV cache."""
    for folder, kind, mrope in ((vlm, "idefics3", ()), (qwen_vlm, "qwen2_5_vl", (4, 6, 6))):
        p = profile(folder)
        assert (p.model_type, p.support, p.images, p.mrope_section) == (kind, SUPPORT[kind], True, mrope)
        assert p.image_token_id == json.loads((folder / "config.json").read_text())["image_token_id"]
        assert p.prompts_once == "kv" and not p.decodes_prompt_once and not p.moe
        model = modeling.load_causal_lm(folder)
        _parts(p, model)
        tower = p.module(model, p.vision_tower)
        assert p.tower_layers(model) and all(b in set(tower.modules()) for b in p.tower_layers(model))
        assert isinstance(p.module(model, p.connector), torch.nn.Module)
        language = {id(x) for x in model.get_decoder().parameters()}
        language |= {id(x) for x in model.get_output_embeddings().parameters()}
        assert set(p.vision_side(model)) == {n for n, x in model.named_parameters() if id(x) not in language}
        assert profile_of(model).prompts_once == "kv" and p.packs


def _folder(tmp_path: Path, name: str, config: dict) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("teacher, says", [
    ({"model_type": "qwen3_moe", "num_experts": 4}, "has experts"),
    ({"model_type": "llama", "num_attention_heads": 3, "num_key_value_heads": 1}, "has 3 attention heads per"),
])
def test_a_teacher_beside_a_context_parallel_policy_is_checked_as_the_policy(tmp_path, teacher, says):
    """The teacher runs on the policy's mesh, split as it is: refused where context parallel does not cover it,
    unless it scores on workers of its own."""
    from tandem.run.preflight import _check_teacher_split

    folder = _folder(tmp_path, "teacher", teacher)
    ray = ["placement.backend=ray", "placement.workers=2", "placement.context_parallel=2",
           f"algo.distill.teacher={folder}"]
    with pytest.raises(ConfigError, match=f"algo.distill.teacher .*{says}.*placement.teacher_workers: 1"):
        _check_teacher_split(load_config(None, ray))
    _check_teacher_split(load_config(None, [*ray, "placement.teacher_workers=1"]))
    dense = _folder(tmp_path, "dense", {"model_type": "llama", "num_attention_heads": 4})
    _check_teacher_split(load_config(None, [*ray, f"algo.distill.teacher={dense}"]))


def test_every_refusal_fires_from_config_json_alone(tmp_path, monkeypatch):
    """Each `Refusal` of the table, raised by the preflight check with only a config.json in the folder (no weights,
    no tokenizer) and no model loaded; its error names the setting."""
    monkeypatch.setattr(modeling, "load_causal_lm", lambda *a, **k: pytest.fail("a model loaded"))
    monkeypatch.setattr(modeling, "weightless_model", lambda *a, **k: pytest.fail("a model was built"))
    llama = {"model_type": "llama"}
    idefics = {"model_type": "idefics3", "vision_config": {}, "text_config": llama, "image_token_id": 5}
    ray = ["placement.backend=ray", "placement.workers=4"]
    stream = ["placement.backend=ray", "placement.mode=split", "placement.schedule=stream"]
    cases = [
        (idefics, stream, "placement.schedule: stream"),
        (idefics, ["placement.backend=ray", "placement.workers=2", "placement.tensor_parallel=2"],
         "placement.tensor_parallel: 2"),
        (idefics, ["env.name=calculator"], "env.name: calculator"),
        (idefics, [f"algo.distill.teacher={tmp_path}"], "algo.distill.teacher"),
        ({"model_type": "llava", "vision_config": {}, "text_config": llama}, [], "outside the model zoo"),
        (llama, ["algo.router_replay=true"], "algo.router_replay: true"),
        ({"model_type": "qwen3_moe", "num_experts": 4}, stream + ["algo.router_replay=true"], "algo.router_replay"),
        ({"model_type": "gpt_neox"}, stream, "placement.schedule: stream on the hf engine"),
        ({"model_type": "gemma3_text", "layer_types": ["sliding_attention", "full_attention"]}, stream,
         "placement.schedule: stream: model.path"),
        ({"model_type": "gpt_neox"}, ["rollout.engine=vllm"], "rollout.engine: vllm"),
        (llama, ray + ["placement.expert_parallel=2"], "placement.expert_parallel: 2"),
        ({"model_type": "qwen3_moe", "num_experts": 6}, ray + ["placement.expert_parallel=4"],
         "placement.expert_parallel: 4 does not divide the model's num_experts=6"),
        ({"model_type": "deepseek_v3", "n_routed_experts": 4}, ["rollout.engine=vllm"], "scoring_func=None"),
        ({"model_type": "qwen3_moe", "num_experts": 4}, ray + ["placement.context_parallel=2"],
         "placement.context_parallel: 2, but model.path is Qwen3-MoE ('qwen3_moe'), which has experts"),
        ({"model_type": "llama", "num_attention_heads": 6, "num_key_value_heads": 2},
         ray + ["placement.context_parallel=4"], "placement.context_parallel: 4 does not divide the model's 6 "
         "attention heads per tensor-parallel rank"),
    ]
    if not torch.cuda.is_available():
        cases.append(({"model_type": "qwen3_5_text"}, ["rollout.engine=vllm"], "on a machine without a GPU"))
    fired = []
    for i, (config, overrides, says) in enumerate(cases):
        folder = _folder(tmp_path, str(i), config)
        cfg = load_config(None, [f"model.path={folder}", *overrides])
        p = profile(folder)
        first = next(r for r in p.refusals if r.applies(cfg, p))
        with pytest.raises(ConfigError) as raised:
            check_supported(cfg, p)
        assert str(raised.value) == first.reason(cfg, p) and says in str(raised.value), (config, overrides)
        fired.append(first)
    wanted = [r for r in REFUSALS if torch.cuda.is_available() is False or "without a GPU" not in r.setting]
    assert [r for r in wanted if r not in fired] == [], "a refusal no case makes fire"


def test_only_what_the_zoo_checked_trains_padding_free():
    """Packing needs model code that keeps the rows apart: the zoo's architectures where `Support.no_packing` says
    nothing, unless the checkpoint has linear-attention layers; an architecture outside the zoo runs padded."""
    from tandem.architectures import resolve

    assert resolve({"model_type": "qwen3"}).packs
    assert not resolve({"model_type": "qwen3", "layer_types": ["linear_attention", "full_attention"]}).packs
    assert not resolve({"model_type": "some_new_arch"}).packs
    assert all(bool(s.no_packing) == (kind in PADDED) for kind, s in SUPPORT.items() if not s.vision)
