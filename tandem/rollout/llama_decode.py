"""A lean one-token decode step for Llama-family models (Qwen2, Llama): the HF model's own weights and math,
without its per-call module, mask and cache machinery, and with a preallocated KV cache.

Why: on CPU a decode step of a small model is mostly Python overhead (the HF forward builds a 4-D mask, walks
~20 modules per layer and grows a DynamicCache by concatenation, copying the whole cache every step). Here a
step is ~15 tensor ops per layer and the cache is written in place. The prefill still runs the HF forward.
Numerics match the HF forward to float rounding (the same ops in the same order; attention by SDPA, or, where a
group's prompt is held once, a float32 softmax over the prompt's and the row's own keys).
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


# Hold a group's prompt once (split attention) when the keys and values its rows would otherwise each hold and read
# again, per layer, reach this many bytes; below it they are copied out to every row and attention is one SDPA call.
# The split costs ~15 more small tensor ops per layer, which few repeated keys do not repay. `bench/
# bench_prompt_sharing.py` (one CPU thread, fixed-length rollouts), shared / per-row time: 74-86 KB repeated (16 rows
# of 6-token prompts) 0.99-1.04; 393 KB 0.87 in one run and 1.13 in an earlier ad-hoc one (the crossover is within
# this machine's noise); 786 KB 0.85; bench_trl's large rollout (1.4 MB) 0.95; 2 prompts of 256 tokens x 32 rows
# (16 MB) 0.51. The threshold sits above the noisy band.
SHARED_PROMPT_MIN_BYTES = 512 << 10


class StaticDecoder:
    """Decodes `n` completions of each of `U` prompts from the prefill's cache (which ran each prompt once), each
    row's generated keys and values written in place into a preallocated cache.

    A long prompt's keys and values are held once for its `n` rows, and attention is split in two (as cascade
    attention does): the rows' queries against their prompt's keys, computed for all `n` rows of a prompt in one
    product ([n * q_per_kv, head_dim] x [head_dim, P] per KV head: a matrix product, instead of n matrix-vector ones
    reading the same keys n times), and against each row's own generated keys; one softmax over both. GRPO samples a
    group of completions per prompt, so a long prompt's keys are read once per group and step, and held once. Where
    that would save little (SHARED_PROMPT_MIN_BYTES) the prompt is copied into every row's cache and attention is one
    SDPA call.

    The q/k/v and gate/up projections are concatenated into one weight each when the decoder is built (once per
    `generate`, after any weight load), so a layer is 4 matrix products instead of 7: fewer dispatches, and
    wider products that the BLAS runs closer to its peak on a few rows.
    """

    def __init__(self, model, cache, n: int, max_new: int, prompt_mask: torch.Tensor):
        self.model = model
        self.layers = model.model.layers
        a = self.layers[0].self_attn
        self.head_dim, self.scaling = a.head_dim, a.scaling
        self.heads = model.config.num_attention_heads
        self.kv_heads = model.config.num_key_value_heads
        self.inter = self.layers[0].mlp.gate_proj.out_features
        self.n = n
        U, P = prompt_mask.shape
        self.prompt_len = P
        p = next(model.parameters())
        repeated = (n - 1) * U * P * self.kv_heads * self.head_dim * 2 * p.element_size()  # keys and values
        self.shared = n > 1 and repeated >= SHARED_PROMPT_MIN_BYTES
        own = max_new if self.shared else P + max_new  # slots of a row's own cache
        self.prompt_k, self.prompt_v, self.k, self.v, self.w = [], [], [], [], []
        for i, layer in enumerate(self.layers):
            k0, v0 = _layer_kv(cache, i)  # [U, kv_heads, P, head_dim]
            k = torch.empty((U * n, self.kv_heads, own, self.head_dim), dtype=k0.dtype, device=p.device)
            v = torch.empty_like(k)
            if self.shared:
                self.prompt_k.append(k0)
                self.prompt_v.append(v0)
            else:
                k[:, :, :P] = k0.repeat_interleave(n, dim=0)
                v[:, :, :P] = v0.repeat_interleave(n, dim=0)
            self.k.append(k)
            self.v.append(v)
            at, mlp = layer.self_attn, layer.mlp
            projs = (at.q_proj, at.k_proj, at.v_proj)
            qkv_b = None
            if any(m.bias is not None for m in projs):
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
        if self.shared:  # added to a prompt's attention scores: -inf on its left padding
            self.prompt_bias = torch.zeros((U, 1, 1, P), dtype=torch.float32, device=p.device)
            self.prompt_bias.masked_fill_(~prompt_mask.bool()[:, None, None, :], float("-inf"))
        else:  # key positions a row may see: its prompt's real tokens, and every generated slot once written
            self.mask = torch.ones((U * n, own), dtype=torch.bool, device=p.device)
            self.mask[:, :P] = prompt_mask.bool().repeat_interleave(n, dim=0)
        self.generated = 0

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Logits [B, V] of the next token after feeding `tokens` [B] at `positions` [B] (B = U * n rows, the n rows
        of each prompt next to each other)."""
        B, H, KV, D, I = tokens.shape[0], self.heads, self.kv_heads, self.head_dim, self.inter
        slot = self.generated if self.shared else self.prompt_len + self.generated  # this token's cache slot
        x = self.model.model.embed_tokens(tokens)  # [B, hidden]
        cos, sin = self.model.model.rotary_emb(x, positions[:, None])  # [B, 1, D]: broadcasts over heads
        for i, (n1, w_qkv, b_qkv, w_o, b_o, n2, w_gu, b_gu, w_d, b_d) in enumerate(self.w):
            kc, vc = self.k[i], self.v[i]
            qkv = F.linear(_rms_norm(x, n1), w_qkv, b_qkv).view(B, H + 2 * KV, D)
            qk = qkv[:, : H + KV]
            qk = qk * cos + _rotate_half(qk) * sin  # rotary on q and k heads together
            kc[:, :, slot] = qk[:, H:]
            vc[:, :, slot] = qkv[:, H + KV:]
            if self.shared:
                o = self._split_attention(qk[:, :H], i, slot + 1)
            else:
                o = F.scaled_dot_product_attention(qk[:, :H].unsqueeze(2), kc[:, :, : slot + 1], vc[:, :, : slot + 1],
                                                   attn_mask=self.mask[:, None, None, : slot + 1], scale=self.scaling,
                                                   enable_gqa=H != KV)
            x = x + F.linear(o.reshape(B, H * D), w_o, b_o)
            gu = F.linear(_rms_norm(x, n2), w_gu, b_gu)
            x = x + F.linear(F.silu(gu[:, :I]) * gu[:, I:], w_d, b_d)
        self.generated += 1
        return F.linear(_rms_norm(x, self.model.model.norm), self.model.lm_head.weight)

    def _split_attention(self, q: torch.Tensor, layer: int, own: int) -> torch.Tensor:
        """Attention of the rows' queries [B, H, D] over their prompt's shared keys and their `own` generated ones:
        [B, KV, q_per_kv, D]. Scores and softmax in float32, as SDPA computes them."""
        B, n, KV, D = q.shape[0], self.n, self.kv_heads, self.head_dim
        U, pk, pv, kc, vc = B // n, self.prompt_k[layer], self.prompt_v[layer], self.k[layer], self.v[layer]
        q = q.reshape(B, KV, self.heads // KV, D)  # query head h reads KV head h // q_per_kv
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


def _layer_kv(cache, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return layers[i].keys, layers[i].values
    return cache.key_cache[i], cache.value_cache[i]
