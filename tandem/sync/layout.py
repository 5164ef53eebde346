"""Parameter layouts: which boxes (slices) of each global tensor every rank holds, with builders for DP, ZeRO/FSDP,
TP, PP, CP, EP and their compositions, and a reader for live DTensors."""
from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Sequence

import torch

Box = tuple[tuple[int, int], ...]  # per-dimension [start, stop) of a tensor


# ----------------------------------------------------------------------------------------------- box algebra

def full_box(shape: Sequence[int]) -> Box:
    return tuple((0, int(n)) for n in shape)


def extents(box: Box) -> tuple[int, ...]:
    return tuple(b - a for a, b in box)


def numel(box: Box) -> int:
    return math.prod(b - a for a, b in box)


def intersect(a: Box, b: Box) -> Box | None:
    """The common part of two boxes, or None where they do not overlap."""
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return None if any(lo >= hi for lo, hi in out) else out


def contains(outer: Box, inner: Box) -> bool:
    return all(a <= c and d <= b for (a, b), (c, d) in zip(outer, inner))


def subtract(a: Box, b: Box) -> list[Box]:
    """`a` minus `b` as disjoint boxes (at most two per dimension): peel the slabs of `a` outside `b` dim by dim."""
    cut = intersect(a, b)
    if cut is None:
        return [a]
    out, rest = [], list(a)
    for d, ((lo, hi), (clo, chi)) in enumerate(zip(a, cut)):
        if lo < clo:
            out.append(tuple(rest[:d]) + ((lo, clo),) + tuple(rest[d + 1:]))
        if chi < hi:
            out.append(tuple(rest[:d]) + ((chi, hi),) + tuple(rest[d + 1:]))
        rest[d] = (clo, chi)
    return out


def shift(box: Box, origin: Sequence[int]) -> Box:
    """`box` in coordinates relative to `origin`."""
    return tuple((a - o, b - o) for (a, b), o in zip(box, origin))


def slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


