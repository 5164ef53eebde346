"""The rollout contract: what an engine is asked (Sampling), what it returns (Completion), its protocol, and a step's
completions with their groups (Samples)."""
from __future__ import annotations

import dataclasses
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
    # Per-prompt completion limits (each at most max_new_tokens; a prompt row's `max_new_tokens`): prompt i's
    # completions stop at max_tokens[i] tokens (finish_reason "length"). Empty: max_new_tokens for every prompt.
    max_tokens: tuple[int, ...] = ()

    def limit(self, i: int) -> int:
        """Prompt i's completion limit."""
        return int(self.max_tokens[i]) if self.max_tokens else int(self.max_new_tokens)


@dataclass
class Completion:
    """One sampled answer. Token ids are the truth: training never re-tokenizes `text`."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]  # sampler's logprob of each completion token (len == len(completion_ids))
    text: str
    finish_reason: str  # "stop" (EOS, stop token or stop string) or "length"
    prompt_index: int  # index into the prompts passed to this engine's generate(); never rewritten afterwards
    meta: dict = field(default_factory=dict)
    # Multi-turn (tandem.rollout.multiturn): 1 per completion token the policy sampled, 0 per token the environment
    # appended (a tool's output; its `logprobs` entry is 0.0). None: every token was sampled.
    loss_mask: list[int] | None = None
    # Mixture of experts (hf engine): [positions, MoE layers, top_k] the experts each router sent each position of
    # prompt_ids + completion_ids to, for every position but the last (whose output nothing uses), in
    # `tandem.moe.route_dtype`; positions past its end (an environment's last tokens) have none. None: not recorded.
    routes: torch.Tensor | None = None
    # Streaming (placement.schedule: stream): the policy version that sampled each completion token (its weights may
    # change mid-sequence). None: every token was sampled by the rollout's version.
    versions: list[int] | None = None

    @property
    def sampled_tokens(self) -> int:
        """Completion tokens the policy sampled (all of them, unless an environment appended some)."""
        return len(self.completion_ids) if self.loss_mask is None else sum(self.loss_mask)

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"


@dataclass
class Samples:
    """A step's completions and the group each belongs to: `group[i]` (in 0..num_groups-1) is the prompt that
    completion i answers, so the completions of one prompt form a group. Assigned once, where the prompts of a
    generate call are known; `concat` and `select` keep it right, so nothing downstream renumbers it."""

    completions: list[Completion]
    group: torch.Tensor  # [N] long
    num_groups: int  # the prompts these completions were sampled for (a group may have lost its rows to `select`)

    def __post_init__(self) -> None:
        self.group = torch.as_tensor(self.group, dtype=torch.long).view(-1)
        if len(self.group) != len(self.completions):
            raise ValueError(f"Samples: {len(self.group)} group ids for {len(self.completions)} completions")

    @classmethod
    def of_call(cls, completions: list[Completion], num_prompts: int | None = None) -> "Samples":
        """The completions of one generate call: each one's group is its `prompt_index` (default: as many prompts
        as the highest index shows)."""
        group = [c.prompt_index for c in completions]
        return cls(completions, group, max(group, default=-1) + 1 if num_prompts is None else num_prompts)

    def __len__(self) -> int:
        return len(self.completions)

    @property
    def completion_lengths(self) -> torch.Tensor:
        """[N] completion tokens of each row."""
        return torch.tensor([len(c.completion_ids) for c in self.completions], dtype=torch.long)

    @property
    def sampled_lengths(self) -> torch.Tensor:
        """[N] completion tokens of each row the policy sampled: what it is trained on (`Completion.loss_mask`)."""
        return torch.tensor([c.sampled_tokens for c in self.completions], dtype=torch.long)

    @property
    def sequence_lengths(self) -> list[int]:
        """Prompt plus completion tokens of each row (what a row costs a trainer)."""
        return [len(c.prompt_ids) + len(c.completion_ids) for c in self.completions]

    @property
    def truncated(self) -> torch.Tensor:
        """[N] bool: the row stopped at the length limit."""
        return torch.tensor([c.truncated for c in self.completions], dtype=torch.bool)

    def concat(self, other: "Samples") -> "Samples":
        """These rows, then `other`'s, whose groups follow this one's (another generate call's prompts)."""
        return Samples(self.completions + other.completions, torch.cat([self.group, other.group + self.num_groups]),
                       self.num_groups + other.num_groups)

    def select(self, rows: list[int]) -> "Samples":
        """These rows, in this order; the groups they belong to renumbered 0..k-1 in order of first appearance."""
        kept = self.group[rows].tolist()
        number = {g: i for i, g in enumerate(dict.fromkeys(kept))}
        return Samples([self.completions[i] for i in rows], [number[g] for g in kept], len(number))


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
