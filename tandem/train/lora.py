"""LoRA on the policy through PEFT: the config checked on a weightless model, adapter tensors named, merged weights."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch

from tandem.architectures import ModelProfile, language_model_targets, lora_targets_for
from tandem.config import ConfigError, LoraConfig
from tandem.lora_merge import A_SUFFIX, B_SUFFIX, merge, merge_experts

ADAPTER = "default"  # PEFT's name for a model's one adapter
# In memory and on the wire an adapter tensor is named after the weight it adapts (tandem.lora_merge's A_SUFFIX,
# B_SUFFIX): a linear layer's module (PEFT's file names without its `base_model.model.` prefix), or a stacked expert
# parameter itself; the adapter file keeps PEFT's names, which for nested parameter wrappers differ (_file_names).
PEFT_PREFIX = "base_model.model."
ADAPTER_FILE, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"


def peft_config(cfg: LoraConfig, profile: ModelProfile, model):
    """PEFT's LoraConfig for `cfg` on `model` (its weights may be on the meta device; `profile`: its checkpoint's):
    the architecture's default targets when none are named; in a vision-language model, only those of its language
    model (`profile.language_model`)."""
    from peft import LoraConfig as PeftLoraConfig

    modules, parameters = lora_targets_for(cfg, profile.model_type)
    if profile.images:
        decoder = profile.module(model, profile.language_model)
        linears = sorted({n.rpartition(".")[2] for n, m in decoder.named_modules() if isinstance(m, torch.nn.Linear)})
        modules = language_model_targets(modules, profile.language_model, linears)
    return PeftLoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, bias="none",
                          target_modules=modules, target_parameters=parameters or None, task_type="CAUSAL_LM",
                          base_model_name_or_path=str(Path(profile.path).expanduser().resolve()))  # export finds it


def wrap(model, cfg: LoraConfig, profile: ModelProfile, seed: int):
    """Adapters into `model` in place (its targeted linears become LoRA layers, every base weight frozen); returns
    the PeftModel around it, whose `disable_adapter()` gives the base model back for reference logprobs.

    A's random initialization comes from `seed` alone (B starts at zero), so every rank of a sharded policy starts
    from the same adapter as one process does; the caller's random stream is left as it was."""
    from peft import get_peft_model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return get_peft_model(model, peft_config(cfg, profile, model))


def check(cfg: LoraConfig, profile: ModelProfile, trust_remote_code: bool = False) -> None:
    """Refuse, before any weights load, adapters PEFT cannot put on this model, or whose merge tandem cannot do:
    wraps a weightless copy (meta device) built from the folder's config.json (`profile.path`)."""
    if not cfg.enabled:
        return
    from tandem.modeling import weightless_model

    skeleton = weightless_model(profile.path, trust_remote_code)
    config = skeleton.config
    linears = sorted({n.rpartition(".")[2] for n, m in skeleton.named_modules() if isinstance(m, torch.nn.Linear)})
    missing = [t for t in cfg.target_modules
               if not any(n == t or n.endswith("." + t) for n, _ in skeleton.named_modules())]
    if missing:
        raise ConfigError(f"lora.target_modules: {missing} match no module of this {config.model_type} model; its "
                          f"linear layers are {linears} (or leave the list empty for the architecture's default)")
    _, parameters = lora_targets_for(cfg, profile.model_type)
    stacked = sorted({n.split(".", 3)[-1] for n, p in skeleton.named_parameters() if p.dim() == 3})
    missing = [t for t in parameters if not any(n == t or n.endswith("." + t) for n, _ in skeleton.named_parameters())]
    if missing:
        raise ConfigError(f"lora.target_parameters: {missing} match no parameter of this {config.model_type} model"
                          + (f"; its stacked (expert) parameters are {stacked}" if stacked else ", which has no "
                             "stacked (expert) parameters: leave the list empty"))
    if parameters and cfg.dropout:
        raise ConfigError(f"lora.dropout: {cfg.dropout} with adapters on parameters ({parameters}): PEFT has no "
                          "dropout for those; set lora.dropout: 0, or name lora.target_modules alone")
    try:
        from peft import get_peft_model

        wrapped = get_peft_model(skeleton, peft_config(cfg, profile, skeleton))
    except (ValueError, TypeError, NotImplementedError) as exc:
        raise ConfigError(f"lora: PEFT cannot put adapters on this {config.model_type} model ({exc}); name linear "
                          f"layers in lora.target_modules (this model's: {linears}), or train it without LoRA "
                          "(lora.enabled: false)") from None
    # PEFT swaps a stacked parameter's in and out where it is [experts, out, in] (not marked `is_transposed`)
    unmergeable = [n for n, layer in adapted(wrapped.get_base_model()).items()
                   if _stacked(layer) and not layer._did_swap_in_out_features]
    if unmergeable:
        raise ConfigError(f"lora.target_parameters: {unmergeable[:2]} are stored [experts, in, out], which tandem "
                          "does not merge into an engine's weights (it merges [experts, out, in], transformers' "
                          "layout for Qwen3-MoE and Mixtral); leave them out of lora.target_parameters")


def plain_name(name: str) -> str:
    """A LoRA model's parameter or module name as the plain model's: PEFT's `base_layer` steps left out
    (`...q_proj.base_layer.weight` -> `...q_proj.weight`; nested wrappers of one module's parameters give several)."""
    return ".".join(part for part in name.split(".") if part != "base_layer")


