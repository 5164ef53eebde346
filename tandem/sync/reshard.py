"""The resharding executor: runs a Plan with torch.distributed point-to-point sends in bounded buckets, copying
local bytes in place, returning (or streaming, bucket by bucket) this rank's destination tensors."""
from __future__ import annotations

from collections import defaultdict
from typing import Iterator, Mapping

import torch
import torch.distributed as dist

from tandem.sync.layout import Box, extents, numel, shift, slices
from tandem.sync.planner import Move, Plan

ALIGN = 16  # staging offsets are multiples of this, so every dtype can be viewed in place (Tensor.view(dtype))
DEFAULT_BUCKET = 64 << 20


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


def _view(piece_tensor_view: torch.Tensor, piece_box: Box, box: Box) -> torch.Tensor:
    return piece_tensor_view[slices(shift(box, [a for a, _ in piece_box]))]


def _src_view(move: Move, src_tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return _view(move.src_piece.view(src_tensors[move.name]), move.src_piece.box, move.box)


def _to_local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def reshard_iter(plan: Plan, rank: int | None, src_tensors: Mapping[str, torch.Tensor],
                 group: dist.ProcessGroup | None = None, bucket_bytes: int = DEFAULT_BUCKET,
                 out: Mapping[str, torch.Tensor] | None = None, device: torch.device | str | None = None,
                 ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Run `plan` on this rank (`rank` in `group`; None: ask the group), yielding lists of (name, tensor) as this
    rank's destination tensors complete, in plan order. Every rank of the plan must drive its iterator to the end.
    Extra memory per rank: one send plus one receive staging buffer, together at most `bucket_bytes`.

    src_tensors: this rank's local tensors as laid out in the plan's source (DTensors are read locally).
    out: preallocated destination tensors to fill in place (others are allocated when their first bytes land).
    device: where new destination tensors and staging live (default: the device of the source tensors, else CPU;
    a rank that only receives, e.g. a sampler on a GPU, names it). ranks are ranks in `group`; without a process
    group the plan must have no remote moves (one process)."""
    if rank is None:
        rank = dist.get_rank(group)
    # detach: parameters may require grad; the copies here are not part of any graph (out= still aliases them)
    src_tensors = {k: _to_local(v).detach() for k, v in src_tensors.items()}
    out = {k: _to_local(v).detach() for k, v in (out or {}).items()}
    if device is None:
        device = next(iter(src_tensors.values())).device if src_tensors else torch.device("cpu")
    mine = plan.dst_shapes.get(rank, {})
    for name, shape in mine.items():
        if name in out and tuple(out[name].shape) != tuple(shape):
            raise ValueError(f"out[{name!r}] has shape {tuple(out[name].shape)}, the plan needs {shape}")
    for name in {m.name for m in plan.moves if m.src == rank}:
        if name not in src_tensors:
            raise KeyError(f"rank {rank} holds source {name!r} in the plan but was not given it")
    waiting = {name: 0 for name in mine}  # destination elements still to arrive, per tensor
    for m in plan.moves:
        if m.dst == rank:
            waiting[m.name] += numel(m.box)
    done: list[tuple[str, torch.Tensor]] = []

    def dest(name: str) -> torch.Tensor:
        if name not in out:
            out[name] = torch.empty(mine[name], dtype=plan.params[name][2], device=device)
        return out[name]

    def landed(name: str, count: int) -> None:
        waiting[name] -= count
        if waiting[name] == 0:
            done.append((name, dest(name)))

    for name in [n for n, w in waiting.items() if w == 0]:  # empty shards are complete from the start
        done.append((name, dest(name)))
    global_rank = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))

    if bucket_bytes not in plan.cache:  # a plan is reused every step: cut it into rounds once
        plan.cache[bucket_bytes] = rounds(plan, bucket_bytes)
    # reused by every round: faulting in fresh pages costs about as much as the copy itself
    stage = torch.empty(0, dtype=torch.uint8, device=device)
    for moves in plan.cache[bucket_bytes]:
        # One message per move, tagged by its place among this pair's messages in the round (both sides count the
        # same way). A contiguous source view is sent as is and a contiguous destination view of the same dtype
        # receives in place; only the rest go through the staging buffer, packed before and unpacked after.
        ours: list[tuple[Move, int, torch.Tensor, bool]] = []  # (move, tag, this side's view, sent/received as is)
        count: dict[tuple[int, int], int] = defaultdict(int)
        for m in moves:
            if m.src == m.dst or rank not in (m.src, m.dst):
                continue
            tag = count[(m.src, m.dst)]
            count[(m.src, m.dst)] += 1
            if m.src == rank:
                view = _src_view(m, src_tensors)
                ours.append((m, tag, view, view.is_contiguous()))
            else:
                view = _view(m.dst_piece.view(dest(m.name)), m.dst_piece.box, m.box)
                ours.append((m, tag, view, view.is_contiguous() and view.dtype == plan.params[m.name][1]))
        need = sum(_aligned(m.nbytes) for m, _, _, direct in ours if not direct)  # <= bucket_bytes by the rounds
        if need > stage.numel():
            stage = torch.empty(0, dtype=torch.uint8, device=device)  # free the old one first: never two at once
            stage = torch.empty(need, dtype=torch.uint8, device=device)
        ops, unpack, used = [], [], 0
        for m, tag, view, direct in ours:
            if direct:
                payload = view.reshape(-1).view(torch.uint8)
            else:
                payload = stage[used:used + m.nbytes]
                used += _aligned(m.nbytes)
                typed = payload.view(plan.params[m.name][1]).view(extents(m.box))
                if m.src == rank:
                    typed.copy_(view)
                else:
                    unpack.append((view, typed))
            op, peer = (dist.isend, m.dst) if m.src == rank else (dist.irecv, m.src)
            ops.append(dist.P2POp(op, payload, global_rank(peer), group, tag))
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        for view, typed in unpack:
            view.copy_(typed)
        for m in moves:  # local copies, and counting what landed
            if m.dst != rank:
                continue
            if m.src == rank:
                _view(m.dst_piece.view(dest(m.name)), m.dst_piece.box, m.box).copy_(_src_view(m, src_tensors))
            landed(m.name, numel(m.box))
        if done:
            yield done
            done = []
    if done:
        yield done


def reshard(plan: Plan, rank: int | None, src_tensors: Mapping[str, torch.Tensor],
            group: dist.ProcessGroup | None = None, bucket_bytes: int = DEFAULT_BUCKET,
            out: Mapping[str, torch.Tensor] | None = None, device: torch.device | str | None = None,
            ) -> dict[str, torch.Tensor]:
    """Run `plan` and return this rank's destination tensors (name -> tensor); see reshard_iter."""
    result: dict[str, torch.Tensor] = {}
    for batch in reshard_iter(plan, rank, src_tensors, group, bucket_bytes, out, device):
        result.update(batch)
    return result
