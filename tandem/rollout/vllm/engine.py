"""vLLM in this process (`VLLMEngine`): generation, weight and LoRA updates in place, sleep and wake, close."""
from __future__ import annotations

import contextlib
import itertools
import logging
import os
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from tandem.rollout.base import Completion, Sampling
from tandem.rollout.manifest import Digest
from tandem.samples import ModelPrompt, model_prompts
from tandem.util.pixels import decode
from tandem.rollout.vllm.process import (ProcessSnapshot, adopted_tp, import_vllm, keeping_default_group,
                                         release_vllm_globals, remove_segments, shared_memory_segments,
                                         world_initialized)
from tandem.rollout.vllm.sampling import (WORKER_EXTENSION, cpu_custom_ops, engine_only_kwargs, engine_requests,
                                          request_completions, sampling_kwargs)
from tandem.rollout.vllm.weights import Bucket, EngineWeights, SyncStats
from tandem.rollout.vllm.worker import check_adapter, encode_weights, lora_rank_for
from tandem.util.rng import rng_state, set_rng_state

log = logging.getLogger(__name__)

_LIVE_ENGINES = 0  # in-process engines not yet closed


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _optional_kwargs(model_path: str, on_cpu: bool, max_lora_rank: int,
                     mm_processor_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """vLLM's settings only some engines take: the CPU build's custom ops for this model, LoRA's slots, and a
    vision-language model's processor arguments."""
    out: dict[str, Any] = {}
    ops = cpu_custom_ops(model_path) if on_cpu else []
    if ops:
        out["compilation_config"] = {"custom_ops": ops}
    if max_lora_rank:  # two slots: the adapter being replaced and its successor
        out.update(enable_lora=True, max_lora_rank=max_lora_rank, max_loras=2)
    if mm_processor_kwargs:
        out["mm_processor_kwargs"] = dict(mm_processor_kwargs)
    return out


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
                 engine_kwargs: dict[str, Any] | None = None, shm_ident: str | None = None, lora_rank: int = 0,
                 mm_processor_kwargs: dict[str, Any] | None = None) -> None:
        """`shm_ident`: the name every shared-memory segment of a tensor-parallel engine inside an existing
        process group starts with (the same on all its ranks, unique to the run; see `adopted_tp`).
        `lora_rank` > 0: serve LoRA adapters of up to that rank (`load_adapter`); vLLM's max_lora_rank is the
        smallest rank it accepts that holds it (1, 8, 16, 32, ...).
        `mm_processor_kwargs`: what vLLM calls a vision-language model's processor with, the trainer's too
        (`tandem.data.images.image_resize`: data.max_pixels and min_pixels), so both resize an image alike."""
        if sleep_level not in (1, 2):
            raise ValueError(f"sleep_level must be 1 or 2, got {sleep_level}")
        self.updates = EngineWeights(str(model_path), dtype, sync_bucket_mb)
        snap = ProcessSnapshot()
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
        kwargs.update(_optional_kwargs(self.model_path, self.on_cpu, self.max_lora_rank, mm_processor_kwargs))
        # Inside a process group that exists already (colocated workers), vLLM adopts that world and builds its
        # groups over it collectively; closing must then leave the world alone (see `close`).
        self.adopted_world = world_initialized()
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

    def _start(self, vllm: Any, kwargs: dict[str, Any], snap: ProcessSnapshot, external: bool) -> None:
        """Build vLLM's engine, then undo what that changed in this process (`snap`: threads, environment, RNG)."""
        try:
            with adopted_tp(self.shm_ident) if external else contextlib.nullcontext():
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

    def generate(self, prompts: Sequence[ModelPrompt | Sequence[int]], sampling: Sampling) -> list[Completion]:
        """A vision-language model's prompt brings its images (`ModelPrompt.images`). vLLM runs the model's processor
        itself, so it gets each image's file and the prompt with ONE placeholder per image, which it expands; the
        ids it expands them into must be the prompt's (`ModelPrompt.ids`, the processor's at load): a prompt sent
        expanded already would be expanded twice, silently (seen on Qwen2.5-VL, Idefics3, Gemma 3)."""
        from vllm import SamplingParams

        self._check_usable()
        reqs = engine_requests(model_prompts(prompts), sampling)
        for i, prompt, _, _ in reqs:
            if len(prompt.ids) >= self.max_model_len:
                raise ValueError(f"prompt {i} has {len(prompt.ids)} tokens; max_model_len is {self.max_model_len}")
        if not reqs:
            return []
        inputs = [vllm_input(prompt) for _, prompt, _, _ in reqs]
        extra = engine_only_kwargs(sampling)
        params = [SamplingParams(**dict(sampling_kwargs(sampling, n, seed), max_tokens=sampling.limit(i)), **extra)
                  for i, _, n, seed in reqs]
        with self._engine_context():
            outputs = self.llm.generate(inputs, params, use_tqdm=False, lora_request=self.lora_request)
        for (i, prompt, _, _), out in zip(reqs, outputs):
            if prompt.images is not None:
                check_expanded(i, list(out.prompt_token_ids), list(prompt.ids))
        completions = [c for (i, prompt, _, _), out in zip(reqs, outputs)
                       for c in request_completions(out, i, prompt, extra["detokenize"])]
        if not extra["detokenize"]:
            texts = self.tokenizer.batch_decode([c.completion_ids for c in completions], skip_special_tokens=True)
            for c, text in zip(completions, texts):
                c.text = text
        return completions

    # (generate_continuous, the stream's, takes no images: a vision model is refused with placement.schedule: stream)
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
            extra = engine_only_kwargs(sampling)
            rid = f"tandem-turn-{next(made)}"
            engine.add_request(rid, TokensPrompt(prompt_token_ids=ids),
                               SamplingParams(**sampling_kwargs(sampling, 1, seed), **extra),
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
                    (done,) = request_completions(out, key, ModelPrompt(ids), detokenized)
                    if not detokenized:
                        done.text = self.tokenizer.decode(done.completion_ids, skip_special_tokens=True)
                    after = follow(key, done)
                    if after is not None:
                        add(key, *after)

    # ------------------------------------------------------------------------------------------------- weights

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace weights in buckets of at most `sync_bucket_mb`, then drop what the old weights computed: the
        prefix cache (stale KV) and a vision model's cached image encodings (`_reset_caches`).

        Every name and shape is checked first: a bad one raises ValueError and the engine keeps its weights.
        """
        self._check_usable()
        stats = self.updates.load(named_tensors, self._send, self._reset_caches)
        self.last_sync_seconds, self.last_sync_bytes, self.last_sync_buckets = stats

    def _reset_caches(self) -> None:
        """Drop what the old weights computed: the prefix cache's KV, and the images' encodings vLLM keeps (the
        vision tower's outputs, reused for an image seen before: stale once the tower's weights change), in its
        scheduler and its model runner alike."""
        self.llm.reset_prefix_cache()
        self.llm.llm_engine.reset_encoder_cache()

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
        self._reset_caches()
        return max(0, before - self._free_bytes())

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        global _LIVE_ENGINES
        _LIVE_ENGINES -= 1
        snap = ProcessSnapshot()
        segments = self.shared_memory_segments()  # vLLM never unlinks them, even on a clean shutdown
        with keeping_default_group() if self.adopted_world else contextlib.nullcontext():
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
                    release_vllm_globals()
                remove_segments(segments)
                snap.restore(rng=False)

    def shared_memory_segments(self) -> list[str]:
        """The /dev/shm files this engine's process maps: vLLM's message queues and TP segments."""
        return shared_memory_segments(("psm_",) + ((self.shm_ident,) if self.shm_ident else ()))

    def __enter__(self) -> "VLLMEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_expanded(i: int, expanded: list[int], ids: list[int]) -> None:
    """Refuse prompt `i` unless vLLM expanded its image placeholders into the processor's `ids`."""
    if expanded != ids:
        raise RuntimeError(
            f"prompt {i}: vLLM expanded its image placeholders into {len(expanded)} ids, the model's processor into "
            f"{len(ids)}: sampler and trainer would see other prompts (a prompt expanded twice, or vLLM's image "
            "processor resizing otherwise than the trainer's)")


def vllm_input(prompt: ModelPrompt) -> Any:
    """vLLM's input for one prompt: its ids, or with images the ids with one placeholder per image and the images,
    decoded as the trainer's processor is given them (`decode`), so that vLLM sees the trainer's pixels."""
    from vllm.inputs import TokensPrompt

    images = prompt.images
    if images is None:
        return TokensPrompt(prompt_token_ids=list(prompt.ids))
    pictures = [decode(data) for data in images.files]
    return TokensPrompt(prompt_token_ids=list(images.engine_ids), multi_modal_data={"image": pictures})
