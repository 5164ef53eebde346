"""The sampler role: one rollout engine that generates, and takes new weights between generations."""
from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import torch

from tandem.architectures import ModelProfile, lora_targets_for, profile
from tandem.config import Config
from tandem.data.images import image_resize
from tandem.modeling import load_processor, weightless_model
from tandem.rollout import Completion, ModelPrompt, Rollout, Samples, Sampling, make_engine
from tandem.sync.convert import ToCheckpoint
from tandem.workers.group import WorkerContext
from tandem.workers.stream import StreamGroup, StreamReport, StreamSampler


def engine_args(cfg: Config, model_profile: ModelProfile, device: str = "cpu") -> tuple[str, dict]:
    """The engine's name and constructor arguments from the config and the model's profile; `device` is the
    worker's (vLLM picks its own)."""
    m, r = cfg.model, cfg.rollout
    if r.engine == "hf":
        return "hf", dict(model_path=m.path, dtype=m.dtype, seed=cfg.run.seed, trust_remote_code=m.trust_remote_code,
                          device=device)
    v = r.vllm
    kwargs = dict(model_path=m.path, dtype=m.dtype, seed=cfg.run.seed, max_model_len=v.max_model_len or None,
                  kv_cache_bytes=v.kv_cache_mb << 20, gpu_memory_utilization=v.gpu_memory_utilization,
                  sync_bucket_mb=r.sync_bucket_mb, enable_sleep=v.enable_sleep,
                  enable_prefix_caching=v.enable_prefix_caching, tensor_parallel_size=r.tensor_parallel)
    if model_profile.images:  # its images resized as the trainer's processor resizes them (data.max_pixels)
        processor = load_processor(m.path, m.trust_remote_code).image_processor
        kwargs["mm_processor_kwargs"] = image_resize(cfg.data.max_pixels, cfg.data.min_pixels, processor.to_dict())
    if v.mode == "server":
        return "vllm_server", dict(kwargs, base_url=v.base_url or None, python=v.python or sys.executable)
    rows = cfg.batch.prompts_per_step * cfg.batch.group_size
    return "vllm", dict(kwargs, sleep_level=v.sleep_level, max_num_seqs=v.max_num_seqs or rows,
                        max_num_batched_tokens=v.max_num_batched_tokens or None)


def sample_with(cfg: Config, engine) -> Callable[[list[ModelPrompt], Sampling], list[Completion]]:
    """How a worker samples with its engine: one generate call, or with `env.name` whole conversations (each turn
    answered by the environment, its tokens masked; `tandem.rollout.multiturn`, which refuses a prompt with images)."""
    if not cfg.env.name:
        return lambda prompts, sampling: engine.generate(prompts, sampling)
    from tandem.modeling import load_tokenizer
    from tandem.rollout.multiturn import TurnLimits, converse
    from tandem.rollout.tools import make_environment

    tokenizer = load_tokenizer(cfg.model.path, cfg.model.trust_remote_code)  # the trainer's: ids mean the same
    limits = TurnLimits(cfg.env.max_turns, cfg.max_completion_tokens)
    make_env = functools.partial(make_environment, cfg.env.name, **cfg.env.kwargs)
    # a prompt's images: refused with env.name before any model loads (tandem.run.preflight), and by Turns.begin
    return lambda prompts, sampling: converse(engine, tokenizer, prompts, sampling, make_env, limits)


def server_cores(global_rank: int, cores: int) -> str:
    """The cores a vLLM server of this worker binds its threads to: `cores` of this process's allowed CPUs,
    offset by the worker's global rank so that the servers of one host take different cores (VLLM_CPU_OMP_THREADS_BIND
    list syntax)."""
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    start = global_rank * cores
    return ",".join(str(allowed[(start + i) % len(allowed)]) for i in range(min(cores, len(allowed))))