def _layers(model) -> list[tuple[str, str, torch.nn.Module]]:
    """(plain name of the adapted weight, PEFT's module name, LoRA layer) of every adapter, in module order: a
    linear layer's weight `<module>.weight`, or a parameter PEFT adapts directly (an MoE's
    `...mlp.experts.gate_up_proj`, whose wrapper PEFT may nest in another's: `...mlp.experts.base_layer`)."""
    from peft.tuners.lora import LoraLayer, ParamWrapper

    out = []
    for name, module in model.named_modules():
        if isinstance(module, ParamWrapper):
            out.append((f"{plain_name(name)}.{module.parameter_name}", name, module))
        elif isinstance(module, LoraLayer):
            out.append((f"{plain_name(name)}.weight", name, module))
    return out


def adapted(model) -> dict[str, torch.nn.Module]:
    """The plain model's name of each adapted weight -> the LoRA layer that adapts it, in module order."""
    return {weight: layer for weight, _, layer in _layers(model)}


def _file_names(model) -> dict[str, str]:
    """Wire name -> the adapter file's name (PEFT's, by its module path) of every adapter tensor."""
    out = {}
    for weight, module, _ in _layers(model):
        stem = weight.removesuffix(".weight")
        out[stem + A_SUFFIX], out[stem + B_SUFFIX] = (f"{PEFT_PREFIX}{module}{s}" for s in (A_SUFFIX, B_SUFFIX))
    return out


def _stacked(layer) -> bool:
    """Whether `layer` adapts a stacked [experts, out, in] parameter (one adapter per expert)."""
    return hasattr(layer, "parameter_name") and layer.get_param().dim() == 3


def adapter_weights(model) -> dict[str, torch.Tensor]:
    """The adapter's tensors (DTensor shards under FSDP) by their wire names, A before B, in module order."""
    out = {}
    for weight, layer in adapted(model).items():
        stem = weight.removesuffix(".weight")
        out[stem + A_SUFFIX] = layer.lora_A[ADAPTER].weight.detach()
        out[stem + B_SUFFIX] = layer.lora_B[ADAPTER].weight.detach()
    return out


@torch.no_grad()
def merged_weights(model) -> Iterator[tuple[str, torch.Tensor]]:
    """Every weight of the plain model, each adapted one as W + (alpha/r) B @ A (per expert for stacked experts):
    what an engine serving the merged model loads. Under FSDP each rank merges its own rows (B and W are sharded
    alike along `out`, a stacked W along its experts; A, and for experts B, are gathered: r rows or columns per
    expert), so the result is sharded like W and no full weight is ever built."""
    layers = adapted(model)
    for name, p in model.named_parameters():
        if ".lora_" in name:
            continue
        plain = plain_name(name)
        layer = layers.get(plain)
        yield plain, (p.detach() if layer is None else _merged(p.detach(), layer))


def _merged(w: torch.Tensor, layer) -> torch.Tensor:
    a, b = layer.lora_A[ADAPTER].weight.detach(), layer.lora_B[ADAPTER].weight.detach()
    scale = layer.scaling[ADAPTER]
    if not hasattr(w, "_local_tensor"):
        if _stacked(layer):
            return merge_experts(w, a, b, scale)
        return merge(w, a, b, scale, layer.fan_in_fan_out)
    from torch.distributed.tensor import DTensor

    a_full = a.full_tensor() if hasattr(a, "_local_tensor") else a
    if _stacked(layer):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, offset = compute_local_shape_and_global_offset(w.shape, w.device_mesh, w.placements)
        b_full = b.full_tensor() if hasattr(b, "_local_tensor") else b
        local = merge_experts(w.to_local(), a_full, b_full, scale, first=offset[0], experts=w.shape[0])
    else:
        b_local = b.to_local() if hasattr(b, "_local_tensor") else b
        local = merge(w.to_local(), a_full, b_local, scale, layer.fan_in_fan_out)
    return DTensor.from_local(local, w.device_mesh, w.placements, run_check=False, shape=w.shape, stride=w.stride())


# ------------------------------------------------------------------------------------------------ checkpoints

def save_adapter(peft_model, adapter: dict[str, torch.Tensor], folder: str) -> None:
    """The adapter in PEFT's own format (adapter_config.json + adapter_model.safetensors), loadable by
    `PeftModel.from_pretrained(base, folder)` as is. `adapter`: full CPU tensors by wire name."""
    from safetensors.torch import save_file

    names = _file_names(peft_model.get_base_model())
    save_file({names[n]: t.contiguous() for n, t in adapter.items()}, str(Path(folder) / ADAPTER_FILE),
              metadata={"format": "pt"})
    peft_model.peft_config[ADAPTER].save_pretrained(folder)


def read_adapter(folder: str, model) -> dict[str, torch.Tensor]:
    """A saved adapter's tensors by wire name, for `model` (the LoRA model that names them); a tensor the model has
    no adapter for keeps its file name, which the caller's check then refuses."""
    from safetensors.torch import load_file

    path = Path(folder) / ADAPTER_FILE
    if not path.is_file():
        raise ValueError(f"checkpoint {folder}: no {ADAPTER_FILE}; it was not saved by a LoRA run (lora.enabled: "
                         "true), so it cannot resume one")
    wire = {f: n for n, f in _file_names(model).items()}
    return {wire.get(n, n): t for n, t in load_file(str(path)).items()}