def flat_boxes(ext: Sequence[int], lo: int, hi: int) -> list[Box]:
    """The flat (row-major) range [lo, hi) of a tensor with extents `ext` as contiguous boxes in flat order."""
    if lo >= hi:
        return []
    if len(ext) == 1:
        return [((lo, hi),)]
    inner = math.prod(ext[1:])
    rest = full_box(ext[1:])
    out: list[Box] = []
    if lo % inner:  # a partial leading row
        row, end = lo // inner, min(hi, (lo // inner + 1) * inner)
        out += [((row, row + 1),) + b for b in flat_boxes(ext[1:], lo - row * inner, end - row * inner)]
        lo = end
    if lo >= hi:
        return out
    if hi // inner > lo // inner:  # whole rows (lo is at a row start here)
        out.append(((lo // inner, hi // inner),) + rest)
        lo = hi // inner * inner
    if lo < hi:  # a partial trailing row
        row = lo // inner
        out += [((row, row + 1),) + b for b in flat_boxes(ext[1:], 0, hi - lo)]
    return out


def chunk_range(size: int, n: int, i: int) -> tuple[int, int]:
    """Chunk `i` of `n` of a dimension of `size`, as torch.chunk / FSDP2 Shard(0) cut it (uneven, maybe empty)."""
    step = -(-size // n) if size else 0
    start = min(i * step, size)
    return start, min(start + step, size)


# ----------------------------------------------------------------------------------------------- the model

@dataclass(frozen=True)
class Piece:
    """A box of the global tensor stored in a box of a rank's local tensor. The local box has the same extents,
    or is a 1-D range of the same length in a flat (ZeRO) local tensor."""
    box: Box
    local: Box

    def view(self, local_tensor: torch.Tensor) -> torch.Tensor:
        """This piece of `local_tensor`, shaped like its global box (a view: writes go to `local_tensor`)."""
        part = local_tensor[slices(self.local)]
        return part if len(self.local) == len(self.box) else part.view(extents(self.box))


@dataclass(frozen=True)
class Shard:
    """One rank's local tensor of a parameter: its shape and the global boxes it is made of (disjoint)."""
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]


@dataclass
class ParamLayout:
    shape: tuple[int, ...]
    dtype: torch.dtype
    shards: dict[int, Shard] = field(default_factory=dict)  # rank -> its local tensor; absent: holds nothing
    unchanging: bool = False  # the trainer never changes it (a frozen vision tower): a plan sends it once


ModelLayout = dict[str, ParamLayout]


def mark_unchanging(layout: ModelLayout, names: Iterable[str]) -> ModelLayout:
    """`layout` with the parameters `names` marked unchanging (`ParamLayout.unchanging`)."""
    names = set(names)
    return {n: dataclasses.replace(p, unchanging=True) if n in names else p for n, p in layout.items()}


def full_shard(shape: Sequence[int]) -> Shard:
    shape = tuple(int(n) for n in shape)
    box = full_box(shape)
    return Shard(shape, (Piece(box, box),) if numel(box) else ())


def take(shard: Shard, dim: int, ranges: Sequence[tuple[int, int]]) -> Shard:
    """Keep the local ranges `ranges` of dimension `dim`, concatenated in order (a chunk, or one chunk per fused
    part)."""
    pieces: list[Piece] = []
    offset = 0
    for lo, hi in ranges:
        for p in shard.pieces:
            if len(p.local) != len(p.box):
                raise ValueError("cannot split a flat (ZeRO) shard further")
            plo, phi = p.local[dim]
            a, b = max(lo, plo), min(hi, phi)
            if a >= b:
                continue
            g0 = p.box[dim][0] + a - plo
            box = p.box[:dim] + ((g0, g0 + b - a),) + p.box[dim + 1:]
            local = p.local[:dim] + ((offset + a - lo, offset + b - lo),) + p.local[dim + 1:]
            pieces.append(Piece(box, local))
        offset += hi - lo
    shape = shard.shape[:dim] + (offset,) + shard.shape[dim + 1:]
    return Shard(shape, tuple(pieces))


def chunk(shard: Shard, dim: int, n: int, i: int, parts: Sequence[int] | None = None) -> Shard:
    """Chunk `i` of `n` along `dim`; with `parts` (a fused [q;k;v] or [gate;up]) each part is chunked on its own
    and the chunks are concatenated, as a tensor-parallel rank holds them."""
    size = shard.shape[dim]
    parts = list(parts) if parts else [size]
    if sum(parts) != size:
        raise ValueError(f"fused parts {parts} do not add up to {size}")
    ranges, start = [], 0
    for p in parts:
        lo, hi = chunk_range(p, n, i)
        ranges.append((start + lo, start + hi))
        start += p
    return take(shard, dim, ranges)


def _contiguous_parts(box: Box, pieces: Sequence[Piece]) -> list[tuple[Piece, Box]]:
    """A contiguous (row-major) local box cut, in flat order, into contiguous boxes that each lie in one piece:
    cut the first dimension longer than 1 at piece boundaries; a cut owned by no single piece is taken index by
    index, each index a contiguous box of the remaining dimensions."""
    k = next((d for d, (lo, hi) in enumerate(box) if hi - lo > 1), len(box) - 1)
    cuts = sorted({*box[k]} | {x for p in pieces for x in p.local[k] if box[k][0] < x < box[k][1]})
    out: list[tuple[Piece, Box]] = []
    for a, b in zip(cuts, cuts[1:]):
        sub = box[:k] + ((a, b),) + box[k + 1:]
        owner = next((p for p in pieces if contains(p.local, sub)), None)
        if owner is not None:
            out.append((owner, sub))
        elif k == len(box) - 1:
            raise ValueError(f"local box {sub} is covered by no piece")
        else:
            for j in range(a, b):
                out += _contiguous_parts(box[:k] + ((j, j + 1),) + box[k + 1:], pieces)
    return out


def flat_chunk(shard: Shard, n: int, i: int) -> Shard:
    """Chunk `i` of `n` of the flattened local tensor (ZeRO-1/2/3 flat shards): a 1-D local tensor whose pieces are
    the contiguous global boxes that range covers."""
    if any(len(p.local) != len(p.box) for p in shard.pieces):
        raise ValueError("cannot flatten a flat shard again")
    lo, hi = chunk_range(math.prod(shard.shape), n, i)
    pieces: list[Piece] = []
    offset = 0
    for contiguous in flat_boxes(shard.shape, lo, hi):
        for p, sub in _contiguous_parts(contiguous, shard.pieces):
            box = tuple((g0 + a - l0, g0 + b - l0) for (g0, _), (l0, _), (a, b) in zip(p.box, p.local, sub))
            pieces.append(Piece(box, ((offset, offset + numel(sub)),)))
            offset += numel(sub)
    return Shard((hi - lo,), tuple(pieces))


def local_tensor(param: ParamLayout, rank: int, full: torch.Tensor) -> torch.Tensor:
    """The local tensor `rank` holds under `param`, cut from the full tensor (tests, and the single-process path)."""
    shard = param.shards[rank]
    out = torch.empty(shard.shape, dtype=full.dtype)
    for p in shard.pieces:
        p.view(out).copy_(full[slices(p.box)])
    return out


def replicated_layout(shapes_dtypes: Mapping[str, tuple[Sequence[int], torch.dtype]],
                      ranks: Iterable[int]) -> ModelLayout:
    """Every rank in `ranks` holds every parameter whole: the rollout engines' layout (colocated or split)."""
    ranks = list(ranks)
    return {name: ParamLayout(tuple(shape), dtype, {r: full_shard(shape) for r in ranks})
            for name, (shape, dtype) in shapes_dtypes.items()}


# ----------------------------------------------------------------------------------------------- builders

DEFAULT_ORDER = ("pp", "dp", "cp", "ep", "tp")


@dataclass(frozen=True)
class Mesh:
    """Ranks base .. base+size-1 numbered row-major over the named dimensions in `order`, the last varying fastest:
    with the default order (pp, dp, cp, ep, tp) a TP group is adjacent ranks (one node), then EP, CP, DP, and PP
    is outermost (Megatron's convention). Dimensions of size 1 may be left out."""
    sizes: tuple[tuple[str, int], ...]
    base: int = 0

    @classmethod
    def of(cls, base: int = 0, order: Sequence[str] = DEFAULT_ORDER, **sizes: int) -> "Mesh":
        unknown = set(sizes) - set(order)
        if unknown:
            raise ValueError(f"mesh dimensions {sorted(unknown)} are not in the order {tuple(order)}")
        return cls(tuple((d, int(sizes.get(d, 1))) for d in order), base)

    def size(self, dim: str | None = None) -> int:
        if dim is not None:
            return dict(self.sizes).get(dim, 1)
        return math.prod(n for _, n in self.sizes)

    @property
    def ranks(self) -> range:
        return range(self.base, self.base + self.size())

    def coords(self, rank: int) -> dict[str, int]:
        index, out = rank - self.base, {}
        for dim, n in reversed(self.sizes):
            index, out[dim] = divmod(index, n)
        return out


@dataclass(frozen=True)
class Spec:
    """How one parameter is placed on a mesh. tp_dim: 0 column-parallel, 1 row-parallel, None replicated over tp;
    parts: the fused sizes along tp_dim (each split on its own); stage: the pp stage holding it (None: all);
    expert: its expert index, living on ep rank expert // experts_per_rank (None: dense, replicated over ep);
    zero: shard over dp x cp after tp (FSDP2 over tandem's "dp_cp", Megatron's distributed optimizer alike: context
    parallel's ranks hold the same weights), "dim0" (FSDP2 Shard(0)) or "flat" (ZeRO flat buffer); None replicated
    (DP, CP)."""
    tp_dim: int | None = None
    parts: tuple[int, ...] | None = None
    stage: int | None = None
    expert: int | None = None
    experts_per_rank: int = 1
    zero: str | None = None


def build_layout(params: Mapping[str, tuple[Sequence[int], torch.dtype]], mesh: Mesh,
                 spec: Callable[[str], Spec] | Spec = Spec()) -> ModelLayout:
    """The layout of `params` on `mesh`, each placed by `spec` (one Spec for all, or a function of the name)."""
    out: ModelLayout = {}
    for name, (shape, dtype) in params.items():
        s = spec(name) if callable(spec) else spec
        layout = ParamLayout(tuple(shape), dtype)
        for rank in mesh.ranks:
            c = mesh.coords(rank)
            if s.stage is not None and c.get("pp", 0) != s.stage:
                continue
            if s.expert is not None and c.get("ep", 0) != s.expert // s.experts_per_rank:
                continue
            shard = full_shard(shape)
            if s.tp_dim is not None and mesh.size("tp") > 1:
                shard = chunk(shard, s.tp_dim, mesh.size("tp"), c["tp"], s.parts)
            if s.zero and mesh.size("dp") * mesh.size("cp") > 1:  # the dp x cp ranks hold the same weights
                n, i = mesh.size("dp") * mesh.size("cp"), c.get("dp", 0) * mesh.size("cp") + c.get("cp", 0)
                shard = chunk(shard, 0, n, i) if s.zero == "dim0" else flat_chunk(shard, n, i)
            layout.shards[rank] = shard
        out[name] = layout
    return out


# ----------------------------------------------------------------------------------------------- live DTensors

def _runs(index: list[int]) -> list[tuple[int, int, int]]:
    """Runs of consecutive global indices (each one more than the last) in a rank's index list, as (global start,
    global stop, local start): the list is sorted, or a sorted one mapped through a fused weight's row order."""
    runs: list[tuple[int, int, int]] = []
    for pos, g in enumerate(index):
        if runs and runs[-1][1] == g:
            runs[-1] = (runs[-1][0], g + 1, runs[-1][2])
        else:
            runs.append((g, g + 1, pos))
    return runs


def dtensor_shards(shape: Sequence[int], mesh_ranks: torch.Tensor, placements: Sequence,
                   rows: Sequence[int] | None = None) -> dict[int, Shard]:
    """Every mesh rank's local tensor of a DTensor with this global shape, mesh (its tensor of ranks) and
    placements: Shard and _StridedShard cut dimensions as DTensor does (left to right over mesh dims), Replicate
    keeps them; a Partial placement is not a weight layout and is refused.

    rows: the parameter's row (dim 0) held by each row of the DTensor's global tensor, where the two differ (a
    fused weight stored in tensor-parallel block order): each rank's pieces are then boxes of the parameter, a
    contiguous local range splitting into one piece per fused part."""
    from torch.distributed.tensor import Replicate, Shard as DShard
    from torch.distributed.tensor.placement_types import _StridedShard, _StridedShardOffsetMode

    out: dict[int, Shard] = {}
    for coord in itertools.product(*[range(n) for n in mesh_ranks.shape]):
        index = [list(range(n)) for n in shape]  # the global indices this rank holds, per dimension
        for mesh_dim, pl in enumerate(placements):
            if isinstance(pl, Replicate):
                continue
            if isinstance(pl, _StridedShard):
                size, offs = pl._local_shard_size_and_offset(len(index[pl.dim]), mesh_ranks.shape[mesh_dim],
                                                             coord[mesh_dim], _StridedShardOffsetMode.ALL)
                index[pl.dim] = [index[pl.dim][o] for o in (offs or [])][:size]
            elif isinstance(pl, DShard):
                lo, hi = chunk_range(len(index[pl.dim]), mesh_ranks.shape[mesh_dim], coord[mesh_dim])
                index[pl.dim] = index[pl.dim][lo:hi]
            else:
                raise ValueError(f"placement {pl} is not a weight layout")
        if rows is not None:
            index[0] = [int(rows[i]) for i in index[0]]
        per_dim = [_runs(ix) for ix in index]
        pieces = []
        if all(per_dim):
            for runs in itertools.product(*per_dim):
                pieces.append(Piece(tuple((g0, g1) for g0, g1, _ in runs),
                                    tuple((l0, l0 + g1 - g0) for g0, g1, l0 in runs)))
        rank = int(mesh_ranks[tuple(coord)])
        out[rank] = Shard(tuple(len(ix) for ix in index), tuple(pieces))
    return out


def _on_root_mesh(t) -> tuple[torch.Tensor, list]:
    """A DTensor's ranks and placements on the mesh its mesh was sliced from: FSDP2 over a (dp, tp) mesh puts
    parameters TP leaves alone on mesh["dp"] only, which says nothing of the copies on the other tp ranks; on the
    root mesh they are Replicate, so every rank derives the same layout. A flattened dimension of the root (context
    parallel's "dp_cp", named as torch's `_flatten` names one: its dimensions joined by "_") stands for the root's
    dimensions it joins, in their order."""
    from torch.distributed.tensor import Replicate

    mesh = t.device_mesh
    root = mesh._get_root_mesh()
    if root is mesh:
        return mesh.mesh, list(t.placements)
    names, sub = root.mesh_dim_names or (), mesh.mesh_dim_names or ()
    joined = [n.split("_") if n not in names else [n] for n in sub]
    if not sub or any(part not in names for parts in joined for part in parts):
        raise ValueError(f"cannot place sub-mesh {sub} in its root mesh {names}: name the mesh dimensions")
    dims = [[names.index(part) for part in parts] for parts in joined]
    flat = [d for ds in dims for d in ds]
    others = [d for d in range(root.mesh.dim()) if d not in flat]
    shape = [root.mesh.shape[d] for d in others] + [math.prod(root.mesh.shape[d] for d in ds) for ds in dims]
    return root.mesh.permute(others + flat).reshape(shape), [Replicate()] * len(others) + list(t.placements)


def layout_from_dtensors(named: Mapping[str, torch.Tensor],
                         rank_map: Callable[[int], int] | None = None,
                         row_orders: Mapping[str, Sequence[int]] | None = None) -> ModelLayout:
    """The layout of live parameters (FSDP2 `fully_shard`, `parallelize_module`, or plain tensors = replicated on
    every rank of the world) read from their meshes and placements. Ranks are the world's global ranks, or
    `rank_map(global_rank)` (e.g. the rank in the executor's group). `row_orders`: name -> the parameter's row held
    by each row of its DTensor's global tensor, for fused weights stored in block order (`Policy.tp.row_orders`)."""
    from torch.distributed.tensor import DTensor

    remap = rank_map or (lambda r: r)
    out: ModelLayout = {}
    for name, t in named.items():
        if isinstance(t, DTensor):
            shards = dtensor_shards(t.shape, *_on_root_mesh(t), rows=(row_orders or {}).get(name))
        else:
            import torch.distributed as dist
            world = dist.get_world_size() if dist.is_initialized() else 1
            shards = {r: full_shard(t.shape) for r in range(world)}
        out[name] = ParamLayout(tuple(t.shape), t.dtype, {remap(r): s for r, s in shards.items()})
    return out


# ----------------------------------------------------------------------------------------------- engine TP

@dataclass(frozen=True)
class EngineTP:
    """How a vLLM engine over `size` ranks cuts a Llama/Qwen-style decoder's Hugging Face tensors: attention
    heads (and key/value heads, replicated when fewer than ranks), MLP columns, and the vocabulary padded to
    `vocab_padding` then split evenly (vLLM's VocabParallelEmbedding / ParallelLMHead). A head's width is read from
    each tensor's shape: DeepSeek-V3's multi-head latent attention has q/k heads wider than its v heads (o_proj's
    input), and its up-projections (q_b_proj, kv_b_proj) split by heads as q_proj does."""
    size: int
    heads: int
    kv_heads: int
    vocab_padding: int = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE

    def box(self, name: str, shape: Sequence[int], rank: int) -> Box:
        """The global box of `name` that engine TP rank `rank` loads (the whole tensor where vLLM replicates it,
        or for names this rule does not know: correct, at the cost of traffic)."""
        full = full_box(shape)
        leaf = name.rsplit(".", 2)[-2] if "." in name else name
        n, r = self.size, rank
        if n == 1:
            return full
        if leaf in ("q_proj", "q_b_proj", "kv_b_proj"):
            return self._heads(full, 0, shape[0] // self.heads, self.heads, r)
        if leaf in ("k_proj", "v_proj"):
            d = shape[0] // self.kv_heads
            if self.kv_heads >= n:
                return self._heads(full, 0, d, self.kv_heads, r)
            head = r // (n // self.kv_heads)  # each kv head serves n / kv_heads ranks
            return _cut(full, 0, head * d, (head + 1) * d)
        if leaf == "o_proj" and name.endswith(".weight"):
            return self._heads(full, 1, shape[1] // self.heads, self.heads, r)
        if leaf in ("gate_proj", "up_proj"):
            return _cut(full, 0, *chunk_range(shape[0], n, r))
        if leaf == "down_proj" and name.endswith(".weight"):
            return _cut(full, 1, *chunk_range(shape[1], n, r))
        if leaf in ("embed_tokens", "lm_head"):
            pad = self.vocab_padding
            per = -(-shape[0] // pad) * pad // n
            return _cut(full, 0, min(r * per, shape[0]), min((r + 1) * per, shape[0]))
        return full

    def _heads(self, box: Box, dim: int, width: int, heads: int, rank: int) -> Box:
        """Rank `rank`'s heads (each `width` wide) of `heads` along `dim`."""
        return _cut(box, dim, rank * heads // self.size * width, (rank + 1) * heads // self.size * width)


def _cut(box: Box, dim: int, lo: int, hi: int) -> Box:
    return box[:dim] + ((lo, hi),) + box[dim + 1:]


def engine_tp_layout(params: Mapping[str, tuple[Sequence[int], torch.dtype]], groups: Sequence[Sequence[int]],
                     tp: EngineTP) -> ModelLayout:
    """The rollout engines' layout when each of `groups` (ranks in TP order) is one vLLM engine: each rank holds a
    tensor of the full shape in which only its TP box is filled, since vLLM's loaders take Hugging Face tensors
    whole and cut their own shard out of them. The planner then moves only the boxes."""
    out: ModelLayout = {}
    for name, (shape, dtype) in params.items():
        layout = ParamLayout(tuple(shape), dtype)
        for group in groups:
            for tp_rank, rank in enumerate(group):
                box = tp.box(name, shape, tp_rank)
                layout.shards[rank] = Shard(tuple(int(x) for x in shape), (Piece(box, box),) if numel(box) else ())
        out[name] = layout
    return out
