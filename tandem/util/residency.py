"""Free and restore a tensor's device storage in place, keeping the tensor object (shared by train/ and rollout/).

Why in place: optimizers, modules and FSDP hold references to these exact tensors; swapping `.data` would leave
them pointing at stale storage. Resizing the storage to 0 releases its memory while every view of it stays valid
in shape; resizing it back re-allocates (contents undefined until written).
"""
from __future__ import annotations

from typing import Iterable

import torch


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor that owns memory on this process: a DTensor's local shard, else the tensor itself."""
    to_local = getattr(t, "_local_tensor", None)
    return to_local if to_local is not None else t


def unique_storages(tensors: Iterable[torch.Tensor]) -> list[torch.UntypedStorage]:
    """The distinct storages behind `tensors` (tied weights and views share one), in first-seen order."""
    seen: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        s = local(t).untyped_storage()
        key = s._cdata  # identity of the storage object itself: stable while its data is freed
        seen.setdefault(key, s)
    return list(seen.values())


def storage_bytes(tensors: Iterable[torch.Tensor], device: torch.device | str | None = None) -> int:
    """Bytes currently allocated by the distinct storages of `tensors` (on `device` when given)."""
    dev = torch.device(device) if device is not None else None
    total = 0
    for s in unique_storages(tensors):
        if dev is None or s.device.type == dev.type:
            total += s.nbytes()
    return total


def ensure_resizable(t: torch.Tensor) -> None:
    """Give a parameter whose storage cannot be resized (e.g. memory-mapped from a checkpoint) its own copy.

    Only `.data` changes: the Parameter object, and so every reference to it, stays the same.
    """
    if not local(t).untyped_storage().resizable():
        t.data = t.data.clone()


def free(storage: torch.UntypedStorage) -> int:
    """Release a storage's memory; returns the bytes released."""
    n = storage.nbytes()
    if n:
        storage.resize_(0)
    return n


def restore(storage: torch.UntypedStorage, nbytes: int) -> int:
    """Re-allocate a freed storage to `nbytes` (contents undefined); returns the bytes allocated."""
    if storage.nbytes() != nbytes:
        storage.resize_(nbytes)
    return nbytes


def as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole storage (to copy it as a unit, including any padding FSDP keeps)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
