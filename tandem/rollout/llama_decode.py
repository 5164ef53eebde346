"""A lean one-token decode step for Llama-family models (Qwen2, Llama): the HF model's own weights and math,
without its per-call module, mask and cache machinery, and with a preallocated KV cache.

Why: on CPU a decode step of a small model is mostly Python overhead (the HF forward builds a 4-D mask, walks
~20 modules per layer and grows a DynamicCache by concatenation, copying the whole cache every step). Here a
step is ~15 tensor ops per layer and the cache is written in place; `prefill` runs the prompts through the same
weights at once (the HF forward's math without its module machinery).
Numerics match the HF forward to float rounding (the same ops in the same order; attention by SDPA, or, where a
group's prompt is held once, a float32 softmax over the prompt's and the row's own keys).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

_SUPPORTED = ("qwen2", "llama")  # tandem.architectures.STREAMED names these too


def decodes(model) -> bool:
    """True for the architectures whose decoder layer this module reproduces exactly (on any device)."""
    cfg = model.config
    if cfg.model_type not in _SUPPORTED or getattr(cfg, "hidden_act", None) != "silu":
        return False
    if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or [])):
        return False  # sliding-window layers need their own mask
    if getattr(cfg, "pretraining_tp", 1) != 1 or getattr(model.lm_head, "bias", None) is not None:
        return False
    if any(kind in str(getattr(model.model.rotary_emb, "rope_type", "default")) for kind in ("dynamic", "longrope")):
        return False  # frequencies that depend on the longest position fed: no fixed table (`rotary_tables`)
    attn = model.model.layers[0].self_attn
    return all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "scaling", "head_dim"))


def supports(model) -> bool:
    """True for the architectures whose decoder layer this module reproduces exactly, on CPU.

    CPU only: there per-op dispatch dominates a small model's decode step, and the fused projection weights (one
    extra copy of the attention and MLP weights, held for one `generate` call) cost host memory, which is plentiful;
    an accelerator keeps the HF forward and its memory.
    """
    return next(model.parameters()).device.type == "cpu" and decodes(model)


def native_bf16() -> bool:
    """The processor converts and multiplies bfloat16 natively (AVX-512 BF16 or AMX), where a bf16 KV cache's
    attention reads half the bytes at no extra cost. Without it (AVX2) SDPA's bf16 arithmetic is emulated and a
    bf16 cache's attention measured about 3x slower than float32's (`bench/bench_trl.py --kv-cache-dtype both`).
    Reported by the benchmarks only: no default depends on it (the KV cache is the model's dtype unless bfloat16 is
    asked for)."""
    return any(getattr(torch.cpu, probe, lambda: False)() for probe in ("_is_avx512_bf16_supported",
                                                                         "_is_amx_tile_supported"))


def kv_cache_dtype(requested: str, model_dtype: torch.dtype) -> torch.dtype:
    """The lean decoder's KV cache dtype for `rollout.kv_cache_dtype` (model | float32 | bfloat16): `model` is the
    model's dtype, on every processor."""
    if requested == "model":
        return model_dtype
    if requested not in ("float32", "bfloat16"):
        raise ValueError(f"kv_cache_dtype {requested!r}: use model, float32 or bfloat16")
    return getattr(torch, requested)


def _rms_norm(x: torch.Tensor, norm) -> torch.Tensor:
    if x.dtype == torch.float32 and norm.weight.dtype == torch.float32:  # one fused op, the same float32 result
        return F.rms_norm(x, norm.weight.shape, norm.weight, norm.variance_epsilon)
    h = x.to(torch.float32)  # HF's order: normalise in float32, round to the model's dtype, then scale
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * h.to(x.dtype)


