"""A synthetic Qwen2-style parameter set and its Megatron-style layout rule, for the resharding tests and benchmark."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from tandem.sync.layout import Spec


@dataclass(frozen=True)
class Qwen2Shape:
    """A Qwen2-style decoder's parameter set with the rollout engines' fused names (qkv_proj, gate_up_proj);
    experts > 0 makes each MLP a mixture of experts with a router."""
    vocab: int = 1024
    hidden: int = 256
    layers: int = 2
    heads: int = 8
    kv_heads: int = 2
    intermediate: int = 512
    experts: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def params(self, dtype: torch.dtype = torch.float32) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        h, d, i = self.hidden, self.head_dim, self.intermediate
        qkv = (self.heads + 2 * self.kv_heads) * d
        out = {"model.embed_tokens.weight": (self.vocab, h)}
        for layer in range(self.layers):
            p = f"model.layers.{layer}."
            out |= {p + "input_layernorm.weight": (h,), p + "self_attn.qkv_proj.weight": (qkv, h),
                    p + "self_attn.qkv_proj.bias": (qkv,), p + "self_attn.o_proj.weight": (h, self.heads * d),
                    p + "post_attention_layernorm.weight": (h,)}
            mlps = [p + f"mlp.experts.{e}." for e in range(self.experts)] if self.experts else [p + "mlp."]
            if self.experts:
                out[p + "mlp.gate.weight"] = (self.experts, h)
            for m in mlps:
                out |= {m + "gate_up_proj.weight": (2 * i, h), m + "down_proj.weight": (h, i)}
        out |= {"model.norm.weight": (h,), "lm_head.weight": (self.vocab, h)}
        return {k: (v, dtype) for k, v in out.items()}

    def spec(self, pp: int = 1, ep: int = 1, zero: str | None = None) -> Callable[[str], Spec]:
        """Megatron-style placement: vocab-parallel embedding and head, column qkv / gate_up (split per part),
        row o / down, replicated norms and router; layers cut into `pp` even stages; experts over `ep`."""
        d = self.head_dim
        qkv_parts = (self.heads * d, self.kv_heads * d, self.kv_heads * d)
        mlp_parts = (self.intermediate, self.intermediate)

        def rule(name: str) -> Spec:
            if name.startswith("model.layers."):
                stage = int(name.split(".")[2]) * pp // self.layers
            else:
                stage = 0 if "embed_tokens" in name else pp - 1
            expert = int(name.split(".experts.")[1].split(".")[0]) if ".experts." in name else None
            common = dict(stage=stage, expert=expert, experts_per_rank=max(1, self.experts // ep), zero=zero)
            if "qkv_proj" in name:
                return Spec(tp_dim=0, parts=qkv_parts, **common)
            if "gate_up_proj" in name:
                return Spec(tp_dim=0, parts=mlp_parts, **common)
            if "o_proj" in name or "down_proj" in name:
                return Spec(tp_dim=1, **common)
            if "embed_tokens" in name or "lm_head" in name:
                return Spec(tp_dim=0, **common)
            return Spec(**common)  # norms, router: replicated

        return rule
