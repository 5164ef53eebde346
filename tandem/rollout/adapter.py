"""A sampler's LoRA: the base weights of the adapted modules kept, each received adapter merged into them."""
from __future__ import annotations

from pathlib import Path

import torch

from tandem.lora_merge import A_SUFFIX, B_SUFFIX, merge, merge_experts
from tandem.rollout.manifest import Spec


def base_tensors(model_path: str, names: set[str]) -> dict:
    """Tensors of the checkpoint in `model_path` by name; every name must be there."""
    from safetensors import safe_open

    out: dict = {}
    for f in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            for name in set(fh.keys()) & names:
                out[name] = fh.get_tensor(name)
    lost = sorted(names - set(out))
    if lost:
        raise ValueError(f"the adapter adapts {lost[:4]}{' ...' if len(lost) > 4 else ''}, which the checkpoint in "
                         f"{model_path} does not have: the trainer's model is not this sampler's")
    return out


def adapted_shapes(model, stems: list[str]) -> dict[str, tuple[int, ...]]:
    """The weight each adapter stem adapts -> its shape, in `model` (a weightless one serves): `<stem>.weight` of a
    linear layer [out, in], or the stem itself for stacked experts [E, out, in]."""
    params = {n: tuple(p.shape) for n, p in model.named_parameters()}
    out, lost = {}, []
    for stem in stems:
        name = stem + ".weight" if stem + ".weight" in params else stem
        if name in params and len(params[name]) in (2, 3):
            out[name] = params[name]
        else:
            lost.append(stem)
    if lost:
        raise ValueError(f"the adapter adapts {lost[:4]}{' ...' if len(lost) > 4 else ''}, which this sampler's "
                         f"{model.config.model_type} model does not have: the trainer's model is not this sampler's")
    return out


def adapter_manifest(shapes: dict[str, tuple[int, ...]], rank: int, dtype: torch.dtype) -> dict[str, Spec]:
    """What each adapter update must bring: A and B of every adapted weight (`adapted_shapes`)."""
    out: dict[str, Spec] = {}
    for name, shape in shapes.items():
        experts, (rows, cols) = (shape[0] if len(shape) == 3 else 1), shape[-2:]
        stem = name.removesuffix(".weight")
        out[stem + A_SUFFIX] = ((rank * experts, cols), dtype)
        out[stem + B_SUFFIX] = ((rows, rank * experts), dtype)
    return out


class MergedAdapter:
    """Turns an adapter into the merged weights W0 + (alpha / r) B @ A of the weights it adapts (per expert for
    stacked experts), for an engine's `load_weights`: the engine then samples at the plain model's speed (no adapter
    modules in its forward), and a sampler needs only the adapter's bytes per step.

    `shapes`: the adapted weights by the trainer's names (`adapted_shapes`); their base weights W0 are read once
    from the model's own checkpoint files (`model_path`, as the engine itself loaded) and kept, in `dtype`, on
    `device`. `conversion` (a `tandem.sync.convert.ToCheckpoint` of the stacked experts) says which checkpoint
    tensors each stacked weight is made of: the base is assembled from them, and with `to_checkpoint` (an engine
    that loads the checkpoint's names, vLLM) each merged stacked weight goes out as them, views of it.
    """

    def __init__(self, model_path: str, shapes: dict[str, tuple[int, ...]], rank: int, alpha: float,
                 dtype: torch.dtype, device: str | torch.device = "cpu", conversion=None, to_checkpoint: bool = False):
        self.scale = alpha / rank
        self.manifest = adapter_manifest(shapes, rank, dtype)
        cuts = {n: conversion.by_source[n] for n in shapes if conversion is not None and n in conversion.by_source}
        stored = base_tensors(model_path, {n for n in shapes if n not in cuts} | {c for n in cuts for c, _ in cuts[n]})
        self.base: dict[str, torch.Tensor] = {}
        for name, shape in shapes.items():
            if name not in cuts:
                self.base[name] = stored[name].to(device=device, dtype=dtype)
                continue
            fused = self.base[name] = torch.empty(shape, device=device, dtype=dtype)
            for ckpt, cut in cuts[name]:
                cut.view(fused).copy_(stored.pop(ckpt))
        self._to_checkpoint = conversion if to_checkpoint and cuts else None

    @torch.no_grad()
    def merged(self, adapter: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        """(engine's weight name, W0 + scale * B @ A) of every adapted weight; `adapter` must hold all their
        tensors."""
        from tandem.rollout.manifest import check_manifest

        check_manifest(self.manifest, list(adapter.items()), "the sampler's adapter", complete=True)
        out = []
        for name, w0 in self.base.items():
            stem = name.removesuffix(".weight")
            a, b = (adapter[stem + s].to(w0.device) for s in (A_SUFFIX, B_SUFFIX))
            out.append((name, merge_experts(w0, a, b, self.scale) if w0.dim() == 3 else merge(w0, a, b, self.scale)))
        return list(self._to_checkpoint.views(out)) if self._to_checkpoint is not None else out
