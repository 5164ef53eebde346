"""The resharding executor: runs a Plan with torch.distributed point-to-point sends in bounded buckets (or through
shared memory between processes of one host), copying local bytes in place, returning (or streaming, bucket by
bucket) this rank's destination tensors."""
from __future__ import annotations

import os
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Iterator, Mapping

import torch
import torch.distributed as dist

from tandem.sync.layout import Box, extents, numel, shift, slices
from tandem.sync.channel import Op
from tandem.sync.planner import Move, Plan

ALIGN = 16  # staging offsets are multiples of this, so every dtype can be viewed in place (Tensor.view(dtype))
DEFAULT_BUCKET = 64 << 20
SHM_DIR = "/dev/shm"
# p2p tags of the shared-memory handshake and of each round's "written" / "read" notes; data tags count from 0
_TAG_NAME, _TAG_MAPPED, _TAG_WRITTEN, _TAG_READ = (1 << 24) + 0, (1 << 24) + 1, (1 << 24) + 2, (1 << 24) + 3
_NAME_BYTES = 256


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _split(move: Move, limit: int) -> list[Move]:
    """`move` cut along its leading dimensions into moves of at most `limit` bytes (aligned)."""
    if _aligned(move.nbytes) <= limit:
        return [move]
    per = move.nbytes // numel(move.box)
    for d, (lo, hi) in enumerate(move.box):
        if hi - lo > 1:
            row = numel(move.box) // (hi - lo) * per  # bytes of one index along d
            step = max(1, (limit - ALIGN) // row) if row + ALIGN <= limit else 1
            out = []
            for a in range(lo, hi, step):
                box = move.box[:d] + ((a, min(a + step, hi)),) + move.box[d + 1:]
                part = Move(move.name, move.src, move.dst, box, move.src_piece, move.dst_piece, numel(box) * per)
                out += _split(part, limit) if _aligned(part.nbytes) > limit else [part]
            return out
    raise ValueError(f"bucket_bytes {limit} is smaller than one element of {move.name}")


def rounds(plan: Plan, bucket_bytes: int) -> list[list[Move]]:
    """The plan cut into rounds in order, each rank sending plus receiving at most `bucket_bytes` per round (moves
    larger than that are cut first). This bounds the staging buffer (only non-contiguous views are staged) and how
    much lands per round for a streaming consumer. Deterministic, so every rank computes the same rounds alone."""
    if bucket_bytes < 2 * ALIGN:
        raise ValueError(f"bucket_bytes must be at least {2 * ALIGN}")
    out: list[list[Move]] = []
    current: list[Move] = []
    use: dict[int, int] = defaultdict(int)
    for move in plan.moves:
        if move.src == move.dst:  # local copies use no staging
            current.append(move)
            continue
        for part in _split(move, bucket_bytes):
            size = _aligned(part.nbytes)
            if use[part.src] + size > bucket_bytes or use[part.dst] + size > bucket_bytes:
                out.append(current)
                current, use = [], defaultdict(int)
            current.append(part)
            use[part.src] += size
            use[part.dst] += size
    out.append(current)
    return out


@dataclass
class _Shared:
    """Shared-memory segments of one rank for one plan: its own (what it sends is written there) and its peers'
    (mapped, read in place), and the (src, dst) pairs that use them; every other remote pair uses p2p."""
    mine: torch.Tensor | None
    peers: dict[int, torch.Tensor]
    pairs: set[tuple[int, int]]
    offsets: list[dict[int, int]]  # per round: where each remote move sits in its sender's segment (see _offsets)


class _TorchGroup:
    """p2p over a group of the default torch.distributed world (ranks are the group's); the same two calls as
    `tandem.sync.channel.WeightChannel`, which carries a plan between processes of no common world."""

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group

    def start(self, ops: list[Op]) -> list:
        if not ops:
            return []
        peer = (lambda r: r) if self.group is None else (lambda r: dist.get_global_rank(self.group, r))
        return dist.batch_isend_irecv([dist.P2POp(dist.isend if sending else dist.irecv, t, peer(p), self.group, tag)
                                       for sending, t, p, tag in ops])

    def wait(self, pending: list) -> None:
        for req in pending:
            req.wait()


def _p2p(transport, ops: list[Op]) -> None:
    transport.wait(transport.start(ops))


def _share(all_rounds: list[list[Move]], rank: int, transport, device: torch.device) -> _Shared:
    """Set up shared memory with the peers of this rank that can map it (same host, CPU tensors on both sides).

    Each sender creates one segment in /dev/shm as large as its largest round's outgoing bytes and tells its
    receivers its name; each receiver maps it if it can and says so; then the sender unlinks the file (the
    mappings live on, nothing is left behind). A pair either side of which cannot share (another host, another
    container, a small /dev/shm) stays on p2p, so mixed placements work.
    """
    remote = [m for r in all_rounds for m in r if m.src != m.dst]
    out_peers = sorted({m.dst for m in remote if m.src == rank})
    in_peers = sorted({m.src for m in remote if m.dst == rank})
    layouts = [_offsets(r) for r in all_rounds]
    need = max((used.get(rank, 0) for _, used in layouts), default=0)
    path, mine, note = None, None, b""
    if need and device.type == "cpu" and os.path.isdir(SHM_DIR):
        st = os.statvfs(SHM_DIR)
        if st.f_bavail * st.f_frsize > 2 * need:  # a full tmpfs would kill the writer with SIGBUS: keep a margin
            path = os.path.join(SHM_DIR, f"tandem-reshard-{uuid.uuid4().hex}")
            nonce = uuid.uuid4().bytes
            mine = torch.from_file(path, shared=True, size=need + len(nonce), dtype=torch.uint8)
            mine[need:] = torch.tensor(list(nonce), dtype=torch.uint8)
            note = f"{path}|{need}|{nonce.hex()}".encode()
    names = {s: torch.zeros(_NAME_BYTES, dtype=torch.uint8) for s in in_peers}
    _p2p(transport, [(True, torch.tensor(list(note.ljust(_NAME_BYTES, b"\0")), dtype=torch.uint8), d, _TAG_NAME)
                     for d in out_peers] + [(False, names[s], s, _TAG_NAME) for s in in_peers])
    peers = {s: seg for s, buf in names.items() if (seg := _map_segment(bytes(buf.tolist()).rstrip(b"\0"))) is not None}
    mapped = {d: torch.zeros(1, dtype=torch.uint8) for d in out_peers}
    _p2p(transport, [(True, torch.tensor([int(s in peers)], dtype=torch.uint8), s, _TAG_MAPPED) for s in in_peers]
         + [(False, mapped[d], d, _TAG_MAPPED) for d in out_peers])
    if path:
        os.unlink(path)
    pairs = {(rank, d) for d in out_peers if int(mapped[d])} | {(s, rank) for s in peers}
    return _Shared(mine if any(p[0] == rank for p in pairs) else None, peers, pairs, [at for at, _ in layouts])


def _map_segment(note: bytes) -> torch.Tensor | None:
    """A sender's segment from its note (path|size|nonce), or None when this process does not see that very file:
    on another host (or in another container) the path is absent, and mapping it would create an empty file of
    our own; the nonce written at its end guards against any other file of the same name."""
    if not note:
        return None
    path, size, nonce = note.decode().split("|")
    if not os.path.isfile(path):  # torch.from_file would create it
        return None
    try:
        seg = torch.from_file(path, shared=True, size=int(size) + len(nonce) // 2, dtype=torch.uint8)
    except (OSError, RuntimeError):
        return None
    if bytes(seg[int(size):].tolist()) != bytes.fromhex(nonce):
        return None
    return seg[:int(size)]


def _offsets(moves: list[Move]) -> tuple[dict[int, int], dict[int, int]]:
    """Where each remote move of a round sits in its sender's segment (by position in `moves`), and each sender's
    bytes used. A slice going to several ranks (replicas) is written once and read by all. Every remote move
    counts, whatever its transport, so each side computes the same offsets from the plan alone."""
    used: dict[int, int] = defaultdict(int)
    at: dict[tuple, int] = {}
    out = {}
    for i, m in enumerate(moves):
        if m.src != m.dst:
            key = (m.src, m.name, m.box)
            if key not in at:
                at[key] = used[m.src]
                used[m.src] += _aligned(m.nbytes)
            out[i] = at[key]
    return out, used


class _Cut:
    """How to take a move's box out of a rank's local tensor, with the slices worked out once per plan: the
    executor runs every step, and building views from boxes in Python cost about as much as the copies did."""

    __slots__ = ("outer", "shape", "inner")

    def __init__(self, piece, box: Box):
        self.outer = slices(piece.local)
        self.shape = extents(piece.box) if len(piece.local) != len(piece.box) else None  # a flat (ZeRO) piece
        self.inner = slices(shift(box, [a for a, _ in piece.box]))

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        part = t[self.outer]
        return (part if self.shape is None else part.view(self.shape))[self.inner]


@dataclass
class _RankRound:
    """One round of the plan as one rank runs it (precomputed once per plan, rank and transport)."""
    p2p: list[tuple[Move, int, _Cut, bool]] = field(default_factory=list)  # (move, tag, cut, this rank sends)
    writes: list[tuple[Move, int, _Cut]] = field(default_factory=list)  # into this rank's segment, at offset
    reads: list[tuple[Move, int, _Cut]] = field(default_factory=list)  # out of the sender's segment, at offset
    local: list[tuple[str, _Cut, _Cut]] = field(default_factory=list)  # (name, source cut, destination cut)
    notes_out: list[int] = field(default_factory=list)  # peers this rank wrote for
    notes_in: list[int] = field(default_factory=list)  # peers this rank reads from
    landed: list[tuple[str, int]] = field(default_factory=list)  # destination elements completed, per tensor


def _rank_rounds(all_rounds: list[list[Move]], rank: int, shared: _Shared) -> list[_RankRound]:
    """This rank's part of every round. p2p messages are tagged by their place among their pair's messages in
    the round (both sides count alike); a slice going to several ranks through the segment is written once."""
    out = []
    for k, moves in enumerate(all_rounds):
        rr, count, written = _RankRound(), defaultdict(int), set()
        offsets = shared.offsets[k] if shared.pairs else {}
        notes_out, notes_in = set(), set()
        for i, m in enumerate(moves):
            if rank not in (m.src, m.dst):
                continue
            if m.dst == rank:
                rr.landed.append((m.name, numel(m.box)))
            if m.src == m.dst:
                rr.local.append((m.name, _Cut(m.src_piece, m.box), _Cut(m.dst_piece, m.box)))
            elif (m.src, m.dst) in shared.pairs:
                if m.src == rank:
                    if offsets[i] not in written:
                        rr.writes.append((m, offsets[i], _Cut(m.src_piece, m.box)))
                        written.add(offsets[i])
                    notes_out.add(m.dst)
                else:
                    rr.reads.append((m, offsets[i], _Cut(m.dst_piece, m.box)))
                    notes_in.add(m.src)
            else:
                tag = count[(m.src, m.dst)]
                count[(m.src, m.dst)] += 1
                sending = m.src == rank
                rr.p2p.append((m, tag, _Cut(m.src_piece if sending else m.dst_piece, m.box), sending))
        rr.notes_out, rr.notes_in = sorted(notes_out), sorted(notes_in)
        out.append(rr)
    return out


def _to_local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


class Resharder:
    """Runs one `Plan` on one rank, again at every weight sync. The plan stays a value; what running it needs is
    worked out on the first run and kept here for the next: the plan cut into rounds in which each rank sends plus
    receives at most `bucket_bytes` (the staging buffer's bound: extra memory per rank is one buffer of at most
    that), the shared-memory segments (a handshake: every rank of the plan makes its first run at the same point)
    and this rank's part of every round.

    rank: this rank in `group` (None: ask the group, or the channel). Without a process group the plan must have
    no remote moves (one process). device: where new destination tensors and staging live (default: the device of
    the source tensors, else CPU; a rank that only receives, e.g. a sampler on a GPU, names it).
    shared_memory: pairs of processes on one host with CPU tensors exchange through a shared-memory segment (the
    sender writes each slice once, the receiver copies it out; a p2p note says when) instead of gloo's TCP
    loopback; False keeps every pair on p2p. Every rank of the plan must pass the same value.
    channel: a `tandem.sync.channel.WeightChannel` to carry the plan instead of `group` (ranks are the channel's;
    every wait has its transfer timeout): the processes need no common torch.distributed world.

    A plan with unchanging parameters (`Plan.unchanging`: a frozen vision tower) sends them at the first run only:
    every later run is the plan without them (its own executor, set up at its first run), the destinations holding
    them already. Every rank of the plan decides alike; `bytes_moved` is the latest run's."""

    def __init__(self, plan: Plan, rank: int | None = None, group: dist.ProcessGroup | None = None, *,
                 bucket_bytes: int = DEFAULT_BUCKET, device: torch.device | str | None = None,
                 shared_memory: bool = True, channel=None) -> None:
        self.plan = plan
        self._rest: Resharder | None = None  # runs the plan less its unchanging parameters, after the first run
        self._ran = False  # a whole run completed
        self.transport = channel if channel is not None else _TorchGroup(group)
        self.rank = rank if rank is not None else channel.rank if channel is not None else dist.get_rank(group)
        self.bucket_bytes, self.device, self.shared_memory = bucket_bytes, device, shared_memory
        self.shared: _Shared | None = None  # this rank's segments once the first run set them up; None: p2p only
        self._steps: list[_RankRound] | None = None  # this rank's part of every round, from the first run on
        self._sends: set[str] | None = None  # the source tensors this rank sends
        self._arriving: dict[str, int] = {}  # destination elements each of this rank's tensors awaits

    def run(self, src_tensors: Mapping[str, torch.Tensor],
            out: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Run the plan and return this rank's destination tensors (name -> tensor); see `stream`."""
        result: dict[str, torch.Tensor] = {}
        for batch in self.stream(src_tensors, out):
            result.update(batch)
        return result

    def stream(self, src_tensors: Mapping[str, torch.Tensor],
               out: Mapping[str, torch.Tensor] | None = None) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Run the plan, yielding lists of (name, tensor) as this rank's destination tensors complete, in plan
        order. Every rank of the plan must drive its iterator to the end.

        src_tensors: this rank's local tensors as laid out in the plan's source (DTensors are read locally).
        out: preallocated destination tensors to fill in place (others are allocated when their first bytes land)."""
        if self._ran and self.plan.unchanging:
            if self._rest is None:
                self._rest = Resharder(self.plan.without(self.plan.unchanging), self.rank,
                                       bucket_bytes=self.bucket_bytes, device=self.device,
                                       shared_memory=self.shared_memory, channel=self.transport)
            yield from self._rest.stream(src_tensors, out)
            return
        yield from self._whole(src_tensors, out)
        self._ran = True

    @property
    def bytes_moved(self) -> int:
        """Bytes the latest run sent over the network (before any run: the whole plan's)."""
        return (self._rest if self._rest is not None else self).plan.bytes_moved

    def _whole(self, src_tensors: Mapping[str, torch.Tensor],
               out: Mapping[str, torch.Tensor] | None) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """`stream` of the whole plan."""
        plan, rank = self.plan, self.rank
        # detach: parameters may require grad; the copies here are not part of any graph (out= still aliases them)
        src = {k: _to_local(v).detach() for k, v in src_tensors.items()}
        out = {k: _to_local(v).detach() for k, v in (out or {}).items()}
        device = self.device if self.device is not None else next(iter(src.values())).device if src else "cpu"
        mine = plan.dst_shapes.get(rank, {})
        for name, shape in mine.items():
            if name in out and tuple(out[name].shape) != tuple(shape):
                raise ValueError(f"out[{name!r}] has shape {tuple(out[name].shape)}, the plan needs {shape}")
        for name in self._sent_names():
            if name not in src:
                raise KeyError(f"rank {rank} holds source {name!r} in the plan but was not given it")
        waiting = dict(self._arriving)  # destination elements still to arrive, per tensor

        def dest(name: str) -> torch.Tensor:
            if name not in out:
                out[name] = torch.empty(mine[name], dtype=plan.params[name][2], device=device)
            return out[name]

        done = [(name, dest(name)) for name, w in waiting.items() if w == 0]  # empty shards: complete at once
        # reused by every round: faulting in fresh pages costs about as much as the copy itself
        stage = torch.empty(0, dtype=torch.uint8, device=device)
        for rr in self._steps if self._steps is not None else self._set_up(torch.device(device)):
            stage = self._round(rr, src, dest, stage, device)
            for name, count in rr.landed:
                waiting[name] -= count
                if waiting[name] == 0:
                    done.append((name, dest(name)))
            if done:
                yield done
                done = []
        if done:
            yield done

    def _sent_names(self) -> set[str]:
        """The names this rank sends; with them, the elements each of its destination tensors awaits."""
        if self._sends is None:
            self._arriving = {name: 0 for name in self.plan.dst_shapes.get(self.rank, {})}
            for m in self.plan.moves:
                if m.dst == self.rank:
                    self._arriving[m.name] += numel(m.box)
            self._sends = {m.name for m in self.plan.moves if m.src == self.rank}
        return self._sends

    def _set_up(self, device: torch.device) -> list[_RankRound]:
        """The first run's setup: the rounds, the shared memory (a handshake with the peers), this rank's steps."""
        all_rounds = rounds(self.plan, self.bucket_bytes)
        # CPU tensors only (gloo): an accelerator's group (NCCL) cannot carry the handshake's host tensors
        if self.shared_memory and device.type == "cpu":
            self.shared = _share(all_rounds, self.rank, self.transport, device)
        self._steps = _rank_rounds(all_rounds, self.rank, self.shared or _Shared(None, {}, set(), []))
        return self._steps

    def _round(self, rr: _RankRound, src: dict[str, torch.Tensor], dest: Callable[[str], torch.Tensor],
               stage: torch.Tensor, device: torch.device | str) -> torch.Tensor:
        """One round on this rank; returns the staging buffer for the next.

        p2p: one message per move. A contiguous source view is sent as is and a contiguous destination view of the
        same dtype receives in place; only the rest go through the staging buffer, packed before and unpacked
        after. Shared memory: the sender writes its slices into its segment and sends a "written" note; the
        receiver copies them out and answers "read", after which the sender may reuse the segment."""
        params = self.plan.params  # name -> (shape, source dtype, destination dtype); sends travel in the source's
        ours: list[tuple[Move, int, torch.Tensor, bool, bool]] = []  # (move, tag, view, as is, this rank sends)
        for m, tag, cut, sending in rr.p2p:
            view = cut(src[m.name] if sending else dest(m.name))
            ours.append((m, tag, view, view.is_contiguous() and (sending or view.dtype == params[m.name][1]), sending))
        for m, off, cut in rr.writes:
            self.shared.mine[off:off + m.nbytes].view(params[m.name][1]).view(extents(m.box)).copy_(cut(src[m.name]))
        need = sum(_aligned(m.nbytes) for m, _, _, direct, _ in ours if not direct)  # <= bucket_bytes by the rounds
        if need > stage.numel():
            stage = torch.empty(0, dtype=torch.uint8, device=device)  # free the old one first: never two at once
            stage = torch.empty(need, dtype=torch.uint8, device=device)
        ops, unpack, used = [], [], 0
        for m, tag, view, direct, sending in ours:
            if direct:
                payload = view.reshape(-1).view(torch.uint8)
            else:
                payload = stage[used:used + m.nbytes]
                used += _aligned(m.nbytes)
                typed = payload.view(params[m.name][1]).view(extents(m.box))
                if sending:
                    typed.copy_(view)
                else:
                    unpack.append((view, typed))
            ops.append((sending, payload, m.dst if sending else m.src, tag))
        note = torch.zeros(1, dtype=torch.uint8)
        ops += [(True, note, d, _TAG_WRITTEN) for d in rr.notes_out]
        ops += [(False, torch.zeros(1, dtype=torch.uint8), s, _TAG_WRITTEN) for s in rr.notes_in]
        pending = self.transport.start(ops)
        for name, src_cut, dst_cut in rr.local:  # local copies, while the peers' bytes are on their way
            dst_cut(dest(name)).copy_(src_cut(src[name]))
        self.transport.wait(pending)
        for view, typed in unpack:
            view.copy_(typed)
        for m, off, cut in rr.reads:
            cut(dest(m.name)).copy_(self.shared.peers[m.src][off:off + m.nbytes].view(params[m.name][1])
                                    .view(extents(m.box)))
        _p2p(self.transport, [(True, note, s, _TAG_READ) for s in rr.notes_in]
             + [(False, torch.zeros(1, dtype=torch.uint8), d, _TAG_READ) for d in rr.notes_out])
        return stage

