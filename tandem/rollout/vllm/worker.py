"""Methods injected into every vLLM worker (`worker_extension_cls`): weight loading and the logprob convention."""
from __future__ import annotations

import base64
import logging
import re
import threading
from contextlib import contextmanager
from typing import Any, Iterable, Iterator

import torch

from tandem.rollout.manifest import digest

log = logging.getLogger(__name__)

# What vLLM 0.32's layer-wise reload warns about a module or weight that the call did not bring, by its logger's name
# and the record's format string. tandem sends a sync in buckets, each one reload_weights call, so every module outside
# a bucket draws one of these each time (thousands a sync on a 30-layer model) though nothing failed: whether the
# whole sync brought every tensor is checked before the first bucket (`tandem.rollout.manifest`), and what the
# workers received is checksummed for the sync guard.
_RELOAD_FALSE_ALARMS = {
    "vllm.model_executor.model_loader.reload.layerwise": "%s: Failed to load weights",
    "vllm.model_executor.model_loader.reload.inplace": "Following weights were not loaded from checkpoint: %s",
}


class _DropFalseAlarms(logging.Filter):
    """Drops the reload's false alarms logged by one thread (the one reloading); counts them."""

    def __init__(self, message: str) -> None:
        super().__init__()
        self.message, self.thread, self.dropped = message, threading.get_ident(), 0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == self.message and record.thread == self.thread:
            self.dropped += 1
            return False
        return True


@contextmanager
def quiet_reload() -> Iterator[None]:
    """Silence `_RELOAD_FALSE_ALARMS` for this call only, on their own loggers (vLLM's other warnings, and these
    from any other caller or thread, still show); how many were dropped goes to the debug log."""
    filters = [(logging.getLogger(name), _DropFalseAlarms(message)) for name, message in _RELOAD_FALSE_ALARMS.items()]
    for logger, f in filters:
        logger.addFilter(f)
    try:
        yield
    finally:
        for logger, f in filters:
            logger.removeFilter(f)
        dropped = sum(f.dropped for _, f in filters)
        if dropped:
            log.debug("vLLM's reload: %d warnings about modules this bucket does not bring dropped", dropped)

# Checkpoint tensors a vLLM model's own loader copies into its parameters itself, past the weight loaders that vLLM's
# layer-wise reload defers (vLLM 0.32's GptOssModel._load_weights_other: the attention sinks, the experts and their
# biases); the reload holds those parameters on the meta device while it loads, so the copies are lost and the engine
# keeps its old values. They are loaded again in place after the reload (tandem_load_weights), by model class.
_COPIED_PAST_THE_LOADERS = {
    "GptOssForCausalLM": re.compile(r"\.(self_attn\.sinks|mlp\.experts\.(gate_up_proj|down_proj)(_bias)?)$"),
}


# What crosses a process boundary (server mode, tensor parallelism) is a safetensors blob: plain bytes pickle
# cheaply through vLLM's RPC and survive JSON as base64, where tensors would not.
def encode_weights(named: Iterable[tuple[str, torch.Tensor]]) -> bytes:
    """Serialize named tensors to a safetensors blob (on CPU)."""
    from safetensors.torch import save

    return save({name: t.detach().to("cpu").contiguous() for name, t in named})


def decode_weights(payload: Any) -> list[tuple[str, torch.Tensor]]:
    """Inverse of encode_weights; also accepts base64 text (the HTTP RPC passes only strings) or tensors as is."""
    if isinstance(payload, str):
        payload = base64.b64decode(payload)
    if isinstance(payload, (bytes, bytearray)):
        from safetensors.torch import load

        return list(load(bytes(payload)).items())
    return list(payload)


# LoRA ranks vLLM accepts for max_lora_rank (vllm.config.lora.MaxLoRARanks in vLLM 0.32), read from vLLM if it has it.
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def lora_rank_for(rank: int) -> int:
    """The smallest max_lora_rank vLLM accepts that holds adapters of `rank`."""
    try:
        import typing

        from vllm.config.lora import MaxLoRARanks

        ranks = tuple(sorted(typing.get_args(MaxLoRARanks))) or LORA_RANKS
    except ImportError:
        ranks = LORA_RANKS
    fits = [r for r in ranks if r >= rank]
    if rank < 1 or not fits:
        raise ValueError(f"lora_rank must be in 1..{ranks[-1]} (vLLM's max_lora_rank is one of {ranks}), got {rank}")
    return fits[0]


