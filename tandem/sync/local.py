"""Weight sync inside one process: the trainer's tensors go straight into the engine's weights, no disk."""
from __future__ import annotations

import time
from typing import Iterable

import torch

from tandem.rollout.base import RolloutEngine
from tandem.rollout.manifest import check_manifest
from tandem.sync.frozen import SentOnce


def push_weights(named: Iterable[tuple[str, torch.Tensor]], engine: RolloutEngine,
                 once: SentOnce | None = None) -> dict:
    """Load every tensor into `engine` (which buckets as its layout needs, e.g. vLLM's fused modules) and
    return the sync's seconds and bytes (metrics). `once`: weights that only the first sync sends (`SentOnce`);
    later syncs leave them out of `named`.

    This is a whole sync: the names must be exactly the engine's (`engine.manifest()`), less those it holds already
    (`once.held`), with its shapes and dtypes; anything missing, extra, repeated or misshapen is refused before the
    engine is touched.
    """
    start = time.perf_counter()
    held = once.held if once is not None else frozenset()
    tensors = [(n, t) for n, t in named if n not in held]
    expected = {n: spec for n, spec in engine.manifest().items() if n not in held}
    check_manifest(expected, tensors, f"the {type(engine).__name__}", complete=True, aliases=engine.weight_aliases())
    engine.load_weights(tensors)
    if once is not None:
        once.sent = True
    return {"seconds": time.perf_counter() - start, "bytes": sum(t.numel() * t.element_size() for _, t in tensors)}
