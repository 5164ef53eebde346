"""Continuous generation for the streaming schedule: requests join and leave the embedded engine between decode steps,
new weights load between steps, and every token records the policy version that sampled it."""
from __future__ import annotations

from typing import Hashable

import torch

from tandem.architectures import profile_of
from tandem.rollout.base import Sampling
from tandem.rollout.hf.engine import HFEngine, draw, uniforms
from tandem.rollout.requests import Finished, Request, StreamRequests


FILL_PADDING = 1.25  # SlotDecoder.fill: the most padded positions a prefill batch may run per real one


class SlotDecoder:
    """Continuous batching on the model's own forward for the streaming schedule: up to `slots` rows in one KV cache,
    each row's positions right-aligned (left padding, masked), so a row joins (its prefix prefilled, its keys and
    values padded to the cache's width) or leaves (the last row takes its slot; columns no row uses any more are
    cut) between any two steps while the others decode. The forward reads the model's weights as they are: after a
    weight load the rows' cached keys and values are the old weights', and the caller prefills them again (`fill`)
    if it wants them exact."""

    def __init__(self, model, slots: int):
        self.model, self.slots = model, slots
        self.rows: list = []  # the key of the row in each slot
        self.cache = None  # a DynamicCache of the rows' keys and values, [cached rows, kv heads, width, head dim]
        self.mask: torch.Tensor | None = None  # [cached rows, width]: 1 at each row's own positions
        self.cached: list[int] = []  # the cache row that holds each slot's row (rows leave before the cache compacts)

    def fill(self, keys: list, prefixes: list[list[int]]) -> torch.Tensor:
        """New rows `keys` with these prefixes (prompt and any tokens already sampled), prefilled; logits
        [len(keys), V] of each one's next token. A key already held is prefilled again in its slot.

        Rows of like length are prefilled together (sorted by length, a batch closed where padding would pass
        FILL_PADDING of its real tokens): a long-tailed set of prefixes, as a weight load re-prefills, would
        otherwise pad every row to the longest."""
        self._compact()
        where = []
        for key in keys:
            if key not in self.rows:
                if len(self.rows) == self.slots:
                    raise RuntimeError(f"no free slot of {self.slots} for another row")
                self.rows.append(key)
            where.append(self.rows.index(key))
        lens = [len(x) for x in prefixes]
        logits: list[torch.Tensor | None] = [None] * len(keys)
        parts, batch = [], []
        for i in sorted(range(len(keys)), key=lens.__getitem__) + [-1]:
            if batch and (i < 0 or (len(batch) + 1) * lens[i] > FILL_PADDING * (sum(lens[j] for j in batch) + lens[i])):
                rows, kv, mask = self._prefill([prefixes[j] for j in batch])
                for j, row in zip(batch, rows):
                    logits[j] = row
                parts.append(([where[j] for j in batch], kv, mask))
                batch = []
            batch.append(i)
        self._place(parts)
        return torch.stack(logits)

    def _prefill(self, prefixes: list[list[int]]) -> tuple[torch.Tensor, list, torch.Tensor]:
        """These prefixes, left-padded to the longest, through the model: each one's next-token logits, each layer's
        keys and values, and their attention mask."""
        from transformers import DynamicCache

        P, dev = max(len(x) for x in prefixes), next(self.model.parameters()).device
        ids = torch.zeros((len(prefixes), P), dtype=torch.long)
        mask = torch.zeros((len(prefixes), P), dtype=torch.long)
        for i, x in enumerate(prefixes):
            ids[i, P - len(x):], mask[i, P - len(x):] = torch.tensor(x), 1
        ids, mask = ids.to(dev), mask.to(dev)
        cache = DynamicCache(config=self.model.config)
        logits = self.model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                            past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        return logits, [(layer.keys, layer.values) for layer in cache.layers], mask

    def _place(self, parts: list[tuple[list[int], list, torch.Tensor]]) -> None:
        """The cache rebuilt with each part's rows (slots, each layer's keys and values, mask) in their slots, the
        rows no part refills kept as they were; every row right-aligned to the widest."""
        from transformers import DynamicCache

        refilled = {slot for where, _, _ in parts for slot in where}
        kept = [slot for slot in range(len(self.cached)) if slot not in refilled]
        if kept:
            parts = [(kept, [(layer.keys[kept], layer.values[kept]) for layer in self.cache.layers],
                      self.mask[kept])] + parts
        width, rows = max(mask.shape[1] for _, _, mask in parts), len(self.rows)
        self.mask = parts[-1][2].new_zeros((rows, width))
        kv = [(k.new_zeros((rows, k.shape[1], width, k.shape[3])), v.new_zeros((rows, v.shape[1], width, v.shape[3])))
              for k, v in parts[-1][1]]
        for where, part_kv, mask in parts:
            at = torch.tensor(where, dtype=torch.long, device=mask.device)
            self.mask[at, width - mask.shape[1]:] = mask
            for (k, v), (k0, v0) in zip(kv, part_kv):
                k[at, :, width - k0.shape[2]:] = k0
                v[at, :, width - v0.shape[2]:] = v0
        self.cache, self.cached = DynamicCache(kv, config=self.model.config), list(range(rows))

    def remove(self, key) -> None:
        """The row leaves; the last row moves into its slot (the cache follows at the next `step` or `fill`)."""
        slot = self.rows.index(key)
        self.rows[slot], self.cached[slot] = self.rows[-1], self.cached[-1]
        self.rows.pop()
        self.cached.pop()

    def _compact(self) -> None:
        """The cache down to the rows still held, in slot order, without the columns that are padding in all of
        them."""
        if self.cache is None or self.cached == list(range(self.mask.shape[0])):
            return
        if not self.rows:
            self.cache, self.mask = None, None
            return
        at = torch.tensor(self.cached, dtype=torch.long, device=self.mask.device)
        used = int(self.mask[at].any(0).nonzero()[0])  # the first column some row still uses
        self.mask = self.mask[at, used:]
        for layer in self.cache.layers:
            layer.keys, layer.values = layer.keys[at, :, used:], layer.values[at, :, used:]
        self.cached = list(range(len(self.rows)))

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token to every row (in slot order, [len(rows)]); logits [len(rows), V] of each one's next."""
        self._compact()
        positions = self.mask.sum(-1, keepdim=True)  # each row's next position: the count of its own so far
        self.mask = torch.cat([self.mask, self.mask.new_ones((len(self.rows), 1))], dim=1)
        return self.model(input_ids=tokens[:, None], attention_mask=self.mask, position_ids=positions,
                          past_key_values=self.cache, use_cache=True).logits[:, -1]