class RolloutWorker:
    """A sampler instance of split placement.

    Weights arrive on a side lane (`receive_weights`, which may run while `generate` works) into a staging copy;
    the next `generate` loads them first. So under asynchronous sampling only that load stops generation.
    """

    def __init__(self, cfg: Config, ctx: WorkerContext | None = None, *, model: ModelProfile | None = None):
        """`model`: the policy's profile, resolved once for the run (`tandem.run.preflight`); a worker built alone
        (a test's) resolves it from the config."""
        self.cfg, self.ctx = cfg, ctx or WorkerContext()
        self.profile = model or profile(cfg.model.path)
        name, kwargs = engine_args(cfg, self.profile, self.ctx.device)
        if name == "vllm_server" and not kwargs.get("base_url"):
            # its output beside the run's (a server that fails says why only there), and cores of its own
            log_path = Path(cfg.run.output_dir) / "vllm-server" / f"{self.ctx.name}-{self.ctx.rank}.log"
            kwargs.update(log_path=str(log_path),
                          cpu_bind=server_cores(self.ctx.global_rank, cfg.placement.cpus_per_worker))
        # LoRA: an in-process vLLM engine serves the adapter itself (from tensors in memory, vLLM's LoRA kernels);
        # other engines get it merged into the base weights of the adapted modules (see set_sync_plan). So does
        # vLLM on CPU for a mixture of experts: its LoRA runs the experts through Triton kernels, which have no CPU
        # backend (seen: "module 'triton.language' has no attribute 'float32'" at the first generate).
        # And adapters on the experts themselves (lora.target_parameters) are always merged: tandem sends them in
        # PEFT's stacked layout, which is not the per-expert one vLLM's LoRA loads.
        moe_on_cpu = self.ctx.device == "cpu" and self.profile.moe
        on_experts = cfg.lora.enabled and bool(lora_targets_for(cfg.lora, self.profile.model_type)[1])
        self._serves_adapters = cfg.lora.enabled and name == "vllm" and not (moe_on_cpu or on_experts)
        if self._serves_adapters:
            kwargs["lora_rank"] = cfg.lora.rank
        self.engine = make_engine(name, **kwargs)
        self.sample = sample_with(cfg, self.engine)
        self.version = 0
        self._staged: tuple[int, list[tuple[str, torch.Tensor]]] | None = None
        self._arrived = threading.Condition()  # guards _staged and _failed; notified when either is set
        self._failed: BaseException | None = None  # why a weight receive failed (the run is over then)
        self._plan = None
        self._adapter = None  # LoRA merged here: the base weights of the adapted modules, and the merge
        self._resharder = None  # runs _plan; made at the first receive and kept, with its setup, for the next
        self._last_end = time.perf_counter()
        self._stream: StreamSampler | None = None  # placement.schedule: stream (its own thread decodes)
        self._stream_error: BaseException | None = None
        self._closing = False

    def generate(self, prompts: list[ModelPrompt], sampling: Sampling, min_version: int = 0) -> Rollout:
        """Generate with policy version `min_version` or newer: the controller may ask before those weights have
        arrived (their send is already on its way), and the wait counts as idle. Loading staged weights first is
        the only stop-the-world part of asynchronous sampling (`load_seconds`)."""
        with self._arrived:
            self._arrived.wait_for(lambda: self._newest() >= min_version or self._failed is not None)
            if self._newest() < min_version:
                raise RuntimeError(f"waited for policy version {min_version}, but receiving weights failed: "
                                   f"{self._failed!r}")
            staged, self._staged = self._staged, None
        with self._stream.lock if self._stream is not None else contextlib.nullcontext():  # a stream's turn waits
            ready = time.perf_counter()
            if staged is not None:
                self._load(staged)
            loaded = time.perf_counter()
            with self._stream.suspended() if self._stream is not None else contextlib.nullcontext():
                comps = self.sample(prompts, sampling)
        idle = ready - self._last_end
        self._last_end = time.perf_counter()
        return Rollout(Samples.of_call(comps, len(prompts)), self.version, self._last_end - loaded, idle,
                       loaded - ready)

    def _load(self, staged: tuple[int, list[tuple[str, torch.Tensor]]]) -> None:
        """Staged weights into the engine (a stream's requests in flight go on under them)."""
        start = time.perf_counter()
        if self._stream is not None:  # none of its requests in the engine while the weights and the prefix cache go
            self._stream.suspend()
        if self._serves_adapters:
            self.engine.load_adapter(dict(staged[1]), self.cfg.lora.alpha, self.cfg.lora.rank)
        else:
            self.engine.load_weights(staged[1])
        self.version = staged[0]
        if self._stream is not None:
            self._stream.weights_changed(self.version, time.perf_counter() - start)

    # ------------------------------------------------------------------------------------ placement.schedule: stream

    def stream_add(self, groups: list[StreamGroup], sampling: Sampling) -> None:
        """More groups to sample; the first call starts the stream's thread."""
        if self._stream is None:
            self._stream = StreamSampler(self.cfg, self.engine)
            threading.Thread(target=self._stream_loop, name="tandem-stream", daemon=True).start()
        self._stream.add(groups, sampling)
        with self._arrived:
            self._arrived.notify_all()

    def stream_take(self, timeout: float) -> StreamReport:
        """The groups finished since the last take, waiting up to `timeout` seconds for one, or for new weights
        (with which the controller may start more groups)."""
        stream = self._stream
        with self._arrived:
            self._arrived.wait_for(lambda: stream.outbox or stream.version != stream.reported_version
                                   or self._stream_error is not None, timeout)
        if self._stream_error is not None:
            raise RuntimeError(f"sampler {self.ctx.global_rank}'s stream stopped: {self._stream_error!r}") \
                from self._stream_error
        return self._stream.take()

    def _stream_loop(self) -> None:
        """Decode step after decode step; staged weights load in between (with in_flight_weights: false, once the
        requests in flight have stopped, none starting meanwhile)."""
        stream, in_flight_weights = self._stream, self.cfg.rollout.in_flight_weights
        try:
            while not self._closing:
                staged = None
                with self._arrived:
                    if self._staged is not None and (in_flight_weights or not stream.running):
                        staged, self._staged = self._staged, None
                    stream.hold(self._staged is not None)
                    if staged is None and not stream.in_flight:
                        self._arrived.wait(0.05)  # nothing to decode: wait for groups or weights
                if staged is not None:
                    with stream.lock:
                        self._load(staged)
                    with self._arrived:  # a generate waiting for this version may go on
                        self._arrived.notify_all()
                if stream.step() and stream.outbox:
                    with self._arrived:
                        self._arrived.notify_all()
        except BaseException as exc:
            with self._arrived:
                self._stream_error = exc
                self._arrived.notify_all()

    def _newest(self) -> int:
        return max(self.version, self._staged[0] if self._staged else -1)

    def set_sync_plan(self, plan) -> None:
        """The trainers' plan; refused here, before any weights move, unless it brings this engine every parameter
        with the engine's shape and dtype (each later load is checked again as it arrives). With LoRA it brings the
        adapter, which this sampler merges into the base weights it keeps of the adapted modules."""
        from tandem.rollout.manifest import check_plan

        planned = {n: (shape, dst) for n, (shape, _, dst) in plan.params.items()}
        expected, aliases = self.engine.manifest(), self.engine.weight_aliases()
        if self.cfg.lora.enabled:
            from tandem.lora_merge import A_SUFFIX
            from tandem.rollout.adapter import adapted_shapes, adapter_manifest

            stems = [n.removesuffix(A_SUFFIX) for n in planned if n.endswith(A_SUFFIX)]
            dtype = next(iter(expected.values()))[1]
            if self._serves_adapters:
                shapes = adapted_shapes(weightless_model(self.cfg.model.path, self.cfg.model.trust_remote_code), stems)
                expected = adapter_manifest(shapes, self.cfg.lora.rank, dtype)
            else:
                self._adapter = merged_adapter(self.cfg, stems, dtype, self.ctx.device, set(expected))
                expected = self._adapter.manifest
            aliases = {}
        check_plan(expected, planned, f"sampler {self.ctx.global_rank}'s engine", aliases)
        self._plan = plan

    def open_weight_channel(self, address: tuple[str, int], size: int) -> None:
        """Join the trainers -> samplers weight channel: this worker is in no torch world (an engine may make its
        own), so weights come over a process group of their own."""
        from tandem.sync.channel import WeightChannel

        self._channel = WeightChannel(address, self.ctx.global_rank, size, self.cfg.placement.sync_timeout_s,
                                      self.ctx.device)

    def receive_weights(self, version: int) -> dict:
        """Take part in the trainers' weight send; stage the received full tensors for the next generate. Runs on
        the actor's side lane, so it receives while a generate works."""
        from tandem.sync.reshard import Resharder

        start = time.perf_counter()
        try:
            self._channel.expect(version)  # the senders may still be training: no transfer timeout until then
            start = time.perf_counter()
            if self._resharder is None:  # a receive-only rank names the device
                self._resharder = Resharder(self._plan, self.ctx.global_rank, device=self.ctx.device,
                                            bucket_bytes=self.cfg.rollout.sync_bucket_mb << 20, channel=self._channel)
            out = self._resharder.run({})
            received = sum(t.numel() * t.element_size() for t in out.values())
            named = self._adapter.merged(out) if self._adapter is not None else list(out.items())
        except BaseException as exc:  # a generate waiting for these weights must not wait forever
            with self._arrived:
                self._failed = exc
                self._arrived.notify_all()
            raise
        with self._arrived:
            self._staged = (version, named)
            self._arrived.notify_all()
        return {"seconds": time.perf_counter() - start, "bytes": received}

    def close(self) -> None:
        self._closing = True
        try:
            if self._stream is not None:
                with self._stream.lock:  # the stream's thread is between steps, and stops at the next
                    self._stream.close()
                    self.engine.close()
            else:
                self.engine.close()
        finally:
            channel = getattr(self, "_channel", None)
            if channel is not None:
                channel.close()


def merged_adapter(cfg: Config, stems: list[str], dtype: torch.dtype, device, engine_names: set[str]):
    """The sampler's merge of the adapter whose wire stems are `stems` into the base weights it reads from the
    checkpoint; stacked experts are assembled from the checkpoint's per-expert tensors, and go out as them when the
    engine loads those (`engine_names`, its manifest, lacks the trainer's stacked names: vLLM)."""
    from tandem.rollout.adapter import MergedAdapter, adapted_shapes

    skeleton = weightless_model(cfg.model.path, cfg.model.trust_remote_code)
    shapes = adapted_shapes(skeleton, stems)
    stacked = {n: torch.empty(s, device="meta") for n, s in shapes.items() if len(s) == 3}
    conversion = ToCheckpoint.of_model(skeleton, stacked.items()) if stacked else None
    return MergedAdapter(cfg.model.path, shapes, cfg.lora.rank, cfg.lora.alpha, dtype, device, conversion,
                         to_checkpoint=not set(stacked) <= engine_names)
