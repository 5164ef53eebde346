"""LoRA on the policy through PEFT: the config checked on a weightless model, adapter tensors named, merged weights."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch

from tandem.config import ConfigError, LoraConfig
from tandem.rollout.adapter import A_SUFFIX, B_SUFFIX, merge

ADAPTER = "default"  # PEFT's name for a model's one adapter
# In memory and on the wire an adapter tensor is named after the HF module it adapts (rollout.adapter's A_SUFFIX,
# B_SUFFIX): PEFT's file names without its `base_model.model.` prefix.
PEFT_PREFIX = "base_model.model."
ADAPTER_FILE, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"


def peft_config(cfg: LoraConfig, model_path: str, model_type: str):
    """PEFT's LoraConfig for `cfg`: the architecture's default targets when none are named."""
    from peft import LoraConfig as PeftLoraConfig

    from tandem.architectures import lora_targets

    targets = list(cfg.target_modules) or lora_targets(model_type)
    return PeftLoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, bias="none",
                          target_modules=targets, task_type="CAUSAL_LM",
                          base_model_name_or_path=str(Path(model_path).expanduser().resolve()))  # export finds it


def wrap(model, cfg: LoraConfig, model_path: str, seed: int):
    """Adapters into `model` in place (its targeted linears become LoRA layers, every base weight frozen); returns
    the PeftModel around it, whose `disable_adapter()` gives the base model back for reference logprobs.

    A's random initialization comes from `seed` alone (B starts at zero), so every rank of a sharded policy starts
    from the same adapter as one process does; the caller's random stream is left as it was."""
    from peft import get_peft_model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return get_peft_model(model, peft_config(cfg, model_path, model.config.model_type))


def check(cfg: LoraConfig, model_path: str, trust_remote_code: bool = False) -> None:
    """Refuse, before any weights load, adapters PEFT cannot put on this model: wraps a weightless copy (meta
    device) built from the folder's config.json."""
    if not cfg.enabled:
        return
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_path), trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    linears = sorted({n.rpartition(".")[2] for n, m in skeleton.named_modules() if isinstance(m, torch.nn.Linear)})
    named = list(cfg.target_modules)
    missing = [t for t in named if not any(n == t or n.endswith("." + t) for n, _ in skeleton.named_modules())]
    if missing:
        raise ConfigError(f"lora.target_modules: {missing} match no module of this {config.model_type} model; its "
                          f"linear layers are {linears} (or leave the list empty for the architecture's default)")
    try:
        from peft import get_peft_model

        get_peft_model(skeleton, peft_config(cfg, model_path, config.model_type))
    except (ValueError, TypeError, NotImplementedError) as exc:
        raise ConfigError(f"lora: PEFT cannot put adapters on this {config.model_type} model ({exc}); name linear "
                          f"layers in lora.target_modules (this model's: {linears}), or train it without LoRA "
                          "(lora.enabled: false)") from None


def hf_module(name: str) -> str:
    """The HF module name in a LoRA model's parameter name (`...q_proj.lora_A.default.weight` -> `...q_proj`)."""
    for part in (".lora_A.", ".lora_B.", ".base_layer."):
        if part in name:
            return name.split(part)[0]
    return name.rpartition(".")[0]


def lora_layers(model) -> dict[str, torch.nn.Module]:
    """HF module name -> LoRA layer, in module order."""
    from peft.tuners.lora import LoraLayer

    return {n: m for n, m in model.named_modules() if isinstance(m, LoraLayer)}


def adapter_weights(model) -> dict[str, torch.Tensor]:
    """The adapter's tensors (DTensor shards under FSDP) by their wire names, A before B, in module order."""
    out = {}
    for name, layer in lora_layers(model).items():
        out[name + A_SUFFIX] = layer.lora_A[ADAPTER].weight.detach()
        out[name + B_SUFFIX] = layer.lora_B[ADAPTER].weight.detach()
    return out


def base_name(name: str) -> str:
    """A LoRA model's parameter name as the plain model's (`...q_proj.base_layer.weight` -> `...q_proj.weight`)."""
    return name.replace(".base_layer.", ".")


