"""A sampler's LoRA: the base weights of the adapted modules kept, each received adapter merged into them."""
from __future__ import annotations

from pathlib import Path

import torch

from tandem.rollout.manifest import Spec

# Wire names of an adapter's tensors (tandem.train.lora names them so): `<stem>.lora_A.weight` [r, in] and
# `<stem>.lora_B.weight` [out, r], the stem being the adapted weight's name less `.weight` (`...q_proj`). For stacked
# experts [E, out, in] the stem is the parameter's own name (`...mlp.experts.gate_up_proj`) and the tensors are
# PEFT's: A [E*r, in], expert e's rows e*r..(e+1)*r; B [out, r*E], its columns e, E+e, 2E+e, ... (see merge_experts).
A_SUFFIX, B_SUFFIX = ".lora_A.weight", ".lora_B.weight"


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
    stacked experts), for an engine's `load_weights`: the engine then samples at the plain model's speed (the hf
    engine's lean decoder stays as it is), and a sampler needs only the adapter's bytes per step.

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


def merge(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float, fan_in_fan_out: bool = False) -> torch.Tensor:
    """W + scale * B @ A in W's dtype (the product in fp32; transposed for a fan-in-fan-out layer, GPT-2's Conv1D).
    The trainer's merge and every sampler's are this one function, so their weights agree to the bit."""
    delta = (b.to(torch.float32) @ a.to(torch.float32)) * scale
    return w + (delta.T if fan_in_fan_out else delta).to(w.dtype)


def merge_experts(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float, first: int = 0,
                  experts: int | None = None) -> torch.Tensor:
    """Stacked experts W [e, out, in] + scale * B_j @ A_j for each expert j = first .. first + e - 1 of `experts`
    (default e: W holds them all; a sharded trainer passes its own experts and the total), in W's dtype, the
    products in fp32. A [E*r, in] and B [out, r*E] in PEFT's layout (its ParamWrapper's): A_j is rows j*r..(j+1)*r
    of A, B_j is B's columns j, E+j, 2E+j, ... One function for the trainer and every sampler, as `merge`."""
    total, mine = experts or w.shape[0], slice(first, first + w.shape[0])
    a_j = a.to(torch.float32).view(total, -1, a.shape[-1])[mine]  # [e, r, in]
    b_j = b.to(torch.float32).view(b.shape[0], -1, total).permute(2, 0, 1)[mine]  # [e, out, r]
    return w + (torch.bmm(b_j, a_j) * scale).to(w.dtype)