def check_adapter(shapes: dict[str, tuple[int, ...]], tensors: Any, rank: int) -> dict[str, torch.Tensor]:
    """Check a LoRA adapter against the checkpoint's `shapes`; returns its tensors as fresh contiguous copies
    (vLLM scales lora_B in place when it packs an adapter).

    Names are the Hugging Face module's plus PEFT's suffix, without PEFT's prefix or adapter name:
    `model.layers.0.self_attn.q_proj.lora_A.weight` [rank, in], `...lora_B.weight` [out, rank]; any 2-D linear
    weight of the decoder layers may carry one (not the embedding or the head). Every problem is named at once.
    """
    linear = {n[: -len(".weight")]: s for n, s in shapes.items() if n.endswith(".weight") and len(s) == 2
              and not n.endswith(("embed_tokens.weight", "lm_head.weight"))}
    items = dict(tensors)
    problems: list[str] = []
    halves: dict[str, set[str]] = {}
    for name, t in items.items():
        module, _, suffix = name.rpartition(".lora_")
        if module not in linear or suffix not in ("A.weight", "B.weight"):
            problems.append(f"{name!r}: not <linear module>.lora_A.weight / .lora_B.weight of this model")
            continue
        out, inp = linear[module]
        want = (rank, inp) if suffix == "A.weight" else (out, rank)
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or tuple(t.shape) != want:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            problems.append(f"{name!r}: expected a float tensor of shape {want} (rank {rank}), got {got}")
        halves.setdefault(module, set()).add(suffix[0])
    problems += [f"{m}.lora_{'B' if h == {'A'} else 'A'}.weight: missing (its other half is given)"
                 for m, h in halves.items() if len(h) == 1]
    if not items:
        problems.append("the adapter has no tensors")
    if problems:
        raise ValueError(f"LoRA adapter refused ({len(problems)} problem(s)): " + "; ".join(problems))
    return {name: t.detach().to("cpu").clone().contiguous() for name, t in items.items()}


