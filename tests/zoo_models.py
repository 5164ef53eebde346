"""Tiny random models of the architectures users bring (Llama 3, Qwen3, Gemma, Mistral, Phi-3, MoE), built locally."""
from __future__ import annotations

import functools
from pathlib import Path

import torch

HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, MLP = 64, 2, 2, 2, 32, 128  # vLLM-CPU attention needs head_dim >= 32


def _common(vocab: int, eos: int, pad: int) -> dict:
    return dict(vocab_size=vocab, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                num_key_value_heads=KV_HEADS, intermediate_size=MLP, max_position_embeddings=512,
                eos_token_id=eos, bos_token_id=eos, pad_token_id=pad, tie_word_embeddings=False)


def _configs(vocab: int, eos: int, pad: int) -> dict:
    """model_type -> (config class name, kwargs): one entry per architecture of the zoo."""
    c = _common(vocab, eos, pad)
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1,
               norm_topk_prob=True)
    hybrid = dict(layer_types=["linear_attention", "full_attention"], linear_conv_kernel_dim=4, linear_key_head_dim=16,
                  linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4)
    return {
        # Llama 3: GQA and its rope scaling (the 3.1 kind)
        "llama": ("LlamaConfig", dict(c, head_dim=HEAD_DIM, rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64})),
        "qwen3": ("Qwen3Config", dict(c, head_dim=HEAD_DIM, tie_word_embeddings=True)),
        "gemma": ("GemmaConfig", dict(c, head_dim=HEAD_DIM, tie_word_embeddings=True,
                                      hidden_activation="gelu_pytorch_tanh")),
        "mistral": ("MistralConfig", dict(c, head_dim=HEAD_DIM, sliding_window=None)),
        # Gemma 3 (text): a local layer (sliding window of 8, shorter than the tests' sequences) and a global one, q/k
        # norms, its own scaling of the queries, and the final logits soft-capped
        "gemma3_text": ("Gemma3TextConfig", dict(c, head_dim=HEAD_DIM, tie_word_embeddings=True, sliding_window=8,
                                                 layer_types=["sliding_attention", "full_attention"],
                                                 query_pre_attn_scalar=HEAD_DIM, final_logit_softcapping=30.0,
                                                 hidden_activation="gelu_pytorch_tanh")),
        # Phi-3 / Phi-4: fused qkv_proj and gate_up_proj; GQA as in Phi-4 (4 q heads, 2 kv heads: [q | k | v] of
        # unequal parts, split by heads under TP), head_dim = hidden / heads = 32
        "phi3": ("Phi3Config", dict(c, hidden_size=2 * HIDDEN, num_attention_heads=2 * HEADS,
                                    num_key_value_heads=KV_HEADS, pad_token_id=pad, resid_pdrop=0.0, embd_pdrop=0.0,
                                    attention_dropout=0.0, original_max_position_embeddings=512)),
        "qwen3_moe": ("Qwen3MoeConfig", dict(c, head_dim=HEAD_DIM, **moe)),
        "mixtral": ("MixtralConfig", dict(c, head_dim=HEAD_DIM, num_local_experts=4, num_experts_per_tok=2,
                                          sliding_window=None)),
        # gpt-oss: biased experts whose gate and up columns interleave, a biased router softmaxed over its top k,
        # attention sinks, biased projections, a sliding-window layer (8) and a full one
        "gpt_oss": ("GptOssConfig", dict(c, head_dim=HEAD_DIM, num_local_experts=4, num_experts_per_tok=2,
                                         intermediate_size=64, sliding_window=8,
                                         layer_types=["sliding_attention", "full_attention"],
                                         rope_scaling={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0,
                                                       "beta_slow": 1.0, "original_max_position_embeddings": 64,
                                                       "truncate": False})),
        # GLM-4.5: a dense first layer, then routed experts beside a shared one, sigmoid scores with a correction
        # bias (a buffer the checkpoint holds), q/k norms and a partial rotary
        "glm4_moe": ("Glm4MoeConfig", dict(c, head_dim=HEAD_DIM, n_routed_experts=4, num_experts_per_tok=2,
                                           moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
                                           n_group=1, topk_group=1, norm_topk_prob=True, partial_rotary_factor=0.5,
                                           use_qk_norm=True)),
        # Qwen3.5: a Gated DeltaNet layer (linear attention: a recurrent state and a short causal convolution, more
        # value heads than key heads) and a gated full-attention layer (q/k norms, a partial rotary)
        "qwen3_5_text": ("Qwen3_5TextConfig", dict(c, head_dim=HEAD_DIM, **hybrid)),
        "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", dict(c, head_dim=HEAD_DIM, **hybrid, num_experts=4,
                                                          num_experts_per_tok=2, moe_intermediate_size=32,
                                                          shared_expert_intermediate_size=32)),
        # DeepSeek-V3: multi-head latent attention (low-rank q, a low-rank kv latent shared by the
        # heads beside a decoupled rotary key, v heads narrower than q/k ones), a dense first layer, a shared expert
        # beside routed ones chosen by grouped top-k of sigmoid scores (2 groups of 2, the best group taken), which
        # vLLM reads from scoring_func and topk_method as DeepSeek's checkpoints say them (transformers ignores both).
        # kv_lora_rank + qk_rope_head_dim = 576: the only latent width vLLM-CPU's MLA decode kernel has
        "deepseek_v3": ("DeepseekV3Config", dict(c, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                                 n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
                                                 norm_topk_prob=True, scoring_func="sigmoid", topk_method="noaux_tc",
                                                 q_lora_rank=32, kv_lora_rank=512, qk_nope_head_dim=32,
                                                 qk_rope_head_dim=64, v_head_dim=32)),
    }


@functools.lru_cache(maxsize=1)
def _tokenizer():
    """The demo's tokenizer, trained once per process (it is the slow part of building a model)."""
    from tandem.data import arithmetic
    from tandem.demo import build_tokenizer

    return build_tokenizer(arithmetic.corpus(), 300)


ARCHITECTURES = ("llama", "qwen3", "gemma", "mistral", "phi3", "qwen3_moe", "mixtral", "gemma3_text", "glm4_moe",
                 "qwen3_5_text", "qwen3_5_moe_text", "gpt_oss", "deepseek_v3")
WINDOWED = ("gemma3_text", "gpt_oss")  # with sliding-window layers: the hf engine's stream refuses them (vLLM: yes)
HYBRID = ("qwen3_5_text", "qwen3_5_moe_text")  # with linear-attention layers: the hf engine's stream refuses them


def build(folder: Path, model_type: str, seed: int = 0, **config) -> Path:
    """Save a randomly initialised tiny `model_type` with the demo's tokenizer into `folder` (HF format); `config`
    changes its config's fields."""
    import transformers
    from transformers import AutoModelForCausalLM

    tok = _tokenizer()
    cls_name, kwargs = _configs(len(tok), tok.eos_token_id, tok.pad_token_id)[model_type]
    cfg = getattr(transformers, cls_name)(**dict(kwargs, **config))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    # Random init gives near-uniform logits; a wider spread makes greedy decoding and logprob checks sharper.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    model.generation_config.eos_token_id = tok.eos_token_id
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return folder
