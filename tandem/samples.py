"""What sampling is given and hands to training: a prompt with its images (`ModelPrompt`), each sampled answer
(`Completion`) and a step's answers with the group (prompt) each belongs to (`Samples`). Engines take and make them,
trainers read them, so neither package owns them."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch


@dataclass(frozen=True, eq=False)
class Images:
    """A prompt's images as its model takes them: the processor's tensors for this prompt alone (Idefics3:
    `pixel_values` [1, tiles, 3, H, W] and `pixel_attention_mask` [1, tiles, H, W]; Qwen2.5-VL: `pixel_values`
    [patches, 3 x 2 x 14 x 14] and `image_grid_thw` [images, 3]). Every row of a group holds the
    same object, so it travels once per group (pickle keeps one copy of an object held several times)."""

    key: str  # a hash of the images' files: two prompts with the same ids and other pictures differ by it
    names: tuple[str, ...]  # what samples files show: the images' paths, or `row <i> image <k>`
    tensors: dict[str, torch.Tensor]
    # for vLLM, which runs the processor itself: the images' files (decoded for it as the trainer's processor is
    # given them, `tandem.util.pixels.decode`; a server is sent those pixels, never the file), and the prompt's ids
    # with ONE placeholder token per image (vLLM expands each; the expanded ids, `Completion.prompt_ids`, are checked
    # equal to the processor's)
    files: tuple[bytes, ...] = ()
    engine_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class ModelPrompt:
    """A prompt as its model samples from it: its token ids (a vision-language model's with the image tokens
    expanded, as the trainer's processor expands them) and its images (None: a text prompt). Every engine, sampler
    and placement takes prompts as these, so the images travel inside the prompt they belong to; each completion
    sampled from one holds its `images` (`Completion.images`). Not the dataset's row (`tandem.data.sources.Prompt`,
    ids and row), which the controller turns into one (`tandem.run.source`)."""

    ids: tuple[int, ...]
    images: Images | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "ids", tuple(self.ids))  # immutable, whatever sequence it was given


def model_prompts(prompts: Sequence[ModelPrompt | Sequence[int]]) -> list[ModelPrompt]:
    """Prompts as engines take them: each a `ModelPrompt`, or a text prompt's ids alone (what callers without images,
    a judge or a benchmark, pass)."""
    return [p if isinstance(p, ModelPrompt) else ModelPrompt(tuple(p)) for p in prompts]


def batch_images(images: list[Images]) -> dict[str, torch.Tensor]:
    """One forward's image arguments from prompts' own tensors, in row order: each prompt's tiles concatenated into
    one batch entry (padded to the largest tile), which the model's image merge reads in row-major order, the order
    of the image tokens in the rows (no image is padded across prompts). Qwen-VL's prompts hold their images'
    patches in one [patches, channels x patch] tensor and each image's grid of patches [images, 3]: both are
    concatenated as they are, the grid saying which patches are whose."""
    if not images:
        return {}
    if "image_grid_thw" in images[0].tensors:
        return {name: torch.cat([im.tensors[name] for im in images]) for name in images[0].tensors}
    height = max(im.tensors["pixel_values"].shape[-2] for im in images)
    width = max(im.tensors["pixel_values"].shape[-1] for im in images)

    def padded(t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, width - t.shape[-1], 0, height - t.shape[-2]))

    return {name: torch.cat([padded(im.tensors[name]) for im in images], dim=1) for name in images[0].tensors}


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
    # Distillation on teacher workers of its own (placement.teacher_workers): the teacher's logprob of each completion
    # token, scored between sampling and training. None: not scored there (the trainers score it, or no teacher).
    teacher_logprobs: list[float] | None = None
    # A vision-language model's prompt images: those of the `ModelPrompt` it was sampled from (so every row of a group
    # holds one object); None: a text prompt.
    images: Images | None = None

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
