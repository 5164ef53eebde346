"""The rollout contract: what an engine is asked (`tandem.samples.ModelPrompt`s, sampled as `Sampling` says), its
protocol (it returns `tandem.samples.Completion`s), and the one batch type that carries a step's `Samples` from the
samplers to training (Rollout)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Iterable, Protocol, Sequence, runtime_checkable

import torch

from tandem.samples import Completion, ModelPrompt, Samples


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
    # Per-prompt completion limits (each at most max_new_tokens; a prompt row's `max_new_tokens`): prompt i's
    # completions stop at max_tokens[i] tokens (finish_reason "length"). Empty: max_new_tokens for every prompt.
    max_tokens: tuple[int, ...] = ()

    def limit(self, i: int) -> int:
        """Prompt i's completion limit."""
        return int(self.max_tokens[i]) if self.max_tokens else int(self.max_new_tokens)


@dataclass
class Rollout:
    """Completions sampled for a batch of prompts, and how: the one batch type from a sampler's share of a generate
    call (its groups: the share's prompts), through the placement's merge of the shares (the call's prompts), to
    the rollout source's scored batch a step trains on (`rewards`, `scores`)."""

    samples: Samples
    version: int = 0  # the policy version whose weights sampled them (merged: the oldest)
    seconds: float = 0.0  # generating (merged: the slowest share; over rounds: summed)
    idle_seconds: float = 0.0  # the samplers' wait for work before it (summed)
    load_seconds: float = 0.0  # loading staged weights before generating (merged: the slowest; over rounds: summed)
    rewards: torch.Tensor | None = None  # [N] float32, once scored: each row's summed reward (then shaped)
    scores: dict[str, list[float]] = field(default_factory=dict)  # each reward function's score of each row

    def concat(self, other: "Rollout") -> "Rollout":
        """These rows, then another round's (see `Samples.concat`)."""
        rewards = None if self.rewards is None else torch.cat([self.rewards, other.rewards])
        return Rollout(self.samples.concat(other.samples), min(self.version, other.version),
                       self.seconds + other.seconds, self.idle_seconds + other.idle_seconds,
                       self.load_seconds + other.load_seconds, rewards,
                       {k: v + other.scores[k] for k, v in self.scores.items()})

    def select(self, rows: list[int]) -> "Rollout":
        """These rows, in this order (see `Samples.select`)."""
        return dataclasses.replace(self, samples=self.samples.select(rows),
                                   rewards=None if self.rewards is None else self.rewards[rows],
                                   scores={k: [v[i] for i in rows] for k, v in self.scores.items()})


@runtime_checkable
class RolloutEngine(Protocol):
    """A generation engine. `hf` (embedded) and `vllm` implement it; the trainer knows nothing else."""

    def generate(self, prompts: Sequence[ModelPrompt | Sequence[int]], sampling: Sampling) -> list[Completion]:
        """Sample `sampling.n` completions for each prompt; results are grouped by prompt, in prompt order. A prompt
        is a `ModelPrompt` (a vision-language model's with its images, which each of its completions then holds) or
        a text prompt's ids alone (`tandem.samples.model_prompts`)."""
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