def rotary_tables(model, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of rotary positions 0..positions-1 ([positions, head_dim] each), by the model's own rotary
    module (each entry is one product and one cos/sin, so a table equals the per-step values bit for bit); the sin
    table's first half negated, which turns HF's `rotate_half(x) * sin` into a swap of x's halves times it."""
    p = next(model.parameters())
    at = torch.arange(positions, device=p.device)[None, :]
    cos, sin = model.model.rotary_emb(torch.empty(0, dtype=p.dtype, device=p.device), at)
    half = sin.shape[-1] // 2
    return cos[0], torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """HF's `x * cos + rotate_half(x) * sin` on [B, heads, D] (cos, sin: [B, 1, D]) in 3 ops instead of 7."""
    B, heads, D = x.shape
    swapped = x.view(B, heads, 2, D // 2).flip(2).view(B, heads, D)
    return x * cos + swapped * signed_sin


# Hold a group's prompt once (split attention) when the keys and values its rows would otherwise each hold and read
# again, per layer, reach this many bytes; below it they are copied out to every row and attention is one SDPA call.
# The split costs ~15 more small tensor ops per layer, which few repeated keys do not repay. `bench/
# bench_prompt_sharing.py` (one CPU thread, fixed-length rollouts), shared / per-row time: 74-86 KB repeated (16 rows
# of 6-token prompts) 0.99-1.04; 393 KB 0.87 in one run and 1.13 in an earlier ad-hoc one (the crossover is within
# this machine's noise); 786 KB 0.85; bench_trl's large rollout (1.4 MB) 0.95; 2 prompts of 256 tokens x 32 rows
# (16 MB) 0.51. The threshold sits above the noisy band.
SHARED_PROMPT_MIN_BYTES = 512 << 10


class StaticDecoder:
    """Decodes `n` completions of each of `U` prompts from the prefill's cache (which ran each prompt once: an HF
    cache, or `prefill`'s keys and values), each row's generated keys and values written in place into a
    preallocated cache. `fused`: `fused_layers(model)` where the caller has them (the prefill's).

    A long prompt's keys and values are held once for its `n` rows, and attention is split in two (as cascade
    attention does): the rows' queries against their prompt's keys, computed for all `n` rows of a prompt in one
    product ([n * q_per_kv, head_dim] x [head_dim, P] per KV head: a matrix product, instead of n matrix-vector ones
    reading the same keys n times), and against each row's own generated keys; one softmax over both. GRPO samples a
    group of completions per prompt, so a long prompt's keys are read once per group and step, and held once. Where
    that would save little (SHARED_PROMPT_MIN_BYTES) the prompt is copied into every row's cache and attention is
    one SDPA call.

    The q/k/v and gate/up projections are concatenated into one weight each when the decoder is built (once per
    `generate`, after any weight load), so a layer is 4 matrix products instead of 7: fewer dispatches, and
    wider products that the BLAS runs closer to its peak on a few rows.

    `kv_dtype` (default: the model's) is the cache's dtype: with bfloat16 under a float32 model the keys and values
    are rounded once as they are stored, and attention reads half the bytes: its queries are rounded to bf16 too,
    the products accumulate in float32 and the softmax runs in float32 (SDPA's CPU kernel, or the split path's
    explicit `.float()`); its output returns to the model's dtype.
    """

    def __init__(self, model, cache, n: int, max_new: int, prompt_mask: torch.Tensor,
                 kv_dtype: torch.dtype | None = None, fused: list[tuple] | None = None):
        self.model = model
        self.layers = model.model.layers
        a = self.layers[0].self_attn
        self.head_dim, self.scaling = a.head_dim, a.scaling
        self.heads = model.config.num_attention_heads
        self.kv_heads = model.config.num_key_value_heads
        self.n = n
        U, P = prompt_mask.shape
        self.prompt_len = P
        p = next(model.parameters())
        self.kv_dtype = kv_dtype or p.dtype  # the cache's; the queries are rounded to it for attention
        repeated = (n - 1) * U * P * self.kv_heads * self.head_dim * 2 * self.kv_dtype.itemsize  # keys and values
        self.shared = n > 1 and repeated >= SHARED_PROMPT_MIN_BYTES
        own = max_new if self.shared else P + max_new  # slots of a row's own cache
        self.prompt_k, self.prompt_v, self.k, self.v = [], [], [], []
        for i in range(len(self.layers)):
            k0, v0 = _layer_kv(cache, i)  # [U, kv_heads, P, head_dim]
            k = torch.empty((U * n, self.kv_heads, own, self.head_dim), dtype=self.kv_dtype, device=p.device)
            v = torch.empty_like(k)
            if self.shared:
                self.prompt_k.append(k0.to(self.kv_dtype))
                self.prompt_v.append(v0.to(self.kv_dtype))
            else:
                k[:, :, :P] = k0.repeat_interleave(n, dim=0)
                v[:, :, :P] = v0.repeat_interleave(n, dim=0)
            self.k.append(k)
            self.v.append(v)
        self.w = fused if fused is not None else fused_layers(model)
        self.rotary = rotary_tables(model, int(prompt_mask.sum(-1).max()) + max_new)
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
        slot = self.generated if self.shared else self.prompt_len + self.generated  # this token's cache slot

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            kc, vc = self.k[i], self.v[i]
            kc[:, :, slot] = k
            vc[:, :, slot] = v
            if self.shared:
                return self._split_attention(q.to(self.kv_dtype), i, slot + 1).to(q.dtype)
            return _attention(q, kc[:, :, : slot + 1], vc[:, :, : slot + 1], self.mask[:, : slot + 1], self.scaling)

        logits = decode_layers(self.model, self.w, self.rotary, tokens, positions, attend)
        self.generated += 1
        return logits

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


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seen: torch.Tensor, scale: float) -> torch.Tensor:
    """One query per row ([B, H, D]) against the row's cached keys and values ([B, KV, L, D], in the cache's dtype)
    where `seen` [B, L] allows: SDPA, the query rounded to the cache's dtype and the output returned to its own."""
    return F.scaled_dot_product_attention(q.unsqueeze(2).to(k.dtype), k, v, attn_mask=seen[:, None, None, :],
                                          scale=scale, enable_gqa=q.shape[1] != k.shape[1]).to(q.dtype)


def decode_layers(model, fused: list[tuple], rotary: tuple[torch.Tensor, torch.Tensor], tokens: torch.Tensor,
                  positions: torch.Tensor, attend) -> torch.Tensor:
    """One token per row through every layer (`fused`: `fused_layers(model)`, `rotary`: `rotary_tables` covering
    every position fed): logits [B, V]. `attend(layer, q [B, H, D], k [B, KV, D], v [B, KV, D])` stores the row's
    new key and value where its cache keeps them and returns its attention output ([B, H, D], or any shape of B x
    H*D values)."""
    cfg = model.config
    B, H, KV = tokens.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads
    D, I = model.model.layers[0].self_attn.head_dim, model.model.layers[0].mlp.gate_proj.out_features
    x = model.model.embed_tokens(tokens)  # [B, hidden]
    cos, signed_sin = rotary[0][positions][:, None], rotary[1][positions][:, None]  # [B, 1, D]: broadcast over heads
    for i, (n1, w_qkv, b_qkv, w_o, b_o, n2, w_gu, b_gu, w_d, b_d) in enumerate(fused):
        qkv = F.linear(_rms_norm(x, n1), w_qkv, b_qkv).view(B, H + 2 * KV, D)
        qk = _rotate(qkv[:, : H + KV], cos, signed_sin)  # rotary on q and k heads together
        o = attend(i, qk[:, :H], qk[:, H:], qkv[:, H + KV:])
        x = x + F.linear(o.reshape(B, H * D), w_o, b_o)
        x = x + _mlp(x, n2, w_gu, b_gu, w_d, b_d, I)
    return F.linear(_rms_norm(x, model.model.norm), model.lm_head.weight)


def _mlp(x: torch.Tensor, norm, w_gu, b_gu, w_d, b_d, I: int) -> torch.Tensor:
    """A layer's gated MLP on its normed input, the gate/up projections as one product (`fused_layers`)."""
    gu = F.linear(_rms_norm(x, norm), w_gu, b_gu)
    return F.linear(F.silu(gu[..., :I]) * gu[..., I:], w_d, b_d)


def prefill(model, fused: list[tuple], ids: torch.Tensor, attn: torch.Tensor,
            positions: torch.Tensor) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Left-padded prompts `ids` [U, P] (`attn` their mask, `positions` their rotary positions) through every layer
    at once, the HF forward's math without its module machinery (`fused`: `fused_layers(model)`): the last
    position's logits [U, V] and each layer's keys and values [U, KV, P, D], as `StaticDecoder` takes them."""
    cfg, at = model.config, model.model.layers[0].self_attn
    (U, P), H, KV, D = ids.shape, cfg.num_attention_heads, cfg.num_key_value_heads, at.head_dim
    I = fused[0][6].shape[0] // 2
    cos, signed_sin = (t[positions].view(U * P, 1, D) for t in rotary_tables(model, int(positions.max()) + 1))
    # causal and not padding; a padding position also sees itself, so that no row is all masked (SDPA's NaN there
    # would be stored as its key and value; masked out of every later read, but a NaN all the same)
    seen = torch.ones((P, P), dtype=torch.bool, device=ids.device).tril() & attn.bool()[:, None, :]
    seen |= torch.eye(P, dtype=torch.bool, device=ids.device)
    x, kv = model.model.embed_tokens(ids), []  # [U, P, hidden]
    for n1, w_qkv, b_qkv, w_o, b_o, n2, w_gu, b_gu, w_d, b_d in fused:
        qkv = F.linear(_rms_norm(x, n1), w_qkv, b_qkv).view(U * P, H + 2 * KV, D)
        qk = _rotate(qkv[:, : H + KV], cos, signed_sin).view(U, P, H + KV, D).transpose(1, 2)
        k, v = qk[:, H:], qkv[:, H + KV:].view(U, P, KV, D).transpose(1, 2)
        o = F.scaled_dot_product_attention(qk[:, :H], k, v, attn_mask=seen[:, None], scale=at.scaling,
                                           enable_gqa=H != KV)
        x = x + F.linear(o.transpose(1, 2).reshape(U, P, H * D), w_o, b_o)
        x = x + _mlp(x, n2, w_gu, b_gu, w_d, b_d, I)
        kv.append((k, v))
    return F.linear(_rms_norm(x[:, -1], model.model.norm), model.lm_head.weight), kv


FILL_PADDING = 1.25  # SlotDecoder.fill: the most padded positions a prefill batch may run per real one


class SlotDecoder:
    """Continuous batching for the streaming schedule: up to `slots` rows, each with a KV cache of its own (up to
    `capacity` positions) and a length of its own, so a row joins (its prefix prefilled and copied in) or leaves
    between any two steps while the others decode. Rows are kept in slots 0..len(rows)-1 (a leaving row's slot
    takes the last row's), so a step reads the caches as one slice, no gather.

    The same layer math as `StaticDecoder` (`decode_layers`); attention is one SDPA call over each row's own
    positions. After the model's weights change, `refresh` re-fuses them; the rows' keys and values are then stale,
    and the caller prefills them again (`fill`) if it wants them exact."""

    def __init__(self, model, slots: int, capacity: int, kv_dtype: torch.dtype | None = None):
        self.model, self.slots, self.capacity = model, slots, capacity
        a, p = model.model.layers[0].self_attn, next(model.parameters())
        self.scaling = a.scaling
        shape = (slots, model.config.num_key_value_heads, capacity, a.head_dim)
        self.kv_dtype = kv_dtype or p.dtype
        self.k = [torch.zeros(shape, dtype=self.kv_dtype, device=p.device) for _ in model.model.layers]
        self.v = [torch.zeros(shape, dtype=self.kv_dtype, device=p.device) for _ in model.model.layers]
        self.length = torch.zeros(slots, dtype=torch.long, device=p.device)  # positions held by each slot
        self.rows: list = []  # the key of the row in each slot
        self.rotary = rotary_tables(model, capacity)
        self.refresh()

    def refresh(self) -> None:
        """The model's weights changed: decode with the new ones (the rows' caches still hold the old ones')."""
        self.w = fused_layers(self.model)

    def fill(self, keys: list, prefixes: list[list[int]]) -> torch.Tensor:
        """New rows `keys` with these prefixes (prompt and any tokens already sampled), prefilled (`prefill`);
        logits [len(keys), V] of each one's next token. A key already held is prefilled again in its slot.

        Rows of like length are prefilled together (sorted by length, a batch closed where padding would pass
        FILL_PADDING of its real tokens): a long-tailed set of prefixes, as a weight load re-prefills, would
        otherwise pad every row to the longest."""
        lens = [len(x) for x in prefixes]
        if max(lens) >= self.capacity:
            raise ValueError(f"a prefix of {max(lens)} tokens does not fit the stream's {self.capacity} positions")
        where = []
        for key in keys:
            if key not in self.rows:
                if len(self.rows) == self.slots:
                    raise RuntimeError(f"no free slot of {self.slots} for another row")
                self.rows.append(key)
            where.append(self.rows.index(key))
        logits: list[torch.Tensor | None] = [None] * len(keys)
        batch: list[int] = []
        for i in sorted(range(len(keys)), key=lens.__getitem__) + [-1]:
            if batch and (i < 0 or (len(batch) + 1) * lens[i] > FILL_PADDING * (sum(lens[j] for j in batch) + lens[i])):
                for j, row in zip(batch, self._prefill([where[j] for j in batch], [prefixes[j] for j in batch])):
                    logits[j] = row
                batch = []
            batch.append(i)
        return torch.stack(logits)

    def _prefill(self, where: list[int], prefixes: list[list[int]]) -> torch.Tensor:
        """These prefixes (left-padded to the longest) through `prefill` with the decoder's weights, their keys and
        values copied into slots `where`; each one's next-token logits."""
        lens = [len(x) for x in prefixes]
        P, dev = max(lens), self.length.device
        ids = torch.zeros((len(prefixes), P), dtype=torch.long)
        attn = torch.zeros((len(prefixes), P), dtype=torch.long)
        for i, x in enumerate(prefixes):
            ids[i, P - len(x):], attn[i, P - len(x):] = torch.tensor(x), 1
        ids, attn = ids.to(dev), attn.to(dev)
        logits, kv = prefill(self.model, self.w, ids, attn, (attn.cumsum(-1) - 1).clamp(min=0))
        for kc, vc, (k0, v0) in zip(self.k, self.v, kv):
            for i, (slot, n) in enumerate(zip(where, lens)):
                kc[slot, :, :n] = k0[i, :, P - n:]  # cast to the cache's dtype as it is written
                vc[slot, :, :n] = v0[i, :, P - n:]
        self.length[where] = torch.tensor(lens, device=dev)
        return logits

    def remove(self, key) -> None:
        """The row leaves; the last row moves into its slot."""
        slot, last = self.rows.index(key), len(self.rows) - 1
        if slot != last:
            n = int(self.length[last])
            for kc, vc in zip(self.k, self.v):
                kc[slot, :, :n] = kc[last, :, :n]
                vc[slot, :, :n] = vc[last, :, :n]
            self.length[slot] = self.length[last]
            self.rows[slot] = self.rows[last]
        self.rows.pop()

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token to every row (in slot order, [len(rows)]); logits [len(rows), V] of each one's next."""
        b = len(self.rows)
        pos = self.length[:b]
        if int(pos.max()) >= self.capacity:
            raise RuntimeError(f"a row reached the stream's {self.capacity} positions")
        upto = int(pos.max()) + 1
        seen = torch.arange(upto, device=pos.device)[None, :] <= pos[:, None]  # [b, upto]: each row's own positions
        rows = torch.arange(b, device=pos.device)

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            kc, vc = self.k[i], self.v[i]
            kc[rows, :, pos] = k.to(self.kv_dtype)  # an indexed write does not cast
            vc[rows, :, pos] = v.to(self.kv_dtype)
            return _attention(q, kc[:b, :, :upto], vc[:b, :, :upto], seen, self.scaling)

        logits = decode_layers(self.model, self.w, self.rotary, tokens, pos.clone(), attend)
        self.length[:b] += 1
        return logits


def fuse_parameters(model) -> None:
    """Make each layer's q/k/v projections' weights (and biases) views of one tensor, and gate/up's of another, so
    that `fused_layers` reads them as one matrix product without copying them, and a weight load (which copies into
    the parameters in place) writes the fused tensors directly. The module math is unchanged."""
    with torch.no_grad():
        for layer in model.model.layers:
            at, mlp = layer.self_attn, layer.mlp
            for mods in ((at.q_proj, at.k_proj, at.v_proj), (mlp.gate_proj, mlp.up_proj)):
                for attr in ("weight", "bias"):
                    params = [getattr(m, attr) for m in mods]
                    if any(p is None for p in params) or _joined_view(params) is not None:
                        continue
                    whole, at_row = torch.cat([p.data for p in params]), 0
                    for p in params:
                        p.data = whole[at_row: at_row + p.shape[0]]
                        at_row += p.shape[0]


def _joined_view(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The tensors as one along dim 0 without a copy, when they lie back to back in one storage; else None."""
    first = tensors[0]
    offset = first.storage_offset()
    for t in tensors:
        if not t.is_contiguous() or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() \
                or t.storage_offset() != offset or t.shape[1:] != first.shape[1:]:
            return None
        offset += t.numel()
    return first.as_strided((sum(t.shape[0] for t in tensors), *first.shape[1:]), first.stride(),
                            first.storage_offset())


def _joined(tensors: list[torch.Tensor]) -> torch.Tensor:
    view = _joined_view(tensors)
    return view if view is not None else torch.cat(tensors)


def fused_layers(model) -> list[tuple]:
    """Each decoder layer's weights as one decode step reads them: its norms, the q/k/v projections as one weight
    (and bias), o_proj, the gate/up projections as one weight, down_proj. Views of the parameters where
    `fuse_parameters` laid them out back to back, else copies (made again after a weight load)."""
    p = next(model.parameters())
    out = []
    for layer in model.model.layers:
        at, mlp = layer.self_attn, layer.mlp
        projs = (at.q_proj, at.k_proj, at.v_proj)
        qkv_b = None
        if any(m.bias is not None for m in projs):
            qkv_b = _joined([m.bias if m.bias is not None else torch.zeros(m.out_features, dtype=p.dtype,
                                                                             device=p.device) for m in projs])
        gu_b = None
        if mlp.gate_proj.bias is not None:
            gu_b = _joined([mlp.gate_proj.bias, mlp.up_proj.bias])
        out.append((
            layer.input_layernorm, _joined([m.weight for m in projs]), qkv_b, at.o_proj.weight, at.o_proj.bias,
            layer.post_attention_layernorm, _joined([mlp.gate_proj.weight, mlp.up_proj.weight]), gu_b,
            mlp.down_proj.weight, mlp.down_proj.bias,
        ))
    return out


def _by_prompt(t: torch.Tensor, U: int, n: int) -> torch.Tensor:
    """[U * n, KV, G, X] (rows) -> [U, KV, n * G, X] (each prompt's rows stacked per KV head)."""
    _, KV, G, X = t.shape
    return t.view(U, n, KV, G, X).transpose(1, 2).reshape(U, KV, n * G, X)


def _by_row(t: torch.Tensor, U: int, n: int) -> torch.Tensor:
    """The inverse of `_by_prompt`: [U, KV, n * G, X] -> [U * n, KV, G, X]."""
    _, KV, nG, X = t.shape
    return t.view(U, KV, n, nG // n, X).transpose(1, 2).reshape(U * n, KV, nG // n, X)


def _layer_kv(cache, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(cache, list):  # `prefill`'s
        return cache[i]
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return layers[i].keys, layers[i].values
    return cache.key_cache[i], cache.value_cache[i]
