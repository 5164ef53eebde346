"""A lean one-token decode step for Llama-family models (Qwen2, Llama): the HF model's own weights and math,
without its per-call module, mask and cache machinery, and with a preallocated KV cache.

Why: on CPU a decode step of a small model is mostly Python overhead (the HF forward builds a 4-D mask, walks
~20 modules per layer and grows a DynamicCache by concatenation, copying the whole cache every step). Here a
step is ~15 tensor ops per layer and the cache is written in place. The prefill still runs the HF forward.
Numerics match the HF forward to float rounding (same ops in the same order, SDPA for attention).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

_SUPPORTED = ("qwen2", "llama")


def supports(model) -> bool:
    """True for the architectures whose decoder layer this module reproduces exactly, on CPU.

    CPU only: there per-op dispatch dominates a small model's decode step, and the fused projection weights (one
    extra copy of the attention and MLP weights, held for one `generate` call) cost host memory, which is plentiful;
    an accelerator keeps the HF forward and its memory.
    """
    if next(model.parameters()).device.type != "cpu":
        return False
    cfg = model.config
    if cfg.model_type not in _SUPPORTED or getattr(cfg, "hidden_act", None) != "silu":
        return False
    if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or [])):
        return False  # sliding-window layers need their own mask
    if getattr(cfg, "pretraining_tp", 1) != 1 or getattr(model.lm_head, "bias", None) is not None:
        return False
    attn = model.model.layers[0].self_attn
    return all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "scaling", "head_dim"))


def _rms_norm(x: torch.Tensor, norm) -> torch.Tensor:
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * h.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class StaticDecoder:
    """Holds a [B, kv_heads, max_len, head_dim] cache per layer, filled from the prefill's cache, then decodes.

    The q/k/v and gate/up projections are concatenated into one weight each when the decoder is built (once per
    `generate`, after any weight load), so a layer is 4 matrix products instead of 7: fewer dispatches, and
    wider products that the BLAS runs closer to its peak on a few rows.
    """

    def __init__(self, model, cache, batch: int, prompt_len: int, max_len: int, attention_mask: torch.Tensor):
        self.model = model
        self.layers = model.model.layers
        a = self.layers[0].self_attn
        self.head_dim, self.scaling = a.head_dim, a.scaling
        self.heads = model.config.num_attention_heads
        self.kv_heads = model.config.num_key_value_heads
        self.inter = self.layers[0].mlp.gate_proj.out_features
        p = next(model.parameters())
        self.k, self.v, self.w = [], [], []
        for i, layer in enumerate(self.layers):
            k0, v0 = _layer_kv(cache, i)
            k = torch.empty((batch, self.kv_heads, max_len, self.head_dim), dtype=k0.dtype, device=p.device)
            v = torch.empty_like(k)
            k[:, :, :prompt_len] = k0
            v[:, :, :prompt_len] = v0
            self.k.append(k)
            self.v.append(v)
            at, mlp = layer.self_attn, layer.mlp
            projs = (at.q_proj, at.k_proj, at.v_proj)
            qkv_b = torch.cat([m.bias for m in projs]) if all(m.bias is not None for m in projs) else None
            if qkv_b is None and any(m.bias is not None for m in projs):
                qkv_b = torch.cat([m.bias if m.bias is not None else torch.zeros(m.out_features, dtype=p.dtype,
                                                                                  device=p.device) for m in projs])
            gu_b = None
            if mlp.gate_proj.bias is not None:
                gu_b = torch.cat([mlp.gate_proj.bias, mlp.up_proj.bias])
            self.w.append((
                layer.input_layernorm, torch.cat([m.weight for m in projs]), qkv_b, at.o_proj.weight, at.o_proj.bias,
                layer.post_attention_layernorm, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), gu_b,
                mlp.down_proj.weight, mlp.down_proj.bias,
            ))
        # key positions a query may see: the prompt's real tokens, and every generated slot once written
        self.mask = torch.ones((batch, max_len), dtype=torch.bool, device=p.device)
        self.mask[:, :prompt_len] = attention_mask.bool()
        self.cur = prompt_len

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Logits [B, V] of the next token after feeding `tokens` [B] at `positions` [B]."""
        B, c, H, KV, D, I = tokens.shape[0], self.cur, self.heads, self.kv_heads, self.head_dim, self.inter
        x = self.model.model.embed_tokens(tokens)  # [B, hidden]
        cos, sin = self.model.model.rotary_emb(x, positions[:, None])  # [B, 1, D]: broadcasts over heads
        mask = self.mask[:, None, None, : c + 1]
        for (n1, w_qkv, b_qkv, w_o, b_o, n2, w_gu, b_gu, w_d, b_d), kc, vc in zip(self.w, self.k, self.v):
            qkv = F.linear(_rms_norm(x, n1), w_qkv, b_qkv).view(B, H + 2 * KV, D)
            qk = qkv[:, : H + KV]
            qk = qk * cos + _rotate_half(qk) * sin  # rotary on q and k heads together
            kc[:, :, c] = qk[:, H:]
            vc[:, :, c] = qkv[:, H + KV:]
            o = F.scaled_dot_product_attention(qk[:, :H].unsqueeze(2), kc[:, :, : c + 1], vc[:, :, : c + 1],
                                               attn_mask=mask, scale=self.scaling, enable_gqa=H != KV)
            x = x + F.linear(o.reshape(B, H * D), w_o, b_o)
            gu = F.linear(_rms_norm(x, n2), w_gu, b_gu)
            x = x + F.linear(F.silu(gu[:, :I]) * gu[:, I:], w_d, b_d)
        self.cur = c + 1
        return F.linear(_rms_norm(x, self.model.model.norm), self.model.lm_head.weight)


def _layer_kv(cache, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return layers[i].keys, layers[i].values
    return cache.key_cache[i], cache.value_cache[i]
