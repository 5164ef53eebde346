"""The weight channel: a process group of its own between trainers and samplers, outside every torch world."""
from __future__ import annotations

from datetime import timedelta
from typing import Any, Sequence

import torch
import torch.distributed as dist

# (this rank sends?, tensor, peer's rank in the channel, tag): one point-to-point message of a transfer
Op = tuple[bool, torch.Tensor, int, int]

_TAG_HEADER = (1 << 24) + 16  # above the executor's own tags (sync/reshard.py)
# How long a receiver waits for the senders to start a sync: they may still be training (a whole step), so this
# is no transfer timeout; a sender that dies closes its sockets and the wait fails at once.
START_TIMEOUT_S = 24 * 3600.0


class WeightChannel:
    """`size` processes joined by one gloo group (NCCL for CUDA tensors) made from a TCPStore of their own.

    Samplers with vLLM must not join the trainers' torch.distributed world: vLLM adopts a default process group
    it finds and makes collective `new_group` calls over it that the trainers never make (they hang). This group
    is built from a store and a rank alone, registered nowhere, so neither side's world knows of it. Rank 0 hosts
    the store. Every wait has a timeout: a transfer that stalls fails with the peers still outstanding named.
    """

    def __init__(self, address: tuple[str, int], rank: int, size: int, timeout_s: float, device: str = "cpu"):
        host, port = address
        if not 0 <= rank < size:
            raise ValueError(f"weight channel: rank {rank} outside 0..{size - 1}")
        self.rank, self.size, self.timeout_s = rank, size, float(timeout_s)
        self.device = torch.device(device)
        wait = timedelta(seconds=max(self.timeout_s, 60.0))  # the rendezvous waits for every process to start
        self._store = dist.TCPStore(host, port, size, rank == 0, wait, wait_for_workers=False)
        store = dist.PrefixStore("tandem-weights", self._store)
        if self.device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timedelta(seconds=START_TIMEOUT_S)
            self.group: Any = dist.ProcessGroupNCCL(store, rank, size, opts)
        else:
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = timedelta(seconds=START_TIMEOUT_S)  # per op; each wait below sets its own, shorter
            # bind where the rendezvous is: the host name may resolve to an address off this machine
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
            self.group = dist.ProcessGroupGloo(store, rank, size, opts)

    def start(self, ops: Sequence[Op]) -> list[tuple[Any, Op]]:
        """Post every message of `ops` at once (sends and receives); `wait` completes them."""
        out = []
        for sending, tensor, peer, tag in ops:
            work = (self.group.send if sending else self.group.recv)([tensor], peer, tag)
            out.append((work, (sending, tensor, peer, tag)))
        return out

    def wait(self, pending: list[tuple[Any, Op]], timeout_s: float | None = None) -> None:
        """Complete messages posted by `start`, each within `timeout_s` (default: the channel's transfer timeout);
        on a stall, raise TimeoutError naming the peers still outstanding."""
        limit = timedelta(seconds=self.timeout_s if timeout_s is None else timeout_s)
        for i, (work, (sending, _, peer, _)) in enumerate(pending):
            try:
                work.wait(limit)
            except RuntimeError as exc:
                left = sorted({p for _, (_, _, p, _) in pending[i:]})
                what = "sending to" if sending else "receiving from"
                if "Timed out" in str(exc):
                    raise TimeoutError(f"weight channel rank {self.rank}: {what} rank {peer} took over "
                                       f"{limit.total_seconds():.0f} s (placement.sync_timeout_s); ranks still "
                                       f"outstanding: {left}") from exc
                raise RuntimeError(f"weight channel rank {self.rank}: {what} rank {peer} failed: {exc}") from exc

    def exchange(self, ops: Sequence[Op], timeout_s: float | None = None) -> None:
        self.wait(self.start(ops), timeout_s)

    def announce(self, version: int, receivers: Sequence[int]) -> None:
        """Tell each receiver that policy `version` is about to be sent (rank 0 only): receivers wait for this
        without a transfer timeout, since the senders train before they send."""
        header = torch.tensor([version], dtype=torch.int64, device=self.device)
        self.exchange([(True, header, r, _TAG_HEADER) for r in receivers])

    def expect(self, version: int, sender: int = 0) -> None:
        """Wait for `sender`'s announcement of `version`; a different version means the two sides disagree on
        what is being sent, which would load wrong weights: refuse."""
        header = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.exchange([(False, header, sender, _TAG_HEADER)], START_TIMEOUT_S)
        got = int(header.item())
        if got != version:
            raise RuntimeError(f"weight channel rank {self.rank}: expected policy version {version}, the senders "
                               f"announced {got}")

    def close(self) -> None:
        shutdown = getattr(self.group, "shutdown", None)
        if shutdown is not None:
            try:
                shutdown()
            except RuntimeError:  # a peer already gone: nothing left to shut down cleanly
                pass
        self.group = None
        self._store = None
