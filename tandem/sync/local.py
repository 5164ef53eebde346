"""Weight sync inside one process: the trainer's tensors go to the engine in buckets of bounded size, no disk."""
from __future__ import annotations

import time
from typing import Iterable, Iterator

import torch

from tandem.rollout.base import RolloutEngine


def buckets(named: Iterable[tuple[str, torch.Tensor]], max_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of tensors of at most `max_bytes` each (a larger tensor travels alone)."""
    bucket, size = [], 0
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > max_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket


def push_weights(named: Iterable[tuple[str, torch.Tensor]], engine: RolloutEngine, bucket_bytes: int) -> dict:
    """Load every tensor into `engine`, bucket by bucket; returns the sync's seconds and bytes (metrics)."""
    start, total = time.perf_counter(), 0
    for bucket in buckets(named, bucket_bytes):
        engine.load_weights(bucket)
        total += sum(t.numel() * t.element_size() for _, t in bucket)
    return {"seconds": time.perf_counter() - start, "bytes": total}
