"""The arithmetic demo's model in two more architecture families, warm-started as the dense one: a tiny Qwen3-MoE
(`examples/moe.yaml`) and a tiny Qwen3.5 (`examples/qwen3_5.yaml`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from tandem.demo.arithmetic import DemoModelSpec


@dataclass(frozen=True)
class MoEDemoSpec(DemoModelSpec):
    """The demo's model as a tiny Qwen3-MoE (`examples/moe.yaml`): each layer's MLP is `experts` experts of which
    each token uses `experts_per_token`, as many active MLP parameters per token as the dense demo's."""

    folder: ClassVar[str] = "demo-moe"
    experts: int = 4
    experts_per_token: int = 2
    # a multiple of 32: vLLM-CPU's MoE kernel pads other sizes, and its weight reload cannot write padded experts
    expert_intermediate_size: int = 256
    head_dim: int = 32  # Qwen3 sets it apart from hidden / heads; vLLM-CPU's attention wants >= 32

    def build(self, tokenizer):
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        cfg = Qwen3MoeConfig(
            vocab_size=len(tokenizer), hidden_size=self.hidden_size, num_hidden_layers=self.layers,
            num_attention_heads=self.heads, num_key_value_heads=self.kv_heads, head_dim=self.head_dim,
            num_experts=self.experts, num_experts_per_tok=self.experts_per_token,
            moe_intermediate_size=self.expert_intermediate_size, decoder_sparse_step=1, norm_topk_prob=True,
            max_position_embeddings=128, tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id,
            bos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, use_cache=True,
        )
        torch.manual_seed(self.seed)
        return Qwen3MoeForCausalLM(cfg)


@dataclass(frozen=True)
class HybridDemoSpec(DemoModelSpec):
    """The demo's model as a tiny Qwen3.5 (`examples/qwen3_5.yaml`): Gated DeltaNet layers (linear attention: a
    recurrent state and a short convolution), then one gated full-attention layer, three to one as in the released
    checkpoints."""

    folder: ClassVar[str] = "demo-qwen3_5"
    layers: int = 4
    head_dim: int = 32  # the full-attention layer's
    linear_key_heads: int = 2
    linear_value_heads: int = 4  # more value heads than key heads, as Qwen3.5's
    linear_head_dim: int = 32
    conv_kernel: int = 4

    def build(self, tokenizer):
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

        cfg = Qwen3_5TextConfig(
            vocab_size=len(tokenizer), hidden_size=self.hidden_size, num_hidden_layers=self.layers,
            num_attention_heads=self.heads, num_key_value_heads=self.kv_heads, head_dim=self.head_dim,
            intermediate_size=self.intermediate_size, layer_types=["linear_attention"] * (self.layers - 1)
            + ["full_attention"], linear_num_key_heads=self.linear_key_heads,
            linear_num_value_heads=self.linear_value_heads, linear_key_head_dim=self.linear_head_dim,
            linear_value_head_dim=self.linear_head_dim, linear_conv_kernel_dim=self.conv_kernel,
            max_position_embeddings=128, tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
            bos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, use_cache=True,
        )
        torch.manual_seed(self.seed)
        return Qwen3_5ForCausalLM(cfg)