class HFStream(StreamRequests):
    """The hf engine's continuous batching: up to `slots` requests decode together, one token each per `step`; a
    request joins at the next step after `add` (its prefix prefilled into a free slot) and leaves when it stops.

    `reload(version)` after the engine's weights change: every running request's prefix is prefilled again with the
    new weights, so the tokens it samples next come from exactly the new policy (the trainer's logprobs of them
    agree with the sampler's), while the tokens before keep the version that sampled them."""

    def __init__(self, engine: HFEngine, sampling: Sampling, slots: int):
        super().__init__()
        if not profile_of(engine.model).streams:  # its model as it is; refused before any model loads too
            raise ValueError(f"the hf engine streams the model zoo's architectures with full attention in every "
                             f"layer, not this {engine.model.config.model_type!r}; use placement.schedule: async")
        self.engine, self.sampling = engine, sampling
        self.decoder = SlotDecoder(engine.model, slots)
        self.draws: dict[Hashable, list[float]] = {}  # each running request's uniforms, one per token (`draw`)
        self.logits: torch.Tensor | None = None  # [rows, V]: each running row's next-token logits, in slot order
        stops = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else set(engine.eos_ids))
        self.stop_ids = stops

    @torch.inference_mode()
    def discard(self, key: Hashable) -> None:
        """Forget a request (running or waiting)."""
        if key in self.running:
            self._leave(key)
        self._unqueue(key)

    def suspend(self) -> None:
        """Nothing to do around the engine's own `generate`: it keeps a cache of its own (`VLLMStream.suspend`)."""

    def resume(self) -> None:
        """See `suspend`."""

    @torch.inference_mode()
    def reload(self) -> None:
        """The engine's weights changed: decode with the new ones and prefill every running prefix again."""
        rows = [self.running[k] for k in self.decoder.rows]
        if rows:
            self.logits = self.decoder.fill([r.key for r in rows], [r.prefix for r in rows])

    @torch.inference_mode()
    def step(self, version: int) -> list[Finished]:
        """Admit waiting requests into free slots, then one token for every running one, tagged `version`; the
        requests that stopped (they have left their slots)."""
        self._join()
        if not self.running:
            return []
        keys = list(self.decoder.rows)
        u = None
        if self.sampling.temperature > 0:
            u = torch.tensor([self.draws[k][len(self.running[k].tokens)] for k in keys], dtype=torch.float64,
                             device=self.logits.device)
        tok, lp = draw(self.logits.float(), self.sampling, u)
        done: list[Finished] = []
        for key, t, logp in zip(keys, tok.tolist(), lp.tolist()):
            r = self.running[key]
            r.tokens.append(t)
            r.logprobs.append(logp)
            r.versions.append(version)
            reason, text = self._stopped(r)
            if reason:
                done.append(Finished(r, reason, text))
        fed = dict(zip(keys, tok))
        for f in done:
            self._leave(f.request.key)
        if self.decoder.rows:
            self.logits = self.decoder.step(torch.stack([fed[k] for k in self.decoder.rows]))
        return done

    def _stopped(self, r: Request) -> tuple[str, str]:
        """Why `r` stops after its last token ("stop", "length", or "" to go on), and its text."""
        text = ""
        s = self.sampling
        if r.tokens[-1] in self.stop_ids:
            reason = "stop"
        elif s.stop:
            text = self.engine.tokenizer.decode(r.tokens, skip_special_tokens=True)
            cut = min((text.find(x) + len(x) for x in s.stop if x in text), default=-1)
            if cut >= 0:
                return "stop", text[:cut]
            reason = "length" if len(r.tokens) >= r.max_new_tokens else ""
        else:
            reason = "length" if len(r.tokens) >= r.max_new_tokens else ""
        if reason and not text:
            text = self.engine.tokenizer.decode(r.tokens, skip_special_tokens=True)
        return reason, text

    def _join(self) -> None:
        """Requests admitted into free slots, their prefixes prefilled."""
        new = self._admit(self.decoder.slots)
        if not new:
            return
        for r in new:
            gen = torch.Generator(device=self.engine.device).manual_seed(r.seed + 7919 * r.restarts)
            self.draws[r.key] = uniforms([gen], r.max_new_tokens, 1)[:, 0].tolist()
        logits = self.decoder.fill([r.key for r in new], [r.prefix for r in new])
        self.logits = logits if self.logits is None or len(self.decoder.rows) == len(new) else \
            torch.cat([self.logits, logits])

    def _leave(self, key: Hashable) -> None:
        slot, last = self.decoder.rows.index(key), len(self.decoder.rows) - 1
        self.decoder.remove(key)
        if slot != last:
            self.logits[slot] = self.logits[last]
        self.logits = self.logits[:last]
        del self.running[key]
        self.draws.pop(key, None)
