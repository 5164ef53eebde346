"""The hf engine's decode step for a group's rows (Qwen2, Llama on CPU): their prompt's keys and values held once, and
attention split in two as cascade attention does.

Why: the HF forward decodes from a cache that holds the prompt once per row, so a group of n rows holds and reads
its prompt's keys and values n times at every step. Here the rows of a group read their prompt's keys in one matrix
product per KV head, and their own generated keys apart; one float32 softmax over both. The layers are the model's
own modules (norms, projections, MLP, rotary), so only attention is written here. `.venv/bin/python
bench/bench_prompt_sharing.py` measures it against the HF forward, from 6-token prompts to 256.
"""
from __future__ import annotations

import torch

from tandem.architectures import ModelProfile


def shares(profile: ModelProfile, model, n: int) -> bool:
    """Whether `n` rows of each prompt decode with their prompt held once: a group (n > 1) of a model whose decoder
    layers `SharedPromptDecoder.step` reproduces (`profile.decodes_prompt_once`: Qwen2, Llama, full attention in every
    layer), on CPU (the only processor it was measured on; elsewhere the HF forward)."""
    return profile.decodes_prompt_once and n >= 2 and next(model.parameters()).device.type == "cpu"


class SharedPromptDecoder:
    """Decodes `n` rows of each of the `U` prompts that `cache` (the prefill's DynamicCache: each prompt once,
    [U, kv heads, P, head dim] per layer, left-padded as `prompt_mask` [U, P] says) holds, up to `max_new` tokens
    each. The rows of a prompt are next to each other (row b answers prompt b // n)."""

    def __init__(self, model, cache, n: int, max_new: int, prompt_mask: torch.Tensor):
        from transformers.models.llama.modeling_llama import rotate_half

        self.model, self.n, self.rotate_half = model, n, rotate_half
        cfg, p = model.config, next(model.parameters())
        attention = model.model.layers[0].self_attn
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim, self.scaling = attention.head_dim, attention.scaling
        U, self.prompt_len = prompt_mask.shape
        self.prompt = [(layer.keys, layer.values) for layer in cache.layers]
        shape = (U * n, self.kv_heads, max_new, self.head_dim)
        self.own = [(torch.empty(shape, dtype=p.dtype), torch.empty(shape, dtype=p.dtype)) for _ in self.prompt]
        # added to a prompt's attention scores: -inf on its left padding
        self.prompt_bias = torch.zeros((U, 1, 1, self.prompt_len), dtype=torch.float32)
        self.prompt_bias.masked_fill_(~prompt_mask.bool()[:, None, None, :], float("-inf"))
        self.generated = 0

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Logits [B, V] of the next token after feeding `tokens` [B] at `positions` [B]."""
        m = self.model.model
        B, H, KV, D = tokens.shape[0], self.heads, self.kv_heads, self.head_dim
        x = m.embed_tokens(tokens)  # [B, hidden]
        cos, sin = m.rotary_emb(x[:, None], positions[:, None])  # [B, 1, D]: broadcast over the heads
        for i, layer in enumerate(m.layers):
            at, h = layer.self_attn, layer.input_layernorm(x)
            q, k, v = at.q_proj(h).view(B, H, D), at.k_proj(h).view(B, KV, D), at.v_proj(h).view(B, KV, D)
            q, k = q * cos + self.rotate_half(q) * sin, k * cos + self.rotate_half(k) * sin
            own_k, own_v = self.own[i]
            own_k[:, :, self.generated], own_v[:, :, self.generated] = k, v
            x = x + at.o_proj(self._attention(q, i).reshape(B, H * D))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        self.generated += 1
        return self.model.lm_head(m.norm(x))

    def _attention(self, q: torch.Tensor, layer: int) -> torch.Tensor:
        """The rows' queries [B, H, D] over their prompt's keys and their own generated ones: [B, KV, H / KV, D].
        Scores and softmax in float32, as SDPA computes them."""
        B, n, KV, D, own = q.shape[0], self.n, self.kv_heads, self.head_dim, self.generated + 1
        U, (pk, pv), (kc, vc) = B // n, self.prompt[layer], self.own[layer]
        q = q.reshape(B, KV, self.heads // KV, D)  # query head h reads KV head h // (H / KV)
        on_prompt = torch.matmul(_by_prompt(q, U, n), pk.transpose(-1, -2)).mul_(self.scaling)  # [U, KV, n*G, P]
        on_prompt = _by_row(on_prompt.add_(self.prompt_bias), U, n)
        on_own = torch.matmul(q, kc[:, :, :own].transpose(-1, -2)).mul_(self.scaling)  # [B, KV, G, own]
        weights = torch.softmax(torch.cat([on_prompt, on_own], dim=-1).float(), dim=-1).to(q.dtype)
        o = _by_row(torch.matmul(_by_prompt(weights[..., : self.prompt_len], U, n), pv), U, n)
        return o + torch.matmul(weights[..., self.prompt_len:], vc[:, :, :own])


def _by_prompt(t: torch.Tensor, U: int, n: int) -> torch.Tensor:
    """[U * n, KV, G, X] (rows) -> [U, KV, n * G, X] (each prompt's rows stacked per KV head)."""
    _, KV, G, X = t.shape
    return t.view(U, n, KV, G, X).transpose(1, 2).reshape(U, KV, n * G, X)


def _by_row(t: torch.Tensor, U: int, n: int) -> torch.Tensor:
    """The inverse of `_by_prompt`: [U, KV, n * G, X] -> [U * n, KV, G, X]."""
    _, KV, nG, X = t.shape
    return t.view(U, KV, n, nG // n, X).transpose(1, 2).reshape(U * n, KV, nG // n, X)
