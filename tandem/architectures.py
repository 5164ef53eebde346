"""Which model architectures tandem runs where (the model zoo's tested table), checked before any model loads."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from tandem.config import ConfigError
from tandem.modeling import read_json

log = logging.getLogger(__name__)

# transformers 5 trains a mixture of experts with each layer's experts fused into 3-D tensors
# (`mlp.experts.gate_up_proj`), while vLLM loads the checkpoint's per-expert tensors (`experts.0.gate_proj.weight`):
# the trainer's names are not the engine's, and a sync would need transformers' conversion on every one.
_MOE_VLLM = ("the trainer's fused expert tensors (transformers 5: mlp.experts.gate_up_proj) are not the "
             "checkpoint's per-expert tensors that vLLM loads, and tandem's weight sync does not convert them")
# tandem's TP plan (tandem/train/parallel.py) shards q/k/v/o_proj and gate/up/down_proj of every layer.
_NO_TP_FUSED = "its attention and MLP projections are fused (qkv_proj, gate_up_proj): tandem's TP plan has no entry for them"
_NO_TP_MOE = "its MLP is a mixture of experts: tandem's TP plan shards dense MLPs only"
# Seen in the zoo test: the forward matches one process, the second update does not (4e-5 relative). q_norm/k_norm
# normalize each head, so under TP each rank's copy gets the gradient of its own heads only, and nothing sums them.
_NO_TP_QK_NORM = ("its per-head q_norm/k_norm weights see only their rank's heads under tandem's TP plan, so their "
                  "gradients are partial (the zoo test's second update differs from one process)")


# LoRA's default targets: every projection of attention and the MLP (QLoRA's finding: adapting all linear layers
# matches full fine-tuning best), never the embeddings or the LM head.
_DENSE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")  # an MoE's experts are fused 3-D tensors, not linear layers


@dataclass(frozen=True)
class Support:
    """Where an architecture runs; a reason string where it does not (what the refusal says)."""

    name: str  # as users know it
    vllm: str = ""  # "" = supported
    tp: str = ""
    lora: tuple[str, ...] = _DENSE  # lora.target_modules when the config names none


SUPPORT: dict[str, Support] = {  # model_type -> support, as tests/core/test_model_zoo.py finds it
    "qwen2": Support("Qwen2 / Qwen2.5"),
    "llama": Support("Llama 3"),
    "qwen3": Support("Qwen3", tp=_NO_TP_QK_NORM),
    "gemma": Support("Gemma"),
    "mistral": Support("Mistral"),
    "phi3": Support("Phi-3 / Phi-4", tp=_NO_TP_FUSED, lora=("qkv_proj", "o_proj", "gate_up_proj", "down_proj")),
    "qwen3_moe": Support("Qwen3-MoE", vllm=_MOE_VLLM, tp=_NO_TP_MOE, lora=_ATTENTION),
    "mixtral": Support("Mixtral", vllm=_MOE_VLLM, tp=_NO_TP_MOE, lora=_ATTENTION),
}


def lora_targets(kind: str) -> list[str] | str:
    """The modules LoRA adapts by default in a `model_type`; PEFT's `all-linear` (every linear layer but the LM
    head) outside the table."""
    known = SUPPORT.get(kind)
    return list(known.lora) if known is not None else "all-linear"


def model_type(path: str) -> str:
    config = read_json(Path(path).expanduser() / "config.json")
    return str(config.get("text_config", {}).get("model_type") or config.get("model_type"))


def check_supported(cfg) -> None:
    """Refuse, before any model loads, an architecture in a placement or engine it is not known to work in.

    An architecture outside the table runs only where nothing can map its names wrongly: the embedded engine in
    one process (the same transformers class on both sides). A logged warning says it is untested.
    """
    kind = model_type(cfg.model.path)
    pl, engine = cfg.placement, cfg.rollout.engine
    parallel = (pl.workers if pl.mode == "colocate" else pl.train_workers) > 1
    wants = [what for what, on in (("rollout.engine: vllm", engine == "vllm"),
                                   ("placement.tensor_parallel > 1", pl.tensor_parallel > 1),
                                   ("sharded training (FSDP)", parallel)) if on]
    known = SUPPORT.get(kind)
    if known is None:
        if wants:
            raise ConfigError(
                f"model.path: architecture {kind!r} is not among those tested with {', '.join(wants)} "
                f"({', '.join(sorted(SUPPORT))}); run it with rollout.engine: hf in one process (placement.backend: "
                "local), or add it to the model zoo (tests/core/test_model_zoo.py) and to tandem.architectures.SUPPORT")
        log.warning("architecture %r is not in tandem's model zoo (%s); the hf engine in one process runs it with "
                    "the checks of every sync", kind, ", ".join(sorted(SUPPORT)))
        return
    if engine == "vllm" and known.vllm:
        raise ConfigError(f"rollout.engine: vllm does not support architecture {kind!r} ({known.name}) in "
                               f"tandem: {known.vllm}; use rollout.engine: hf")
    if pl.tensor_parallel > 1 and known.tp:
        raise ConfigError(f"placement.tensor_parallel: {pl.tensor_parallel} does not support architecture "
                               f"{kind!r} ({known.name}): {known.tp}; use placement.tensor_parallel: 1 (FSDP only)")


def support_table() -> str:
    """The README's table of architectures x (hf step, vLLM sync, FSDP, TP)."""
    rows = ["| architecture | `model_type` | hf step | vLLM sync | FSDP | TP |", "|---|---|---|---|---|---|"]
    for kind, s in SUPPORT.items():
        cell = lambda reason: "refused" if reason else "yes"  # noqa: E731
        rows.append(f"| {s.name} | `{kind}` | yes | {cell(s.vllm)} | yes | {cell(s.tp)} |")
    return "\n".join(rows)
