"""Generation engines behind one protocol: `hf` (embedded) and `vllm`."""
from tandem.rollout.base import Completion, ModelPrompt, Rollout, RolloutEngine, Samples, Sampling  # noqa: F401


def make_engine(name: str, **kwargs) -> RolloutEngine:
    """Build the engine named in `rollout.engine`; engines import their heavy dependencies only here."""
    if name == "hf":
        from tandem.rollout.hf import HFEngine

        return HFEngine(**kwargs)
    if name == "vllm":
        from tandem.rollout.vllm.engine import VLLMEngine

        return VLLMEngine(**kwargs)
    if name == "vllm_server":
        from tandem.rollout.vllm.server import VLLMServerEngine

        return VLLMServerEngine(**kwargs)
    raise ValueError(f"unknown rollout engine {name!r}; choose one of: hf, vllm, vllm_server")
