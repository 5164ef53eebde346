"""Methods injected into every vLLM worker (`worker_extension_cls`): weight loading and the logprob convention."""
from __future__ import annotations

import base64
from typing import Any, Iterable

import torch

from tandem.rollout.manifest import digest


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
            self.reload_weights(weights_iterator=iter(weights))  # type: ignore[attr-defined]
            self._tandem_refresh_shared({name for name, _ in weights})
        elif path == "load_weights":
            from vllm.config import set_current_vllm_config

            with set_current_vllm_config(self.vllm_config), torch.no_grad():  # type: ignore[attr-defined]
                self.model_runner.get_model().load_weights(iter(weights))  # type: ignore[attr-defined]
        else:
            raise ValueError(f"unknown weight load path {path!r}; use 'reload' or 'load_weights'")
        return nbytes

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

    def tandem_weight_digest(self) -> dict[str, list[float]]:
        """[float64 sum, L2 norm] of each checkpoint tensor this worker was given since it started (plain lists:
        the HTTP RPC carries JSON)."""
        return {name: list(d) for name, d in self.__dict__.get("_tandem_received", {}).items()}

    def tandem_packed_modules(self) -> dict[str, list[str]]:
        """vLLM's fused modules and the checkpoint modules each one packs, e.g. qkv_proj: [q_proj, k_proj, v_proj]."""
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        return {k: list(v) for k, v in dict(getattr(model, "packed_modules_mapping", {}) or {}).items()}

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
