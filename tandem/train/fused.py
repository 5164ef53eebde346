"""Fused SiLU gate and RMS norm for training Llama-family models on CPU: one C pass each way (`tandem/kernels/
train_ops.c`) where PyTorch runs several ops, each a trip through memory for a micro-batch's activations; and
grouped-query attention that reads each key/value head in place (`group_attention`).

`fuse(model)` gives each gated SiLU MLP and RMS norm of the model (Qwen2, Qwen3, Llama, Mistral and their MoE
kin: `_MLPS`, `_NORMS`) a subclass of its own class whose forward runs the kernels on plain float32 CPU tensors
and is the HF module's own forward on anything else (another dtype or device, a DTensor). The modules'
parameters, names and state dict are unchanged, so LoRA, checkpoints and weight sync see the same model; swapping
the class is how FSDP2's `fully_shard` adds its hooks too. Without a C compiler nothing is swapped. The results
match HF's ops to float rounding (tests/train/test_fused.py), and the kernels give the same bits run after run for
a thread count, as the bit-identical resume needs.

Why not torch.compile: it fuses the same ops, but its first compile takes tens of seconds and a C++ toolchain on
every run, and recompiles for each micro-batch shape; these kernels compile in under a second, once per machine.
"""
from __future__ import annotations

import ctypes
import functools
import logging

import torch
from torch.autograd.function import once_differentiable
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from tandem.kernels import FLAGS, KERNELS, built

log = logging.getLogger(__name__)

# HF's classes whose forward is, word for word, Qwen2MLP's: down_proj(act_fn(gate_proj(x)) * up_proj(x)) (taken
# where act_fn is SiLU), and Qwen2RMSNorm's: weight * (x * rsqrt(mean(x^2) + eps)) in float32, cast back
# (tests/train/test_fused.py holds each to that source, so an upgrade that changes one fails there)
_MLPS = ("Qwen2MLP", "LlamaMLP", "Qwen3MLP", "MistralMLP", "Qwen2MoeMLP", "Qwen3MoeMLP")
_NORMS = ("Qwen2RMSNorm", "LlamaRMSNorm", "Qwen3RMSNorm", "MistralRMSNorm", "Qwen2MoeRMSNorm", "Qwen3MoeRMSNorm",
          "MixtralRMSNorm", "Phi3RMSNorm")


@functools.cache
def library() -> tuple[ctypes.CDLL | None, str]:
    """The kernels (`train_ops.c`) built, loaded, and ""; or None and why not (once per process)."""
    lib, why = built("train-ops", KERNELS / "train_ops.c", [KERNELS / "exp.h"], FLAGS)
    if lib is None:
        return None, why
    p, n = ctypes.c_void_p, ctypes.c_int64
    lib.tandem_silu_mul.argtypes = [p, p, p, n, ctypes.c_int]
    lib.tandem_silu_mul_backward.argtypes = [p, p, p, p, p, n, ctypes.c_int]
    lib.tandem_rms_norm.argtypes = [p, p, ctypes.c_float, p, p, n, n, ctypes.c_int]
    lib.tandem_rms_norm_backward.argtypes = [p, p, p, p, p, p, n, n, ctypes.c_int]
    for fn in (lib.tandem_silu_mul, lib.tandem_silu_mul_backward, lib.tandem_rms_norm, lib.tandem_rms_norm_backward):
        fn.restype = None
    return lib, ""


def _plain(*tensors: torch.Tensor) -> bool:
    """Tensors the kernels take: plain tensors or parameters (not another subclass such as DTensor), float32, on
    CPU."""
    return all(type(t) in (torch.Tensor, torch.nn.Parameter) and t.dtype == torch.float32 and t.device.type == "cpu"
               for t in tensors)


