"""The embedded rollout engine: batched sampling with a KV cache on any Hugging Face causal LM, no extra dependency."""
from __future__ import annotations

import contextlib
import time
from typing import Iterable, Sequence

import torch

from tandem import moe
from tandem.architectures import profile_of
from tandem.util import residency
from tandem.modeling import eos_token_ids, load_causal_lm, load_tokenizer, rope_positions
from tandem.rollout.base import Completion, Sampling
from tandem.rollout.manifest import Digest, Spec, check_manifest, digest
from tandem.rollout.hf.shared_prompt import SharedPromptDecoder, shares
from tandem.samples import ModelPrompt, batch_images, model_prompts


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) everything outside the top-k tokens and outside the smallest set holding top_p mass."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the mass before it already reaches top_p (the most likely token always stays)
        drop = (probs.cumsum(-1) - probs) >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits


def uniforms(gens: list[torch.Generator], steps: int, rows: int) -> torch.Tensor:
    """[steps, rows] float64 uniforms in [0, 1) for `draw`, drawn once for a whole `generate`: generator i gives
    its equal run of the rows (one generator for the batch, or one per prompt for its n rows), each row's draws
    in step order, so a prompt's samples depend only on its own generator."""
    per = rows // len(gens)
    return torch.cat([torch.rand((steps, per), dtype=torch.float64, generator=g, device=g.device) for g in gens], 1)


