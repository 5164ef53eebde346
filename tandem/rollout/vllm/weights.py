"""A vLLM engine's weight updates, however they travel: checked against its checkpoint, sent in buckets.

`_Checkpoint` holds the names, shapes and fusion groups an update is checked against; `EngineWeights` checks,
packs and sends."""
from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, NamedTuple

import torch

from tandem.modeling import check_model_files, weightless_model
from tandem.rollout.manifest import Digest, ManifestError, check_manifest, digest

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# A checkpoint's per-expert tensor (`model.layers.0.mlp.experts.3.up_proj.weight`, Mixtral's
# `block_sparse_moe.experts.3.w3.weight`): vLLM loads all of a layer's experts into one fused-MoE module (w13 and w2
# over every expert), whose layer-wise reload on CPU rebuilds it only once all of them have arrived.
_EXPERT = re.compile(r"^(.*\.experts)\.\d+\.")


def _persistent_buffers(model_path: str) -> set[str]:
    """The names of the model's buffers that its checkpoint holds (its state_dict beyond its parameters)."""
    model = weightless_model(model_path)
    return set(model.state_dict()) - {n for n, _ in model.named_parameters(remove_duplicate=False)}


class _Checkpoint:
    """Names, shapes and fusion groups of the model's checkpoint tensors: what a weight update is checked against."""

    def __init__(self, model_path: str, dtype: torch.dtype) -> None:
        from safetensors import safe_open

        self.path = model_path
        self.dtype = dtype
        check_model_files(Path(model_path))  # config.json and whole safetensors, each named if not
        self.files = files = sorted(Path(model_path).glob("*.safetensors"))
        self.shapes: dict[str, tuple[int, ...]] = {}
        for f in files:
            with safe_open(str(f), framework="pt") as fh:
                for name in fh.keys():
                    self.shapes[name] = tuple(fh.get_slice(name).get_shape())
        config = json.loads((Path(model_path) / "config.json").read_text())
        text = config.get("text_config", config)
        self.tied = bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
        self.vocab_size = int(text.get("vocab_size", 0))
        self.embed_name = next((n for n in self.shapes if n.endswith("embed_tokens.weight")), None)
        if self.tied and self.embed_name and "lm_head.weight" not in self.shapes:
            # A tied checkpoint omits lm_head, but a trainer's state_dict still lists it.
            self.shapes["lm_head.weight"] = self.shapes[self.embed_name]
        self.groups: dict[str, str] = {name: name.rpartition(".")[0] for name in self.shapes}
        # The checkpoint's tensors the model holds as buffers (DeepSeek-V3's and GLM-4.5's routers' score correction
        # bias): no trainer trains them, so no sync brings them, and the engine keeps the checkpoint's.
        self.buffers = _persistent_buffers(model_path) & set(self.shapes)

    def set_packed(self, packed: dict[str, list[str]]) -> None:
        """Map each checkpoint tensor to the vLLM module it loads into (q/k/v -> qkv_proj, gate/up -> gate_up_proj;
        every expert's tensors of a layer -> that layer's fused-MoE module, which holds all its experts)."""
        part_to_packed = {part: fused for fused, parts in packed.items() for part in parts}
        for name in self.shapes:
            expert = _EXPERT.match(name)
            if expert is not None:
                self.groups[name] = expert.group(1)
                continue
            module = name.rpartition(".")[0]
            parent, _, leaf = module.rpartition(".")
            self.groups[name] = f"{parent}.{part_to_packed[leaf]}" if leaf in part_to_packed else module

    def members(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for name, group in self.groups.items():
            if (self.tied and name == "lm_head.weight") or name in self.buffers:
                continue
            out.setdefault(group, []).append(name)
        return out

    def load(self, names: set[str]) -> dict[str, torch.Tensor]:
        from safetensors import safe_open

        out: dict[str, torch.Tensor] = {}
        for f in self.files:
            with safe_open(str(f), framework="pt") as fh:
                for name in fh.keys():
                    if name in names:
                        out[name] = fh.get_tensor(name).to(self.dtype).contiguous()
        return out

    def manifest(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """What a whole weight sync must bring: each checkpoint tensor's name, shape and the engine's dtype (a
        tied model's head once, as its embedding)."""
        return {n: (s, self.dtype) for n, s in self.shapes.items()
                if not (self.tied and n == "lm_head.weight") and n not in self.buffers}

    def aliases(self) -> dict[str, str]:
        """Names accepted for another one: a tied model's head stands for its embedding."""
        return {"lm_head.weight": self.embed_name} if self.tied and self.embed_name else {}

    def validate(self, named_tensors: Iterable[tuple[str, torch.Tensor]], engine: str = "the vLLM engine",
                 complete: bool = False) -> dict[str, torch.Tensor]:
        """Check every name, shape and dtype before anything reaches the engine (`check_manifest`: all problems
        named at once); returns {checkpoint name: tensor}. `complete`: a whole sync, so missing names count."""
        items = list(named_tensors)
        check_manifest(self.manifest(), items, f"{engine} ({self.path})", complete, self.aliases())
        staged: dict[str, torch.Tensor] = {name: tensor.detach() for name, tensor in items}
        if self.tied and "lm_head.weight" in staged:
            # One tensor in a tied model: lm_head stands for the embedding unless the embedding came too.
            head = staged.pop("lm_head.weight")
            if self.embed_name is not None and self.embed_name not in staged:
                staged[self.embed_name] = head
        return staged

    def digest(self, received: dict[str, Any]) -> dict[str, Digest]:
        """Checksums by checkpoint name of what the engine holds: `received` (what its workers were sent, as
        [sum, norm]), and for a tensor never sent, the checkpoint's own, read from disk only here."""
        out = {name: (float(d[0]), float(d[1])) for name, d in received.items()}
        unsent = set(self.manifest()) - set(out)
        out.update({name: digest(t) for name, t in self.load(unsent).items()})
        return out


def _buckets(items: list[list[tuple[str, torch.Tensor]]], limit: int, dtype: torch.dtype) -> Iterator[list]:
    """Pack groups (lists of tensors that must travel together) into buckets of at most `limit` bytes.

    A single group larger than the limit forms a bucket of its own.
    """
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    item_size = torch.empty((), dtype=dtype).element_size()
    for group in items:
        gsize = sum(t.numel() for _, t in group) * item_size
        if bucket and size + gsize > limit:
            yield bucket
            bucket, size = [], 0
        bucket.extend(group)
        size += gsize
    if bucket:
        yield bucket


Bucket = list[tuple[str, torch.Tensor]]  # tensors that reach the engine in one call


class SyncStats(NamedTuple):
    """One weight update's numbers (metrics): seconds, bytes sent to the engine, buckets."""
    seconds: float
    bytes: int
    buckets: int


class EngineWeights:
    """A vLLM engine's weight updates, however its buckets travel (in-process RPC, or HTTP to a server).

    Every name, shape and dtype is checked against the checkpoint before anything is sent, so a refused update
    leaves the engine's weights as they were; tensors travel in the engine's dtype, in buckets of at most
    `bucket_mb` (the tensors of one vLLM module together where its load path needs that); and the checksums the
    sync guard compares are read here.
    """

    def __init__(self, model_path: str, dtype: str, bucket_mb: int) -> None:
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        self.dtype = _DTYPES[dtype]
        self.checkpoint = _Checkpoint(model_path, self.dtype)  # the model's files checked before vLLM starts
        self.bucket_bytes = int(bucket_mb) << 20
        self.sync_path = "load_weights"
        self._shadow: dict[str, torch.Tensor] = {}
        self._stuck: dict[str, str] = {}  # vLLM module -> why its weights cannot be updated here

    def attach(self, packed: dict[str, list[str]], on_cpu: bool, stuck: dict[str, str] | None = None) -> None:
        """What the started engine says: its fused modules (q/k/v -> qkv_proj, ...), where it runs, and (`stuck`)
        the modules its reload cannot rewrite, with why. On CPU updates go through vLLM's layer-wise reload, which
        rebuilds whole modules: tensors of a fused module that an update leaves out are resent from a copy of what
        the engine holds (modules of several tensors only)."""
        self.checkpoint.set_packed(packed)
        self.sync_path = "reload" if on_cpu else "load_weights"
        self._stuck = dict(stuck or {}) if on_cpu else {}
        if on_cpu:
            # Not the experts: they are most of an MoE's bytes, and a copy of them here would be one more full copy
            # per sync; an update brings a layer's experts whole or not at all (_groups refuses the rest).
            multi = {n for names in self.checkpoint.members().values() if len(names) > 1 for n in names
                     if not _EXPERT.match(n)}
            self._shadow = self.checkpoint.load(multi)

    def load(self, named_tensors: Iterable[tuple[str, torch.Tensor]], send: Callable[[Bucket], None],
             reset_prefix_cache: Callable[[], None]) -> SyncStats:
        """Check, then `send` each bucket of (name, tensor); then `reset_prefix_cache` (its KV is stale) if any
        bucket went. A bad name, shape or dtype raises before the first bucket."""
        t0 = time.perf_counter()
        staged = self.checkpoint.validate(named_tensors)
        sent = buckets = 0
        for bucket in _buckets(self._groups(staged), self.bucket_bytes, self.dtype):
            converted = [(n, t.to(self.dtype).contiguous()) for n, t in bucket]
            send(converted)
            for n, t in converted:
                if n in self._shadow:
                    self._shadow[n].copy_(t.to(self._shadow[n].device))
            sent += sum(t.numel() * t.element_size() for _, t in converted)
            buckets += 1
        if buckets:
            reset_prefix_cache()
        return SyncStats(time.perf_counter() - t0, sent, buckets)

    def _groups(self, staged: dict[str, torch.Tensor]) -> list[Bucket]:
        """Tensors that must reach the engine in one call, in checkpoint order."""
        if self.sync_path != "reload":
            return [[(n, t)] for n, t in staged.items()]
        out = []
        for group, names in self.checkpoint.members().items():
            if any(n in staged for n in names) and group in self._stuck:
                raise ManifestError(f"load_weights into the vLLM engine ({self.checkpoint.path}): refused before "
                                    f"anything was written (the engine keeps its weights): {group}: "
                                    f"{self._stuck[group]}; use rollout.engine: hf for this model")
            if any(n in staged for n in names):
                lacking = [n for n in names if n not in staged and n not in self._shadow]
                if lacking:
                    raise ManifestError(
                        f"load_weights into the vLLM engine ({self.checkpoint.path}): refused before anything was "
                        f"written (the engine keeps its weights): {group} is one module in vLLM, rebuilt whole on CPU, "
                        f"and this update brings {len(names) - len(lacking)} of its {len(names)} tensors (missing: "
                        f"{', '.join(map(repr, lacking[:4]))}{' ...' if len(lacking) > 4 else ''}); send all of them")
                out.append([(n, staged[n] if n in staged else self._shadow[n]) for n in names])
        return out

    def close(self) -> None:
        self._shadow.clear()