@torch.no_grad()
def merged_weights(model) -> Iterator[tuple[str, torch.Tensor]]:
    """Every weight of the plain model, each adapted one as W + (alpha/r) B @ A: what an engine serving the merged
    model loads. Under FSDP each rank merges its own rows (B and W are sharded alike along `out`; A, r rows, is
    gathered), so the result is sharded like W and no full weight is ever built."""
    layers = lora_layers(model)
    for name, p in model.named_parameters():
        if ".lora_" in name:
            continue
        module = hf_module(name)
        layer = layers.get(module)
        if layer is None or not name.endswith(".base_layer.weight"):
            yield base_name(name), p.detach()
            continue
        yield base_name(name), _merged(p.detach(), layer)


def _merged(w: torch.Tensor, layer) -> torch.Tensor:
    a, b = layer.lora_A[ADAPTER].weight.detach(), layer.lora_B[ADAPTER].weight.detach()
    scale = layer.scaling[ADAPTER]
    if not hasattr(w, "_local_tensor"):
        return merge(w, a, b, scale, layer.fan_in_fan_out)
    from torch.distributed.tensor import DTensor

    a_full = a.full_tensor() if hasattr(a, "_local_tensor") else a
    b_local = b.to_local() if hasattr(b, "_local_tensor") else b
    local = merge(w.to_local(), a_full, b_local, scale, layer.fan_in_fan_out)
    return DTensor.from_local(local, w.device_mesh, w.placements, run_check=False, shape=w.shape, stride=w.stride())


# ------------------------------------------------------------------------------------------------ checkpoints

def save_adapter(peft_model, adapter: dict[str, torch.Tensor], folder: str) -> None:
    """The adapter in PEFT's own format (adapter_config.json + adapter_model.safetensors), loadable by
    `PeftModel.from_pretrained(base, folder)` as is. `adapter`: full CPU tensors by wire name."""
    from safetensors.torch import save_file

    save_file({PEFT_PREFIX + n: t.contiguous() for n, t in adapter.items()}, str(Path(folder) / ADAPTER_FILE),
              metadata={"format": "pt"})
    peft_model.peft_config[ADAPTER].save_pretrained(folder)


def read_adapter(folder: str) -> dict[str, torch.Tensor]:
    """A saved adapter's tensors by wire name."""
    from safetensors.torch import load_file

    path = Path(folder) / ADAPTER_FILE
    if not path.is_file():
        raise ValueError(f"checkpoint {folder}: no {ADAPTER_FILE}; it was not saved by a LoRA run (lora.enabled: "
                         "true), so it cannot resume one")
    return {n.removeprefix(PEFT_PREFIX): t for n, t in load_file(str(path)).items()}


def export_merged(checkpoint: str, out: str, base: str | None = None, dtype: str = "float32",
                  force: bool = False) -> Path:
    """A LoRA checkpoint as a plain Hugging Face folder: its adapter merged into the base model (the folder its
    adapter_config.json names, or `base`), saved with the checkpoint's tokenizer; loadable by transformers and vLLM.
    An existing `out` is refused unless `force`; the folder is written beside it and renamed into place, so `out`
    is never half written (a kill leaves the old one, or none, and a hidden `.NAME.tmp-PID` folder)."""
    import json
    import os
    import shutil

    from peft import PeftModel

    from tandem.modeling import check_model_folder, load_causal_lm, load_tokenizer

    folder, target = Path(checkpoint), Path(out)
    if not (folder / ADAPTER_CONFIG).is_file():
        raise ValueError(f"export: {checkpoint} has no {ADAPTER_CONFIG}: it is not a LoRA checkpoint (a full "
                         "fine-tuning checkpoint is a Hugging Face model folder already: load it as is)")
    if target.exists() and not (force and target.is_dir()):
        what = "a folder" if target.is_dir() else "a file, not a folder"
        raise ValueError(f"export: {out} exists already ({what}); choose another output folder"
                         + (", or pass --force to replace it" if target.is_dir() else ""))
    base = base or json.loads((folder / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path") or ""
    check_model_folder(base)  # names the problem, e.g. a base moved since training: pass --base
    model = PeftModel.from_pretrained(load_causal_lm(base, dtype), str(folder)).merge_and_unload()
    tmp, old = (target.with_name(f".{target.name}.{what}-{os.getpid()}") for what in ("tmp", "old"))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        load_tokenizer(folder).save_pretrained(tmp)
        if target.exists():  # --force: the old folder goes only once the new one is whole
            os.rename(target, old)
        try:
            os.rename(tmp, target)
        except OSError:
            if old.exists():
                os.rename(old, target)
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(old, ignore_errors=True)
    return target