def draw(logits: torch.Tensor, sampling: Sampling, u: torch.Tensor | None, alive: torch.Tensor | None = None,
          pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row and its logprob (under the temperature, before truncation: what the trainer recomputes).
    Greedy at temperature 0; else the inverse of each row's cumulative distribution at its uniform `u` [rows]
    (float64, in [0, 1)): the first token whose running sum of probabilities exceeds u times their total. Rows
    where `alive` [rows] is False get `pad` (a finished row feeds padding).

    Why not torch.multinomial (or its exponential race, the argmax of probs over Exp(1) noise): that draws a random
    number per row and vocabulary entry, which on CPU costs more than the LM head at real vocabularies; this draws
    one per row (bench/bench_sampling.py). The sum runs in float64, so a token of probability down to ~1e-16 keeps
    its share (a float32 sum would round away those under ~6e-8 late in a large vocabulary); a token of probability
    0 (filtered out by top-k or top-p) is never drawn."""
    greedy = sampling.temperature <= 0
    truncated = (sampling.top_k and sampling.top_k < logits.shape[-1]) or sampling.top_p < 1.0
    if greedy:
        tok = logits.argmax(-1)
        logp = torch.log_softmax(logits, dim=-1).gather(-1, tok[:, None]).squeeze(-1)
    else:
        scaled = logits / sampling.temperature if sampling.temperature != 1.0 else logits  # x / 1 is x: one op spared
        logp_all = torch.log_softmax(scaled, dim=-1)
        if truncated:
            probs = torch.softmax(filter_logits(scaled, sampling.top_k, sampling.top_p), dim=-1)
        else:
            probs = logp_all.exp()  # the same distribution: one pass instead of a second softmax
        cum = torch.cumsum(probs, dim=-1, dtype=torch.float64)
        # u < 1 (53 random bits), so u * total rounds below the total: the first position above it exists, and has a
        # probability above 0 (a position of probability 0 repeats the sum before it, which would have been first)
        tok = torch.searchsorted(cum, u[:, None] * cum[:, -1:], right=True).squeeze(-1)
        logp = logp_all.gather(-1, tok[:, None]).squeeze(-1)
    return (tok, logp) if alive is None else (torch.where(alive, tok, pad), logp)


class HFEngine:
    """Samples with the model's own forward and a KV cache, one decode step for the whole batch at a time.

    The prefill runs each distinct prompt once, however many completions it gets (GRPO's group: `Sampling.n`), and
    its keys and values are held once for the group's rows (`tandem.rollout.hf.shared_prompt`: Qwen2 and Llama on
    CPU), or copied out to each row for the HF forward. Rows are left-padded so every row's next token sits in the last
    column; a row that has finished keeps feeding padding (its outputs are discarded) and the loop ends when every
    row has finished.
    """

    def __init__(self, model_path: str, dtype: str = "float32", seed: int = 0, trust_remote_code: bool = False,
                 model=None, tokenizer=None, device: str | None = None):
        self.tokenizer = tokenizer or load_tokenizer(model_path, trust_remote_code)
        self.model = model if model is not None else load_causal_lm(model_path, dtype, trust_remote_code)
        if device is not None:
            self.model.to(device)
        self.model.eval().requires_grad_(False)
        self.device = next(self.model.parameters()).device
        self.eos_ids = eos_token_ids(self.model, self.tokenizer)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_ids[0]
        self.seed = seed
        # the routes of each sampled token, for the trainer's router replay and route mismatch (tandem.moe)
        self.profile = profile_of(self.model)  # what the engine asks of its model's architecture
        self.routing = self.profile.routing(self.model)
        self._params = dict(self.model.named_parameters())
        for p in self._params.values():
            residency.ensure_resizable(p)  # sleep frees storages in place; a memory-mapped one cannot be
        self._asleep: list[tuple[torch.UntypedStorage, int]] | None = None  # freed storages and their sizes
        self.last_sync_seconds = 0.0
        self.last_sync_bytes = 0

    @torch.inference_mode()
    def generate(self, prompts: Sequence[ModelPrompt | Sequence[int]], sampling: Sampling) -> list[Completion]:
        """`sampling.n` completions of each prompt. Draws come from one generator seeded `sampling.seed` (default:
        the engine's seed), or with `sampling.seeds` one per prompt, seeded `seeds[i]`, so that a prompt's samples
        do not depend on which other prompts share its batch (a placement that spreads prompts over engines).
        A vision-language model's prompt brings its images (`ModelPrompt.images`): they enter the prefill, which
        runs each prompt once, so the vision tower runs once per prompt, not once per completion."""
        self._check_awake("generate")
        prompts = model_prompts(prompts)
        if not prompts:
            return []
        if any(len(p.ids) == 0 for p in prompts):
            raise ValueError("generate: empty prompt (0 tokens); every prompt needs at least one token")
        if sampling.seeds and len(sampling.seeds) != len(prompts):
            raise ValueError(f"generate: {len(sampling.seeds)} seeds for {len(prompts)} prompts (Sampling.seeds is "
                             "one per prompt)")
        if sampling.max_tokens and len(sampling.max_tokens) != len(prompts):
            raise ValueError(f"generate: {len(sampling.max_tokens)} limits for {len(prompts)} prompts "
                             "(Sampling.max_tokens is one per prompt)")
        n, dev = sampling.n, self.device
        seeds = sampling.seeds or (self.seed if sampling.seed is None else sampling.seed,)
        B = len(prompts) * n  # rows: prompt i's are i * n .. i * n + n - 1
        limits = torch.tensor([sampling.limit(i // n) for i in range(B)], device=dev)
        most = int(limits.max())
        with self._routes_record() as record:  # the experts each position went to (MoE models only)
            logits, next_pos, step = self._prefill(prompts, n, most)
            stops = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else set(self.eos_ids))
            stop_ids = torch.tensor(sorted(stops), dtype=torch.long, device=dev)
            alive = torch.ones(B, dtype=torch.bool, device=dev)  # rows still sampling (a finished one feeds padding)
            lengths = torch.zeros(B, dtype=torch.long, device=dev)
            tokens: list[torch.Tensor] = []
            logps: list[torch.Tensor] = []
            texts: list[str | None] = [None] * B
            capped = torch.zeros(B, dtype=torch.bool, device=dev)  # stopped at their own limit, below max_new_tokens
            draws = None
            if sampling.temperature > 0:
                gens = [torch.Generator(device=dev).manual_seed(int(s)) for s in seeds]
                draws = uniforms(gens, most, B)
            for drawn in range(most):
                tok, lp = draw(logits.float(), sampling, None if draws is None else draws[drawn], alive, self.pad_id)
                tokens.append(tok)
                logps.append(lp)
                lengths += alive
                alive &= torch.isin(tok, stop_ids, invert=True)
                if sampling.stop:
                    alive &= ~self._stop_strings(tokens, lengths, ~alive, sampling.stop, texts).to(dev)
                if sampling.max_tokens:
                    at_limit = (lengths >= limits) & alive
                    capped |= at_limit
                    alive &= ~at_limit
                if drawn == most - 1 or not bool(alive.any()):  # no row takes another token: no step to feed this one
                    break
                logits = step(tok, next_pos)
                next_pos += 1
        routes = None if record is None else moe.sampled_routes(record.forwards(), [len(p.ids) for p in prompts], n,
                                                                lengths.tolist())
        return self._completions(prompts, n, tokens, logps, lengths.tolist(), (~alive & ~capped).tolist(), texts,
                                 routes)

    def _prefill(self, prompts: list[ModelPrompt], n: int, most: int):
        """Each prompt once (a group's n rows share it), with its images' tensors; the first logits of every row, the
        rows' next positions, and the decode step `(tokens, positions) -> logits` for up to `most` tokens a row: the
        model's forward on the prefill's cache copied out to every row, or, where `shared_prompt.shares`, the prompt
        held once for its group.

        A 3-D rotary model (mRoPE: Qwen-VL) prefills at the positions it gives its prompts itself
        (`modeling.rope_positions`, the images' grids read), and decodes each row as text after its prompt: its 1-D
        position plus the prompt's delta, which the model takes in all three sections."""
        from transformers import DynamicCache

        ids, attn = self._left_padded([list(p.ids) for p in prompts])
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        pixels = {k: v.to(self.device) for k, v in
                  batch_images([p.images for p in prompts if p.images is not None]).items()}
        rope = rope_positions(self.model, ids, attn, pixels)
        next_pos = (pos[:, -1] + 1 + (0 if rope is None else rope[1])).repeat_interleave(n)
        out = self.model(input_ids=ids, attention_mask=attn, position_ids=pos if rope is None else rope[0],
                         past_key_values=cache, use_cache=True, logits_to_keep=1, **pixels)
        logits = out.logits[:, -1, :].repeat_interleave(n, dim=0)
        del out
        if shares(self.profile, self.model, n):
            return logits, next_pos, SharedPromptDecoder(self.model, cache, n, most, attn).step
        _repeat_rows(cache, n)
        seen = [attn.repeat_interleave(n, dim=0)]  # the rows' attention mask so far (a step adds a column)

        def step(tok: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            seen[0] = torch.cat([seen[0], torch.ones((len(tok), 1), dtype=attn.dtype, device=attn.device)], dim=-1)
            return self.model(input_ids=tok[:, None], attention_mask=seen[0], position_ids=positions[:, None],
                              past_key_values=cache, use_cache=True).logits[:, -1, :]

        return logits, next_pos, step

    def _routes_record(self):
        """A `moe.Routing.capture` block keeping only the routers' choices, or a block yielding None for a dense
        model (nothing to record)."""
        if self.routing is None:
            return contextlib.nullcontext(None)
        return self.routing.capture(compact=True)

    def _left_padded(self, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids and attention mask on the engine's device, each row padded on the left to the longest."""
        plen = max(len(p) for p in rows)
        ids = torch.full((len(rows), plen), self.pad_id, dtype=torch.long)
        attn = torch.zeros((len(rows), plen), dtype=torch.long)
        for i, p in enumerate(rows):
            ids[i, plen - len(p):] = torch.tensor(p)
            attn[i, plen - len(p):] = 1
        return ids.to(self.device), attn.to(self.device)

    def _completions(self, prompts: list[ModelPrompt], n: int, tokens: list[torch.Tensor], logps: list[torch.Tensor],
                     lengths: list[int], finished: list[bool], texts: list[str | None],
                     routes: list[torch.Tensor] | None = None) -> list[Completion]:
        """One Completion per row (`n` a prompt, each holding its prompt's images) from the decode loop's per-step
        tokens and logprobs, cut to each row's length."""
        rows = len(prompts) * n
        tok_mat = torch.stack(tokens, 1).tolist() if tokens else [[] for _ in range(rows)]
        lp_mat = torch.stack(logps, 1).tolist() if logps else [[] for _ in range(rows)]
        results = []
        for i in range(rows):
            L, prompt = lengths[i], prompts[i // n]
            cids = tok_mat[i][:L]
            text = texts[i] if texts[i] is not None else self.tokenizer.decode(cids, skip_special_tokens=True)
            results.append(Completion(
                prompt_ids=list(prompt.ids), completion_ids=cids, logprobs=lp_mat[i][:L], text=text,
                finish_reason="stop" if finished[i] else "length", prompt_index=i // n,
                routes=None if routes is None else routes[i], images=prompt.images,
            ))
        return results

    def _stop_strings(self, tokens, lengths, done, stops, texts) -> torch.Tensor:
        """Rows whose decoded completion now contains a stop string; their text is cut just after it."""
        hit = torch.zeros(len(lengths), dtype=torch.bool)
        last = torch.stack(tokens, 1)
        for i in torch.nonzero(~done).flatten().tolist():
            text = self.tokenizer.decode(last[i, : int(lengths[i])].tolist(), skip_special_tokens=True)
            cut = min((text.find(s) + len(s) for s in stops if s in text), default=-1)
            if cut >= 0:
                hit[i] = True
                texts[i] = text[:cut]
        return hit

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy tensors into the engine's parameters in place; every name, shape and dtype is checked before any
        copy (`tandem.sync.manifest`), so a refused update leaves the engine's weights as they were."""
        self._check_awake("load_weights")
        start = time.perf_counter()
        items = list(named_tensors)
        check_manifest(self.manifest(), items, "the hf engine", complete=False)
        nbytes = 0
        for name, t in items:
            p = self._params[name]
            if p.data_ptr() != t.data_ptr():
                p.copy_(t)
            nbytes += t.numel() * t.element_size()
        self.last_sync_seconds = time.perf_counter() - start
        self.last_sync_bytes = nbytes

    def manifest(self) -> dict[str, Spec]:
        """What a whole weight sync must bring: every parameter's name, shape and dtype (a tied head once)."""
        return {n: (tuple(p.shape), p.dtype) for n, p in self._params.items()}

    def weight_aliases(self) -> dict[str, str]:
        """Names accepted for another one: none (a tied head is one parameter, named once)."""
        return {}

    def weight_digest(self) -> dict[str, Digest]:
        """Checksums of the weights the engine samples with, to find the ones a sync got wrong (asleep: those it
        held when it fell asleep)."""
        if self._asleep is not None:
            return dict(self._digest_asleep)
        return {n: digest(p) for n, p in self._params.items()}

    def weights(self) -> dict[str, torch.Tensor]:
        """The engine's parameters by HF name, for a sender that writes new weights into them in place (a later
        `load_weights` of the same tensors then only checks them)."""
        self._check_awake("weights")
        return dict(self._params)

    def sleep(self) -> int:
        """Free the weights' storage (level 2: contents discarded; the next weight sync rewrites every parameter).

        The KV cache lives only inside `generate`, so the weights are all there is. Returns bytes released.
        """
        if self._asleep is not None:
            return 0
        self._digest_asleep = self.weight_digest()  # what it sampled with, should a step's logprobs disagree
        storages = residency.unique_storages(self._params.values())
        self._asleep = [(s, s.nbytes()) for s in storages]
        return sum(residency.free(s) for s in storages)

    def wake(self) -> int:
        """Re-allocate the weights (contents undefined until the next `load_weights`); returns bytes allocated."""
        if self._asleep is None:
            return 0
        restored = sum(residency.restore(s, n) for s, n in self._asleep)
        self._asleep = None
        return restored

    def resident_bytes(self) -> int:
        """Device bytes the engine's weights hold now (0 while asleep)."""
        return residency.storage_bytes(self._params.values())

    def _check_awake(self, what: str) -> None:
        if self._asleep is not None:
            raise RuntimeError(f"hf engine: {what} while asleep; call wake() and load_weights() first")

    def close(self) -> None:
        self.model = None
        self._params = {}


def _repeat_rows(cache, n: int) -> None:
    """Each row of a prefill's cache `n` times over, in place: an attention layer's keys and values, a linear-attention
    layer's (Qwen3.5's Gated DeltaNet) recurrent state and convolution window, which transformers' own
    `batch_repeat_interleave` leaves out."""
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    for layer in cache.layers:
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            states = [t for t in (*layer.conv_states.values(), *layer.recurrent_states.values()) if t is not None]
            if states:
                layer.reorder_cache(torch.arange(states[0].shape[0]).repeat_interleave(n))
        if hasattr(layer, "batch_repeat_interleave"):  # an attention layer's (a hybrid layer's attention part)
            layer.batch_repeat_interleave(n)
