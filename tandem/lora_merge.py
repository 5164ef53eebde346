"""LoRA's merge, W + (alpha / r) B @ A, and the wire names of an adapter's tensors: one definition for the trainer
(tandem.train.lora) and every sampler (tandem.rollout.adapter), so that their merged weights agree to the bit."""
from __future__ import annotations

import torch

# Wire names of an adapter's tensors (tandem.train.lora names them so): `<stem>.lora_A.weight` [r, in] and
# `<stem>.lora_B.weight` [out, r], the stem being the adapted weight's name less `.weight` (`...q_proj`). For stacked
# experts [E, out, in] the stem is the parameter's own name (`...mlp.experts.gate_up_proj`) and the tensors are
# PEFT's: A [E*r, in], expert e's rows e*r..(e+1)*r; B [out, r*E], its columns e, E+e, 2E+e, ... (see merge_experts).
A_SUFFIX, B_SUFFIX = ".lora_A.weight", ".lora_B.weight"


def merge(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float,
          fan_in_fan_out: bool = False) -> torch.Tensor:
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
