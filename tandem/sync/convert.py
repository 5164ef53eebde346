"""The trainer's weights under the checkpoint's names and shapes (what vLLM loads): transformers 5's fused experts
cut into the checkpoint's per-expert tensors as views, read from transformers' own conversion mapping."""
from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable, Iterator, Mapping, Sequence

import torch

from tandem.sync.layout import (Box, ModelLayout, ParamLayout, Piece, Shard, chunk_range, full_box, intersect, shift,
                                slices)


class ConversionError(ValueError):
    """The trainer's tensors cannot be given to the engine under the checkpoint's names: a conversion that is not
    transformers' own (an expert or part out of order, dropped, mis-shaped), or one tandem cannot take as views.
    Raised before any weight moves."""


@dataclass(frozen=True)
class Cut:
    """One checkpoint tensor as the box `box` of the trainer's tensor `source`, less the source dimensions in `drop`
    (an expert's index, extent 1): `model.layers.0.mlp.experts.2.up_proj.weight` is
    `model.layers.0.mlp.experts.gate_up_proj[2, I:2I, :]`."""
    source: str
    box: Box
    drop: tuple[int, ...] = ()

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(b - a for d, (a, b) in enumerate(self.box) if d not in self.drop)

    def view(self, tensor: torch.Tensor) -> torch.Tensor:
        """This cut of the full source tensor: a view, no copy (basic slicing, then the expert dimension dropped)."""
        out = tensor[slices(self.box)]
        for d in sorted(self.drop, reverse=True):
            out = out.squeeze(d)
        return out


def _base(model):
    """The transformers model itself, a PEFT model's base: what it converts is named as the base's weights are
    (`tandem.train.lora.merged_weights` gives them so)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _transforms(model) -> list:
    """The weight transforms transformers applied when it loaded `model` from its checkpoint: those
    `revert_weight_conversion` reverses when it saves (the ones it would apply, for a model built another way)."""
    used = getattr(model, "_weight_conversions", None)
    if used is not None:
        return list(used)
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange

    return [t for t in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(t, PrefixChange)]


def _saved(model, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """What transformers' `save_pretrained` writes for the trainer's tensor `name`: its checkpoint tensors, by name."""
    from transformers.core_model_loading import revert_weight_conversion

    return dict(revert_weight_conversion(model, {name: tensor}))


def _unfused(ops: Sequence, shape: Sequence[int], part: int, parts: int, expert: int | None,
             where: str) -> tuple[Box, tuple[int, ...]]:
    """The box of the fused tensor (of `shape`) that transformers' load-time `ops` filled from source pattern `part`
    of `parts`, expert `expert`, and the dimensions the checkpoint tensor lacks: each op undone, the last first.
    MergeModulelist(d) stacked the experts along d (the box takes index `expert` there and drops d); Concatenate(d)
    joined the patterns' tensors along d, which transformers' reverse (Chunk) cuts as torch.chunk does."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    box, dims, drop, cut = list(full_box(shape)), list(range(len(shape))), [], False
    for op in reversed(list(ops)):
        if isinstance(op, Concatenate) and getattr(op, "num_shards_attribute", None) is None:
            d = dims[op.dim]
            box[d], cut = chunk_range(shape[d], parts, part), True
        elif isinstance(op, MergeModulelist) and expert is not None:
            d = dims.pop(op.dim)
            box[d] = (expert, expert + 1)
            drop.append(d)
        else:
            raise ConversionError(f"{where}: transformers converts it with {type(op).__name__}, which tandem cannot "
                                  "take apart as views of the trainer's tensor; use rollout.engine: hf")
    if parts > 1 and not cut:
        raise ConversionError(f"{where}: {parts} checkpoint patterns fill it, but no Concatenate says where each "
                              "goes; use rollout.engine: hf")
    return tuple(box), tuple(sorted(drop))


