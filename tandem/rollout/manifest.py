"""A weight sync's manifest (names, shapes, dtypes) checked against the engine's, and per-parameter checksums."""
from __future__ import annotations

import difflib
from typing import Iterable, Mapping

import torch

Spec = tuple[tuple[int, ...], torch.dtype]  # a parameter's shape and dtype
Digest = tuple[float, float]  # a parameter's float64 sum and L2 norm: cheap, and moved by any real change


class ManifestError(ValueError):
    """A weight update that does not fit the engine's model; raised before anything is written into it."""


def check_manifest(expected: Mapping[str, Spec], given: Iterable[tuple[str, object]], engine: str,
                   complete: bool, aliases: Mapping[str, str] | None = None) -> None:
    """Refuse, naming every problem at once, an update whose names, shapes or dtypes do not fit `expected`.

    `given` is (name, tensor) pairs; `complete`: the update is a whole sync, so a name it lacks is an error too
    (a partial update may send any subset). `aliases` maps a name the engine also accepts to the one it stands for
    (a tied LM head for its embedding): either may come, not both.
    """
    aliases = aliases or {}
    problems: list[str] = []
    seen: set[str] = set()
    firsts: dict[str, torch.Tensor] = {}  # the first tensor given for each expected name
    for item in given:
        if not (isinstance(item, tuple) and len(item) == 2):
            raise ManifestError(f"load_weights into {engine} expects (name, tensor) pairs, got {type(item).__name__}")
        name, tensor = item
        if not isinstance(tensor, torch.Tensor):
            problems.append(f"{name!r} is a {type(tensor).__name__}, not a torch.Tensor")
            continue
        key = aliases.get(name, name)
        spec = expected.get(key)
        if spec is None:
            close = difflib.get_close_matches(str(name), list(expected), n=3)
            hint = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
            problems.append(f"unknown parameter {name!r}: the engine's model has no such name{hint}")
            continue
        if name in seen:
            problems.append(f"{name!r} given twice")
        elif key in firsts and not torch.equal(firsts[key], tensor):  # the other name of a tied pair came first
            problems.append(f"{name!r} and {key!r} are one tensor in this model (tied), but differ here")
        seen.add(name)
        firsts.setdefault(key, tensor)
        shape, dtype = spec
        if tuple(tensor.shape) != tuple(shape):
            problems.append(f"{name!r} has shape {tuple(tensor.shape)}, expected {tuple(shape)}")
        if not tensor.is_floating_point():
            problems.append(f"{name!r} has dtype {tensor.dtype}, expected a floating-point tensor ({dtype})")
        elif tensor.dtype != dtype:
            problems.append(f"{name!r} has dtype {tensor.dtype}, expected {dtype} (the engine's dtype: a sync "
                            "never converts silently; train and sample in one model.dtype)")
    if complete:
        missing = [n for n in expected if n not in firsts]
        if missing:
            shown = ", ".join(map(repr, missing[:8])) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            problems.append(f"{len(missing)} of the engine's {len(expected)} parameters missing: {shown}")
    if problems:
        raise ManifestError(f"load_weights into {engine}: refused before anything was written (the engine keeps "
                            f"its weights): " + "; ".join(problems))


def check_plan(expected: Mapping[str, Spec], planned: Mapping[str, Spec], engine: str,
               aliases: Mapping[str, str] | None = None) -> None:
    """A streamed sync (bucket by bucket, planned once) must bring the engine every parameter: check the plan's
    names, global shapes and dtypes as one whole sync, before its first bucket is written."""
    check_manifest(expected, [(n, torch.empty(shape, dtype=dtype, device="meta")) for n, (shape, dtype) in
                              planned.items()], engine, complete=True, aliases=aliases)


@torch.no_grad()
def digest(tensor: torch.Tensor) -> Digest:
    """Reductions only, no copy of the tensor (the sum accumulates in float64 inside the kernel)."""
    t = tensor.detach()
    return float(t.sum(dtype=torch.float64)), float(torch.linalg.vector_norm(t))


def differing(reference: Mapping[str, Digest], other: Mapping[str, Digest], rtol: float = 1e-6) -> list[str]:
    """Names whose checksums differ beyond rounding, the largest relative difference first (absent ones too)."""
    scored = []
    for name, (s, n) in reference.items():
        if name not in other:
            scored.append((float("inf"), name))
            continue
        s2, n2 = other[name]
        scale = max(abs(n), abs(n2), 1e-12)
        gap = max(abs(s - s2), abs(n - n2)) / scale
        if gap > rtol:
            scored.append((gap, name))
    return [name for _, name in sorted(scored, key=lambda x: -x[0])]
