"""Continuous generation for the streaming schedule: requests join and leave the embedded engine between decode steps,
new weights load between steps, and every token records the policy version that sampled it."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Hashable

import torch

from tandem.rollout import llama_decode
from tandem.rollout.base import Sampling
from tandem.rollout.hf import HFEngine, _draw, uniforms


@dataclass
class Request:
    """One completion being sampled: its prompt, limit and seed, and the tokens so far with each one's logprob and
    policy version. A restarted request (dropped as too stale) begins again from its prompt with a new seed."""

    key: Hashable
    prompt_ids: list[int]
    max_new_tokens: int
    seed: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    restarts: int = 0

    @property
    def prefix(self) -> list[int]:
        return self.prompt_ids + self.tokens

    def restart(self) -> None:
        self.tokens, self.logprobs, self.versions = [], [], []
        self.restarts += 1


@dataclass
class Finished:
    """A request that stopped: at a stop token or string (`stop`) or at its limit (`length`); its text."""

    request: Request
    finish_reason: str
    text: str


def streams(model) -> bool:
    """Whether the hf engine streams this model: the Llama-family layers `llama_decode` reproduces (Qwen2, Llama)."""
    return llama_decode.decodes(model)


class HFStream:
    """The hf engine's continuous batching: up to `slots` requests decode together, one token each per `step`; a
    request joins at the next step after `add` (its prefix prefilled into a free slot) and leaves when it stops.

    `reload(version)` after the engine's weights change: every running request's prefix is prefilled again with the
    new weights, so the tokens it samples next come from exactly the new policy (the trainer's logprobs of them
    agree with the sampler's), while the tokens before keep the version that sampled them. `admitting = False`
    holds new requests back (the sampler drains before a weight load that must not land mid-sequence)."""

    def __init__(self, engine: HFEngine, sampling: Sampling, slots: int, capacity: int):
        if not streams(engine.model):
            raise ValueError(f"the hf engine streams Llama-family models only (Qwen2, Llama), not "
                             f"{engine.model.config.model_type!r}; use placement.schedule: async")
        self.engine, self.sampling = engine, sampling
        with torch.inference_mode():  # its caches are written only in inference mode (every method here)
            self.decoder = llama_decode.SlotDecoder(engine.model, slots, capacity, engine.kv_dtype)
        self.waiting: deque[Request] = deque()
        self.running: dict[Hashable, Request] = {}
        self.draws: dict[Hashable, list[float]] = {}  # each running request's uniforms, one per token (`_draw`)
        self.logits: torch.Tensor | None = None  # [rows, V]: each running row's next-token logits, in slot order
        self.admitting = True
        stops = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else set(engine.eos_ids))
        self.stop_ids = stops

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def in_flight(self) -> int:
        """Requests running or waiting for a slot."""
        return len(self.running) + len(self.waiting)

    def requests(self) -> list[Request]:
        return list(self.running.values()) + list(self.waiting)

    @torch.inference_mode()
    def discard(self, key: Hashable) -> None:
        """Forget a request (running or waiting)."""
        if key in self.running:
            self._leave(key)
        self.waiting = deque(r for r in self.waiting if r.key != key)

    @torch.inference_mode()
    def reload(self) -> None:
        """The engine's weights changed: decode with the new ones and prefill every running prefix again."""
        self.decoder.refresh()
        rows = [self.running[k] for k in self.decoder.rows]
        if rows:
            self.logits = self.decoder.fill([r.key for r in rows], [r.prefix for r in rows])

    @torch.inference_mode()
    def step(self, version: int) -> list[Finished]:
        """Admit waiting requests into free slots, then one token for every running one, tagged `version`; the
        requests that stopped (they have left their slots)."""
        self._admit()
        if not self.running:
            return []
        keys = list(self.decoder.rows)
        u = None
        if self.sampling.temperature > 0:
            u = torch.tensor([self.draws[k][len(self.running[k].tokens)] for k in keys], dtype=torch.float64,
                             device=self.logits.device)
        tok, lp = _draw(self.logits.float(), self.sampling, u)
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

    def _admit(self) -> None:
        free = self.decoder.slots - len(self.running)
        if not (self.admitting and free and self.waiting):
            return
        new = [self.waiting.popleft() for _ in range(min(free, len(self.waiting)))]
        for r in new:
            self.running[r.key] = r
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
