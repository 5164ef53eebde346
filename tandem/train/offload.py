"""Fine-grained offload: named tensor groups (params, grads, optimizer state, reference) moved device <-> host.

Each group is moved bucket by bucket (`bucket_bytes`), keeping the same tensor objects: a storage's bytes are
copied to a host buffer and the device storage is resized to 0; loading re-allocates it and copies back. So the
optimizer, the modules and FSDP keep their references, and the device-resident bytes of an offloaded group are
really 0. On CUDA the host buffers are pinned and copies run on a side stream (one bucket in flight at a time);
on CPU the "host" is a separate buffer, so the code path and the accounting are the same and testable.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch

from tandem.util import residency

TensorSource = Callable[[], Iterable[torch.Tensor]]


class _Group:
    def __init__(self, source: TensorSource):
        self.source = source  # asked again at each offload: grads and optimizer state come and go
        self.moved: list[tuple[torch.UntypedStorage, torch.Tensor]] = []  # (device storage, host copy)
        self.offloaded = False


class Offloader:
    """Moves named groups of tensors between the compute device and host memory; see the module docstring."""

    def __init__(self, device: torch.device | str, bucket_bytes: int = 64 << 20):
        self.device = torch.device(device)
        self.bucket_bytes = max(int(bucket_bytes), 1)
        self.groups: dict[str, _Group] = {}
        self._host: dict[int, torch.Tensor] = {}  # storage id -> reusable host buffer (pinned on CUDA)
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def register(self, name: str, source: TensorSource) -> None:
        """`source()` yields the group's tensors (DTensors allowed: their local shard is what moves)."""
        self.groups[name] = _Group(source)

    def _buckets(self, items: list, nbytes: Callable[[object], int]) -> Iterable[list]:
        bucket, size = [], 0
        for item in items:
            bucket.append(item)
            size += nbytes(item)
            if size >= self.bucket_bytes:
                yield bucket
                bucket, size = [], 0
        if bucket:
            yield bucket

    def _host_buffer(self, s: torch.UntypedStorage) -> torch.Tensor:
        buf = self._host.get(s._cdata)
        if buf is None or buf.numel() != s.nbytes():
            buf = torch.empty(s.nbytes(), dtype=torch.uint8, pin_memory=self.device.type == "cuda")
            self._host[s._cdata] = buf
        return buf

    def to_host(self, *names: str) -> int:
        """Copy each group to host and free its device storage; returns the device bytes released."""
        released = 0
        for name in names:
            g = self.groups[name]
            if g.offloaded:
                continue
            storages = [s for s in residency.unique_storages(g.source()) if s.device.type == self.device.type
                        and s.nbytes() > 0]
            g.moved = []
            for bucket in self._buckets(storages, lambda s: s.nbytes()):
                pairs = [(s, self._host_buffer(s)) for s in bucket]
                self._copy([(residency.as_bytes(s), h) for s, h in pairs])
                for s, h in pairs:
                    released += residency.free(s)
                    g.moved.append((s, h))
            g.offloaded = True
        return released

    def to_device(self, *names: str) -> int:
        """Re-allocate each group's device storage and copy its contents back; returns the bytes restored."""
        restored = 0
        for name in names:
            g = self.groups[name]
            if not g.offloaded:
                continue
            for pairs in self._buckets(g.moved, lambda pair: pair[1].numel()):
                for s, h in pairs:
                    restored += residency.restore(s, h.numel())
                self._copy([(h, residency.as_bytes(s)) for s, h in pairs])
            g.moved, g.offloaded = [], False
        return restored

    def _copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """dst.copy_(src) for a bucket; on CUDA on the side stream, waited for before the storages are touched."""
        if self._stream is None:
            for src, dst in pairs:
                dst.copy_(src)
            return
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            for src, dst in pairs:
                dst.copy_(src, non_blocking=True)
        # the bucket's device storage is freed (offload) or used (load) next: finish its copies first
        self._stream.synchronize()

    def resident_bytes(self) -> dict[str, int]:
        """Device bytes each group holds now (0 for an offloaded group: its storages are freed)."""
        return {name: residency.storage_bytes(g.source(), self.device) for name, g in self.groups.items()}
