"""The rollout contract: what an engine is asked (Sampling), what it returns (Completion), and its protocol."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class Sampling:
    """How to sample. `temperature == 0` means greedy.

    The sampler's logprob of a token is taken from `log_softmax(logits / temperature)` *before* top-k/top-p
    truncation, which is exactly what the trainer recomputes; truncation only changes which token is drawn.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 64
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    # Per-prompt seeds (vLLM): prompt i's samples are seeded seeds[i], seeds[i] + 1, ...; empty = seed + i * n.
    # A placement that shares prompts over engines passes each prompt's seed in the whole batch, so the samples
    # do not depend on how many engines there are.
    seeds: tuple[int, ...] = ()


@dataclass
class Completion:
    """One sampled answer. Token ids are the truth: training never re-tokenizes `text`."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]  # sampler's logprob of each completion token (len == len(completion_ids))
    text: str
    finish_reason: str  # "stop" (EOS, stop token or stop string) or "length"
    prompt_index: int  # index into the prompts passed to generate(); completions of one prompt form a group
    meta: dict = field(default_factory=dict)

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"


@runtime_checkable
class RolloutEngine(Protocol):
    """A generation engine. `hf` (embedded) and `vllm` implement it; the trainer knows nothing else."""

    def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[Completion]:
        """Sample `sampling.n` completions for each prompt; results are grouped by prompt, in prompt order."""
        ...

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the engine's weights in place (Hugging Face parameter names). Partial updates are allowed; every
        name, shape and dtype of the call is checked before anything is written (`tandem.rollout.manifest`)."""
        ...

    def manifest(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """What a whole weight sync must bring: every parameter's name, shape and dtype."""
        ...

    def weight_aliases(self) -> dict[str, str]:
        """Names `load_weights` also accepts for a manifest name (a tied head for its embedding)."""
        ...

    def weight_digest(self) -> dict[str, tuple[float, float]]:
        """Per-parameter checksums (float64 sum, L2 norm) of the weights the engine samples with."""
        ...

    def sleep(self) -> int:
        """Release device memory (weights, KV cache) while the trainer runs; returns bytes released."""
        ...

    def wake(self) -> int:
        """Restore what sleep() released; returns bytes restored."""
        ...

    def close(self) -> None:
        ...