def _cut_for(model, name: str, shape: tuple[int, ...], saved: dict[str, torch.Tensor]) -> dict[str, Cut]:
    """The cut of trainer tensor `name` that each checkpoint tensor transformers saves from it takes, found from the
    saved name itself (the converter's source pattern it matches gives the part, its `*` the expert), never from the
    order transformers happens to emit them in."""
    from transformers.core_model_loading import WeightConverter

    if len(saved) == 1 and tuple(next(iter(saved.values())).shape) == shape:
        return {next(iter(saved)): Cut(name, full_box(shape))}  # a renaming only (Mixtral's block_sparse_moe)
    out: dict[str, Cut] = {}
    for ckpt in saved:
        found = [(c, j, m) for c in _transforms(model) if isinstance(c, WeightConverter)
                 for j, p in enumerate(c.source_patterns)
                 if (m := re.search(re.escape(p).replace(r"\*", r"(\d+)"), ckpt)) is not None]
        if len(found) != 1:
            raise ConversionError(f"{ckpt!r} (saved from {name!r}) matches {len(found)} of transformers' converter "
                                  "patterns, not one: tandem cannot tell which part of the fused tensor it is")
        conv, part, match = found[0]
        expert = int(match.group(1)) if match.groups() else None
        box, drop = _unfused(conv.operations, shape, part, len(conv.source_patterns), expert, repr(name))
        out[ckpt] = Cut(name, box, drop)
    return out


