"""Weight sync inside one process: the trainer's tensors go straight into the engine's weights, no disk."""
from __future__ import annotations

import time
from typing import Iterable

import torch

from tandem.rollout.base import RolloutEngine


def push_weights(named: Iterable[tuple[str, torch.Tensor]], engine: RolloutEngine) -> dict:
    """Load every tensor into `engine` (which buckets as its layout needs, e.g. vLLM's fused modules) and
    return the sync's seconds and bytes (metrics)."""
    start = time.perf_counter()
    tensors = list(named)
    engine.load_weights(tensors)
    return {"seconds": time.perf_counter() - start, "bytes": sum(t.numel() * t.element_size() for _, t in tensors)}