def _silu(act: torch.nn.Module) -> bool:
    """The activation is SiLU (HF's `silu` is its own SiLUActivation; `swish` is torch's)."""
    return isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation"


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class SiluMul(torch.autograd.Function):
    """silu(gate) * up, keeping only gate and up for backward (PyTorch's ops keep silu(gate) too)."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate, up = gate.contiguous(), up.contiguous()
        y = torch.empty_like(gate)
        library()[0].tandem_silu_mul(gate.data_ptr(), up.data_ptr(), y.data_ptr(), y.numel(),
                                     torch.get_num_threads())
        ctx.save_for_backward(gate, up)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate, up = ctx.saved_tensors
        dy = dy.contiguous()
        dg, du = torch.empty_like(gate), torch.empty_like(up)
        library()[0].tandem_silu_mul_backward(dy.data_ptr(), gate.data_ptr(), up.data_ptr(), dg.data_ptr(),
                                              du.data_ptr(), dy.numel(), torch.get_num_threads())
        return dg, du


class RmsNorm(torch.autograd.Function):
    """weight * x / sqrt(mean(x^2) + eps) over the last dim, keeping x and each row's 1 / sqrt(...) for backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x, weight = x.contiguous(), weight.contiguous()
        E = x.shape[-1]
        y = torch.empty_like(x)
        inv = torch.empty(x.shape[:-1], dtype=torch.float32)
        library()[0].tandem_rms_norm(x.data_ptr(), weight.data_ptr(), eps, y.data_ptr(), inv.data_ptr(),
                                     x.numel() // E, E, torch.get_num_threads())
        ctx.save_for_backward(x, weight, inv)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        x, weight, inv = ctx.saved_tensors
        dy, E, threads = dy.contiguous(), x.shape[-1], torch.get_num_threads()
        dx = torch.empty_like(x)
        parts = torch.zeros((threads, E), dtype=torch.float32) if ctx.needs_input_grad[1] else None
        library()[0].tandem_rms_norm_backward(dy.data_ptr(), x.data_ptr(), weight.data_ptr(), inv.data_ptr(),
                                              dx.data_ptr(), _ptr(parts), x.numel() // E, E, threads)
        return dx, None if parts is None else parts.sum(0), None


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    gate, up = self.gate_proj(x), self.up_proj(x)
    if _plain(gate, up):
        return self.down_proj(SiluMul.apply(gate, up))
    return self.down_proj(self.act_fn(gate) * up)


def _norm_forward(self, x: torch.Tensor) -> torch.Tensor:
    if _plain(x, self.weight):
        return RmsNorm.apply(x, self.weight, self.variance_epsilon)
    return super(type(self), self).forward(x)


@functools.cache
def _fused_class(cls: type) -> type:
    """`cls` with the fused forward (one subclass per class, so isinstance still holds)."""
    forward = _mlp_forward if cls.__name__ in _MLPS else _norm_forward
    return type(f"Fused{cls.__name__}", (cls,), {"forward": forward, "__module__": __name__})


def fuse(model: torch.nn.Module) -> int:
    """Give the model's gated MLPs (SiLU) and RMS norms of `_MLPS` and `_NORMS` the fused forward; returns how many
    modules now have it (0 where the kernels do not build: the log says why, and PyTorch's ops stay)."""
    targets = [m for m in model.modules() if (type(m).__name__ in _MLPS and _silu(m.act_fn))
               or type(m).__name__ in _NORMS]
    if not targets:
        return 0
    lib, why = library()
    if lib is None:
        log.info("training's fused SiLU gate and RMS norm are off (PyTorch ops instead): %s", why)
        return 0
    for m in targets:
        m.__class__ = _fused_class(type(m))
    return len(targets)


# The attention implementation `group_attention` gives a model: HF's SDPA attention, but where a mask is passed on
# CPU, SDPA reads each key/value head for its group of query heads (`enable_gqa`). HF's SDPA path copies the keys
# and values once per query head instead (`repeat_kv`) whenever there is a mask, which the prompt-once layout and
# padded rows always pass: that copy and its backward's sum over the copies are about 1% of a GQA model's update
# (bench/bench_fused.py, the profile in docs/design-notes.md). PyTorch's CPU flash attention takes the mask and the
# grouped heads together; HF keeps the copy for CUDA, whose fast kernels do not.
GROUPED_SDPA = "tandem_grouped_sdpa"


def _grouped_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                  **kwargs) -> tuple[torch.Tensor, None]:
    """HF's `sdpa_attention_forward` (same arguments, same result to float rounding) with the grouped heads read in
    place where a mask is passed on CPU; HF's own function everywhere else (no mask: it already passes
    `enable_gqa`; another device; a position bias, a paged cache or attention weights asked for)."""
    if (attention_mask is None or query.device.type != "cpu" or getattr(module, "num_key_value_groups", 1) == 1
            or kwargs.get("position_bias") is not None or kwargs.get("cache") is not None
            or kwargs.get("output_attentions")):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                           dropout_p=dropout, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(GROUPED_SDPA, _grouped_sdpa)
AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)  # the masks HF builds for "sdpa"


def group_attention(model: torch.nn.Module) -> bool:
    """Give a model that uses HF's SDPA attention `_grouped_sdpa` instead (its config's attention implementation:
    a process-local name, never saved with the config); True if it now has it."""
    config = model.config
    if config._attn_implementation not in ("sdpa", GROUPED_SDPA):
        return False
    config._attn_implementation = GROUPED_SDPA
    return True