class ToCheckpoint:
    """The trainer's tensors as the checkpoint has them: each checkpoint tensor a cut (a view) of one trainer tensor.
    Trainer tensors no cut comes from pass through under their own names (a dense model, a LoRA adapter).

    Built from transformers' own conversion mapping (`revert_weight_conversion`, what `save_pretrained` runs), and
    checked against it when made: each cut must have the name and shape transformers saves, and hold the elements
    transformers would save under that name (its reverse run on a probe tensor of the same expert and part counts),
    so a dropped, mis-ordered or mis-shaped expert is refused here, naming it, before any sync."""

    def __init__(self, cuts: Mapping[str, Cut] | None = None, sources: Mapping[str, tuple[int, ...]] | None = None,
                 model=None) -> None:
        """`cuts`: checkpoint name -> its cut; `sources`: each cut source's shape; `model`: the transformers model
        they are checked against (required with cuts)."""
        self.cuts, self.source_shapes = dict(cuts or {}), {n: tuple(s) for n, s in (sources or {}).items()}
        self.by_source: dict[str, list[tuple[str, Cut]]] = defaultdict(list)
        for ckpt, cut in self.cuts.items():
            self.by_source[cut.source].append((ckpt, cut))
        if self.cuts:
            if model is None:
                raise ValueError("ToCheckpoint: cuts are checked against the transformers model they come from")
            _check(_base(model), self.by_source, self.source_shapes)

    @classmethod
    def of_model(cls, model, named: Iterable[tuple[str, torch.Tensor]]) -> "ToCheckpoint":
        """The conversion of `model`'s weights `named` (names and global shapes are read; a PEFT model's base is
        used), or the identity where transformers converts none of them."""
        model = _base(model)
        if not _transforms(model):  # before reading `named`: with LoRA that merges every adapted weight
            return cls()
        shapes = {n: tuple(t.shape) for n, t in named}
        cuts: dict[str, Cut] = {}
        for name, shape in shapes.items():
            saved = _saved(model, name, torch.empty(shape, device="meta"))
            if saved.keys() != {name}:
                cuts.update(_cut_for(model, name, shape, saved))
        return cls(cuts, {c.source: shapes[c.source] for c in cuts.values()}, model)

    def _source_shape(self, name: str, shape: Sequence[int]) -> None:
        if tuple(shape) != self.source_shapes[name]:
            raise ConversionError(f"{name!r} has shape {tuple(shape)}; its cuts into the checkpoint's tensors were "
                                  f"made for {self.source_shapes[name]}: the trainer's model is not the one the sync "
                                  "was planned for")

    def views(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """(checkpoint name, tensor) of full tensors: each cut a view of the trainer's tensor (one process)."""
        for name, t in named:
            cuts = self.by_source.get(name)
            if cuts is None:
                yield name, t
                continue
            self._source_shape(name, t.shape)
            for ckpt, cut in cuts:
                yield ckpt, cut.view(t)

    def sources_of(self, named: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The executor's source tensors of a layout made by `layout`: each checkpoint name -> the trainer's (local,
        maybe DTensor) tensor its pieces lie in."""
        out: dict[str, torch.Tensor] = {}
        for name, t in named.items():
            cuts = self.by_source.get(name)
            out.update({ckpt: t for ckpt, _ in cuts} if cuts is not None else {name: t})
        return out

    def layout(self, src: ModelLayout) -> ModelLayout:
        """`src` (the trainer's layout, by its names) by the checkpoint's names and shapes: each cut's pieces are the
        parts of the trainer's pieces inside it, still lying in the trainer's local tensors (read through
        `sources_of`), so the planner and the manifest check see the engine's tensors and no fused copy is made."""
        out: ModelLayout = {}
        for name, param in src.items():
            cuts = self.by_source.get(name)
            if cuts is None:
                out[name] = param
                continue
            self._source_shape(name, param.shape)
            for ckpt, cut in cuts:
                out[ckpt] = ParamLayout(cut.shape, param.dtype, {r: _cut_shard(s, cut, name)
                                                                 for r, s in param.shards.items()}, param.unchanging)
        return out


def _cut_shard(shard: Shard, cut: Cut, name: str) -> Shard:
    """The pieces of `shard` inside `cut`, in the checkpoint tensor's coordinates. A piece keeps its local box in
    the trainer's local tensor, the expert's dimension included: the executor reads it by reshaping, as it reads a
    flat (ZeRO) piece."""
    origin = [a for a, _ in cut.box]
    pieces = []
    for p in shard.pieces:
        if len(p.local) != len(p.box):
            raise ConversionError(f"{name!r}: cannot cut an expert out of a flat (ZeRO) shard")
        part = intersect(p.box, cut.box)
        if part is None:
            continue
        local = tuple((l0 + a - g0, l0 + b - g0) for (a, b), (g0, _), (l0, _) in zip(part, p.box, p.local))
        box = tuple(r for d, r in enumerate(shift(part, origin)) if d not in cut.drop)
        pieces.append(Piece(box, local))
    return Shard(shard.shape, tuple(pieces))


def _probe_box(values: torch.Tensor, shape: Sequence[int]) -> Box:
    """The box of a probe of `shape` (element i holds i) that `values` were taken from."""
    lo, hi = int(values.min()), int(values.max())
    corners = [torch.unravel_index(torch.tensor(v), tuple(shape)) for v in (lo, hi)]
    box = tuple((int(a), int(b) + 1) for a, b in zip(*corners))
    if torch.Size([b - a for a, b in box]).numel() != values.numel():
        raise ConversionError("transformers' reverse of a probe did not give a box of it")
    return box


def _check(model, by_source: Mapping[str, list[tuple[str, Cut]]], shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Every trainer tensor's cuts against what transformers saves from it: the same names and shapes (meta tensors,
    no memory), and the same elements (transformers' reverse run on a probe whose cut dimensions are the real ones and
    whose others have extent 1, a few bytes). All problems are named at once."""
    problems: list[str] = []
    for source, cuts in by_source.items():
        shape = shapes[source]
        saved = _saved(model, source, torch.empty(shape, device="meta"))
        mine = dict(cuts)
        problems += [f"{n!r} (transformers saves it from {source!r}) is not among the tensors sent" for n in saved
                     if n not in mine]
        problems += [f"{n!r} is not a tensor transformers saves from {source!r}" for n in mine if n not in saved]
        problems += [f"{n!r} is cut with shape {c.shape} from {source!r}; transformers saves it with shape "
                     f"{tuple(saved[n].shape)}" for n, c in mine.items()
                     if n in saved and c.shape != tuple(saved[n].shape)]
        wide = {d for _, c in cuts for d, (a, b) in enumerate(c.box) if (a, b) != (0, shape[d])}
        probe_shape = tuple(n if d in wide else 1 for d, n in enumerate(shape))
        probe = torch.arange(torch.Size(probe_shape).numel(), dtype=torch.float64).view(probe_shape)
        try:
            probed = _saved(model, source, probe)
        except Exception as exc:  # a cut along a dimension transformers does not cut: named, with the rest
            problems.append(f"{source!r}: transformers' reverse of a probe cut like this failed ({exc})")
            continue
        for n, values in probed.items():
            if n not in mine:
                continue
            want = tuple(r if d in wide else (0, shape[d]) for d, r in enumerate(_probe_box(values, probe_shape)))
            if mine[n].box != want:
                problems.append(f"{n!r} is cut from {source!r} at {mine[n].box}, but transformers saves {source}"
                                f"{list(want)} under that name: an expert or a part out of order")
    if problems:
        raise ConversionError(f"the trainer's tensors cut into the checkpoint's ({len(problems)} problem(s)), refused "
                              "before any weight moved: " + "; ".join(problems))