class TandemWorkerExtension:
    """Mixed into vLLM's Worker class; names are prefixed `tandem_` so they cannot collide with the worker's own."""

    def tandem_load_weights(self, payload: Any, path: str = "reload") -> int:
        """Load checkpoint-format tensors into the running model; returns the number of bytes loaded.

        `reload`: vLLM's layerwise in-place reload, which re-runs weight post-processing (the CPU backend repacks
        linear layers for its kernels, so writing into the original parameters would be lost). Every vLLM module
        touched must receive all of its checkpoint tensors in one call (the engine guarantees it).
        `load_weights`: the model's own loader, which writes shards of fused layers in place (GPU).
        """
        weights = decode_weights(payload)
        nbytes = sum(t.numel() * t.element_size() for _, t in weights)
        # What reached this worker, to compare with what the trainer holds when samples disagree with it.
        received = self.__dict__.setdefault("_tandem_received", {})
        for name, t in weights:
            received[name] = digest(t)
        if path == "reload":
            with quiet_reload():
                self.reload_weights(weights_iterator=iter(weights))  # type: ignore[attr-defined]
            self._tandem_refresh_shared({name for name, _ in weights})
            self._tandem_repack_experts(dict(weights))
            self._tandem_load_copied(weights)
        elif path == "load_weights":
            from vllm.config import set_current_vllm_config

            with set_current_vllm_config(self.vllm_config), torch.no_grad():  # type: ignore[attr-defined]
                self.model_runner.get_model().load_weights(iter(weights))  # type: ignore[attr-defined]
        else:
            raise ValueError(f"unknown weight load path {path!r}; use 'reload' or 'load_weights'")
        return nbytes

    def _tandem_load_copied(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Load in place the tensors the reload lost (`_COPIED_PAST_THE_LOADERS`), then prepare each fused-MoE module
        whose experts came raw for its kernel again (on CPU: `cpu_prepack_moe_weight`), as its first load did."""
        from vllm.config import set_current_vllm_config

        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        pattern = _COPIED_PAST_THE_LOADERS.get(type(model).__name__)
        copied = [(n, t) for n, t in weights if pattern is not None and pattern.search(n)]
        if not copied:
            return
        with set_current_vllm_config(self.vllm_config), torch.no_grad():  # type: ignore[attr-defined]
            model.load_weights(iter(copied))
        # the loader writes a module's experts whole (the engine sends a module's tensors together)
        raw = {n.removesuffix(".gate_up_proj") for n, _ in copied if n.endswith(".mlp.experts.gate_up_proj")}
        for module in model.modules():
            experts = getattr(getattr(getattr(module, "quant_method", None), "moe_kernel", None), "fused_experts", None)
            prepare = getattr(experts, "process_weights_after_loading", None)
            if prepare is not None and getattr(module, "layer_name", None) in raw:
                prepare(module)

    def _tandem_refresh_shared(self, names: set[str]) -> None:
        """Re-run weight post-processing on modules that share a reloaded weight (a tied lm_head).

        The reload re-processes only the module it loaded (the embedding); on CPU a tied lm_head keeps a packed
        copy of the old weight for its GEMM kernel, and would keep computing logits with it.
        """
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        owners: dict[int, list[tuple[str, torch.nn.Module]]] = {}
        for qual, module in model.named_modules():
            weight = module._parameters.get("weight")
            if weight is not None:
                owners.setdefault(id(weight), []).append((qual, module))
        loaded_modules = {n.rpartition(".")[0] for n in names}
        for sharers in owners.values():
            if len(sharers) < 2 or not any(q in loaded_modules for q, _ in sharers):
                continue
            for qual, module in sharers:
                method = getattr(module, "quant_method", None)
                if qual not in loaded_modules and hasattr(method, "process_weights_after_loading"):
                    method.process_weights_after_loading(module)

    def _tandem_repack_experts(self, weights: dict[str, torch.Tensor]) -> None:
        """Re-run the MoE kernel's own weight preparation on each fused-MoE module the reload left raw.

        vLLM 0.32's `UnquantizedFusedMoEMethod._setup_kernel` runs the experts' `process_weights_after_loading`
        (on CPU: `cpu_prepack_moe_weight` of w13 and w2, into its grouped-GEMM layout) only when the kernel is first
        built, not on a weight update, so after a layer-wise reload the CPU kernel reads raw weights as prepacked
        ones (seen: logprobs off by 1e-2 with every byte right). A module whose w2 still equals the raw tensor just
        sent for expert 0 (in a tensor-parallel engine: this rank's columns of it) was not prepared; a vLLM that
        prepares it on update is left alone.
        """
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        rank, ranks = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        for module in model.modules():
            experts = getattr(getattr(getattr(module, "quant_method", None), "moe_kernel", None), "fused_experts", None)
            prepare = getattr(experts, "process_weights_after_loading", None)
            prepare = prepare if hasattr(module, "get_expert_mapping") else None
            name = next((f"{module.layer_name}.{w.removeprefix('experts.')}weight" for _, w, e, shard in
                         module.get_expert_mapping() if e == 0 and shard == "w2"), None) if prepare else None
            raw = weights.get(name) if name else None
            if raw is None:
                continue
            width = module.w2_weight.shape[-1]  # the experts' intermediate size on this rank
            if raw.shape[-1] == width * ranks:  # whole: tandem sends the checkpoint's shape to every rank
                raw = raw[..., rank * width:(rank + 1) * width]
            if raw.shape == module.w2_weight.shape[1:] and torch.equal(module.w2_weight[0], raw):
                prepare(module)

    def tandem_add_lora(self, lora_id: int, payload: Any, alpha: float, rank: int) -> list[int]:
        """Register a LoRA adapter given as tensors (never files) under `lora_id` and drop every other one; a
        request with `LoRARequest(lora_int_id=lora_id)` is then served with it. Returns the ids registered.

        vLLM's own loader reads a PEFT folder; this builds the same `LoRAModel` from the tensors and puts it in
        the worker's LoRA cache, where the next step's request finds it (so its path is never read).
        """
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        manager = self.model_runner.lora_manager  # type: ignore[attr-defined]
        tensors = dict(decode_weights(payload))
        targets = sorted({name.rpartition(".lora_")[0].rpartition(".")[2] for name in tensors})
        helper = PEFTHelper.from_dict({"r": int(rank), "lora_alpha": float(alpha), "target_modules": targets})
        helper.validate_legal(manager.lora_config)
        model = manager._adapter_manager.model
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        lora = LoRAModel.from_lora_tensors(
            lora_id, tensors, helper, device="cpu", dtype=manager.lora_config.lora_dtype,
            model_vocab_size=manager.vocab_size, weights_mapper=mapper.get_rename_mapper() if mapper else None,
            skip_prefixes=getattr(model, "lora_skip_prefixes", None))
        for old in manager.list_adapters():
            manager.remove_adapter(old)
        manager._adapter_manager.add_adapter(lora)
        return sorted(manager.list_adapters())

    def tandem_weight_digest(self) -> dict[str, list[float]]:
        """[float64 sum, L2 norm] of each checkpoint tensor this worker was given since it started (plain lists:
        the HTTP RPC carries JSON)."""
        return {name: list(d) for name, d in self.__dict__.get("_tandem_received", {}).items()}

    def tandem_packed_modules(self) -> dict[str, list[str]]:
        """vLLM's fused modules and the checkpoint modules each one packs, e.g. qkv_proj: [q_proj, k_proj, v_proj]."""
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        return {k: list(v) for k, v in dict(getattr(model, "packed_modules_mapping", {}) or {}).items()}

    def tandem_unreloadable_experts(self) -> dict[str, str]:
        """Fused-MoE modules (by their checkpoint prefix, `model.layers.0.mlp.experts`) whose weights vLLM's
        layer-wise reload cannot rewrite here, each with why: a kernel that padded the experts' intermediate size
        (vLLM-CPU's grouped GEMM rounds it up) holds weights of another shape than the checkpoint's, and vLLM 0.32's
        reload fails midway copying between them (seen: "size of tensor a (128) must match ... (96)")."""
        out = {}
        for module in self.model_runner.get_model().modules():  # type: ignore[attr-defined]
            config, w2 = getattr(module, "moe_config", None), getattr(module, "w2_weight", None)
            if config is None or w2 is None or not hasattr(module, "layer_name"):
                continue
            size, held = int(config.intermediate_size_per_partition), int(w2.shape[-1])
            if held != size:
                out[module.layer_name] = (f"vLLM's MoE kernel here pads each expert's intermediate size {size} to "
                                          f"{held}, and its layer-wise reload cannot write padded experts")
        return out

    def tandem_device_free_bytes(self) -> int:
        """Free accelerator memory seen by this worker (0 on CPU), to measure what sleep() released."""
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            return int(torch.cuda.mem_get_info()[0])
        return 0

    def tandem_pre_truncation_logprobs(self) -> bool:
        """Make `processed_logprobs` mean log_softmax(logits / T) *before* top-k/top-p truncation.

        vLLM's processed logprobs are taken after truncation (dropped tokens at -inf, the rest renormalized); the
        trainer recomputes the untruncated distribution, so under top-k/top-p they would disagree. Without
        truncation both are equal and the sampler is left untouched. Returns False where the sampler has a shape
        this hook does not know, in which case logprobs under top-k/top-p stay post-truncation.
        """
        sampler = getattr(getattr(self, "model_runner", None), "sampler", None)
        if sampler is None:
            return False
        tks = getattr(sampler, "topk_topp_sampler", None)
        if tks is not None:  # model runner V1 (CPU, and GPU with VLLM_USE_V2_MODEL_RUNNER=0)
            return _patch_v1(tks)
        if hasattr(sampler, "_sample_random"):  # model runner V2 (GPU default)
            return _patch_v2(sampler)
        return False


def _patch_v1(tks: Any) -> bool:
    if getattr(tks, "_tandem_patched", False):
        return True
    inner = tks.forward

    def forward(logits: torch.Tensor, generators, k, p):  # noqa: ANN001
        if k is None and p is None:
            return inner(logits, generators, k, p)
        # Truncation works in place on `logits`, so the untruncated log-softmax must be taken first.
        full = logits.log_softmax(dim=-1, dtype=torch.float32)
        sampled, _ = inner(logits, generators, k, p)
        return sampled, full

    tks.forward = forward
    tks._tandem_patched = True
    return True


def _patch_v2(sampler: Any) -> bool:
    """V2 returns the logits it sampled from (temperature applied, then truncated); return them untruncated."""
    import inspect

    if getattr(sampler, "_tandem_patched", False):
        return True
    inner = sampler._sample_random
    signature = inspect.signature(inner)
    if not {"processed_logits", "top_k", "top_p"} <= set(signature.parameters):
        return False

    def _sample_random(*args, **kwargs):  # noqa: ANN002, ANN003
        bound = signature.bind(*args, **kwargs)
        if bound.arguments.get("top_k") is None and bound.arguments.get("top_p") is None:
            return inner(*args, **kwargs)
        full = bound.arguments["processed_logits"].clone()  # truncation may work in place
        sampled, _ = inner(*args, **kwargs)
        return sampled, full

    sampler._sample_random = _sample_random
    sampler._tandem_patched = True
    return True
