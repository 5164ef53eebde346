"""The streaming schedule's requests, engine-neutral: one completion being sampled (`Request`), one that stopped
(`Finished`), and what every engine's streaming session keeps of them (`StreamRequests`)."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Hashable


@dataclass
class Request:
    """One completion being sampled: its prompt, limit and seed, and the tokens so far with each one's logprob and
    policy version. A request begun again (`restarts`: dropped as too stale) draws from a seed of its own."""

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


@dataclass
class Finished:
    """A request that stopped: at a stop token or string (`stop`) or at its limit (`length`); its text."""

    request: Request
    finish_reason: str
    text: str


class StreamRequests:
    """What every engine's streaming session keeps: the requests waiting for a slot and those running, by key.
    `admitting = False` holds new requests back (the sampler drains before a weight load that must not land
    mid-sequence)."""

    def __init__(self) -> None:
        self.waiting: deque[Request] = deque()
        self.running: dict[Hashable, Request] = {}
        self.admitting = True

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def in_flight(self) -> int:
        """Requests running or waiting for a slot."""
        return len(self.running) + len(self.waiting)

    def requests(self) -> list[Request]:
        return list(self.running.values()) + list(self.waiting)

    def _unqueue(self, key: Hashable) -> None:
        """`key` out of the requests waiting, if it is there."""
        self.waiting = deque(r for r in self.waiting if r.key != key)

    def _admit(self, slots: int) -> list[Request]:
        """Waiting requests moved to running, oldest first, while `admitting` and fewer than `slots` run."""
        new = []
        while self.admitting and self.waiting and len(self.running) < slots:
            r = self.waiting.popleft()
            self.running[r.key] = r
            new.append(r)
        return new
