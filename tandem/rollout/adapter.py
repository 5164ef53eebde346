"""A sampler's LoRA: the base weights of the adapted modules kept, each received adapter merged into them."""
from __future__ import annotations

from pathlib import Path

import torch

from tandem.rollout.manifest import Spec

# Wire names of an adapter's tensors: `<HF module>.lora_A.weight` [r, in], `<HF module>.lora_B.weight` [out, r]
# (tandem.train.lora names them so).
A_SUFFIX, B_SUFFIX = ".lora_A.weight", ".lora_B.weight"


def base_tensors(model_path: str, names: set[str], shapes_only: bool = False) -> dict:
    """Tensors (or with `shapes_only` their shapes, from the headers) of the checkpoint in `model_path`; every name
    must be there."""
    from safetensors import safe_open

    out: dict = {}
    for f in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            for name in set(fh.keys()) & names:
                out[name] = tuple(fh.get_slice(name).get_shape()) if shapes_only else fh.get_tensor(name)
    lost = sorted(names - set(out))
    if lost:
        raise ValueError(f"the adapter adapts {lost[:4]}{' ...' if len(lost) > 4 else ''}, which the checkpoint in "
                         f"{model_path} does not have: the trainer's model is not this sampler's")
    return out


def adapter_manifest(model_path: str, modules: list[str], rank: int, dtype: torch.dtype) -> dict[str, Spec]:
    """What each adapter update must bring: A [rank, in] and B [out, rank] of every adapted module."""
    out: dict[str, Spec] = {}
    for name, (rows, cols) in base_tensors(model_path, {m + ".weight" for m in modules}, shapes_only=True).items():
        module = name.removesuffix(".weight")
        out[module + A_SUFFIX] = ((rank, cols), dtype)
        out[module + B_SUFFIX] = ((rows, rank), dtype)
    return out


class MergedAdapter:
    """Turns an adapter into the merged weights W0 + (alpha / r) B @ A of the modules it adapts, for an engine's
    `load_weights`: the engine then samples at the plain model's speed (the hf engine's lean decoder stays as it is),
    and a sampler needs only the adapter's bytes per step.

    `modules`: the HF module names the adapter adapts; their base weights W0 are read once from the model's own
    checkpoint files (`model_path`, as the engine itself loaded) and kept, in `dtype`, on `device`.
    """

    def __init__(self, model_path: str, modules: list[str], rank: int, alpha: float, dtype: torch.dtype,
                 device: str | torch.device = "cpu"):
        self.scale = alpha / rank
        self.manifest = adapter_manifest(model_path, modules, rank, dtype)
        self.base = {n: t.to(device=device, dtype=dtype)
                     for n, t in base_tensors(model_path, {m + ".weight" for m in modules}).items()}

    @torch.no_grad()
    def merged(self, adapter: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        """(HF weight name, W0 + scale * B @ A) of every adapted module; `adapter` must hold all their tensors."""
        from tandem.rollout.manifest import check_manifest

        check_manifest(self.manifest, list(adapter.items()), "the sampler's adapter", complete=True)
        out = []
        for name, w0 in self.base.items():
            module = name.removesuffix(".weight")
            out.append((name, merge(w0, adapter[module + A_SUFFIX].to(w0.device),
                                    adapter[module + B_SUFFIX].to(w0.device), self.scale)))
        return out


def merge(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float, fan_in_fan_out: bool = False) -> torch.Tensor:
    """W + scale * B @ A in W's dtype (the product in fp32; transposed for a fan-in-fan-out layer, GPT-2's Conv1D).
    The trainer's merge and every sampler's are this one function, so their weights agree to the bit."""
    delta = (b.to(torch.float32) @ a.to(torch.float32)) * scale
    return w + (delta.T if fan_in_fan_out else delta).to(w.dtype)
