"""Weights the trainer never changes (a frozen vision tower): sent to an engine once, then left out of its syncs."""
from __future__ import annotations

from typing import Iterable

from tandem.config import Config


class SentOnce:
    """Weights, by the engine's names, that the first sync into an engine sends with the rest and every later one
    leaves out: the trainer never changes them, and the engine still holds what it was sent (only for an engine that
    keeps its weights between syncs: `engine_keeps_weights`). A sync reads `held` and, once it has loaded the
    engine, sets `sent`."""

    def __init__(self, names: Iterable[str] = ()):
        self.names = frozenset(names)
        self.sent = False

    @property
    def held(self) -> frozenset[str]:
        """What the engine holds already, which this sync leaves out: nothing until a sync has sent them."""
        return self.names if self.sent else frozenset()


def engine_keeps_weights(cfg: Config, device: str) -> bool:
    """Whether the engines a trainer on `device` syncs into keep their weights from one sync to the next: every one
    but a colocated engine that drops them while it sleeps (with offload on, the hf engine frees its weights' storage;
    vLLM at sleep level 2 discards them; at level 1 it moves them to host memory and back)."""
    if cfg.placement.mode == "split" or not cfg.placement.offloads(device):
        return True
    return cfg.rollout.engine == "vllm" and cfg.rollout.vllm.sleep_level == 1
