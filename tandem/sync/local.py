"""Weight sync inside one process: the trainer's tensors go straight into the engine's weights, no disk."""
from __future__ import annotations

import time
from typing import Iterable

import torch

from tandem.rollout.base import RolloutEngine
from tandem.rollout.manifest import check_manifest


def push_weights(named: Iterable[tuple[str, torch.Tensor]], engine: RolloutEngine) -> dict:
    """Load every tensor into `engine` (which buckets as its layout needs, e.g. vLLM's fused modules) and
    return the sync's seconds and bytes (metrics).

    This is a whole sync: the names must be exactly the engine's (`engine.manifest()`), with its shapes and
    dtypes; anything missing, extra, repeated or misshapen is refused before the engine is touched.
    """
    start = time.perf_counter()
    tensors = list(named)
    check_manifest(engine.manifest(), tensors, f"the {type(engine).__name__}", complete=True,
                   aliases=engine.weight_aliases())
    engine.load_weights(tensors)
    return {"seconds": time.perf_counter() - start, "bytes": sum(t.numel() * t.element_size() for _, t in tensors)}
