"""A step's completions as tensors for the trainer: micro-batches packed by a token budget, left-padded.

Left padding puts every sequence's last token in the last column, so the completion tokens of a micro-batch
sit in its last `T` columns (T = longest completion in it): the LM head runs on those columns only, and the
per-token tensors (targets, masks, logprobs) are [rows, T], right-aligned.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.rollout.base import Completion


@dataclass
class MicroBatch:
    rows: list[int]  # indices into the step's completions
    input_ids: torch.Tensor  # [b, L] left-padded prompt + completion
    attention_mask: torch.Tensor  # [b, L]
    position_ids: torch.Tensor  # [b, L]
    targets: torch.Tensor  # [b, T] the completion tokens, right-aligned
    mask: torch.Tensor  # [b, T] 1 on completion tokens
    sampler_logprobs: torch.Tensor  # [b, T]
    advantages: torch.Tensor  # [b]
    old_logprobs: torch.Tensor | None = None  # [b, T], filled before updates when mu > 1 or mini_batches > 1
    ref_logprobs: torch.Tensor | None = None  # [b, T], filled when kl_coef > 0

    @property
    def width(self) -> int:
        return self.targets.shape[1]

    @property
    def tokens(self) -> int:
        return int(self.mask.sum())


def pack(lengths: list[int], budget: int) -> list[list[int]]:
    """Group indices into micro-batches whose padded size (rows x longest) stays within `budget` tokens.

    Sorting by length first keeps padding small; each group is returned in ascending index order so results
    do not depend on how ties were broken.
    """
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    groups: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        new_longest = max(longest, lengths[i])
        if current and new_longest * (len(current) + 1) > budget:
            groups.append(sorted(current))
            current, new_longest = [], lengths[i]
        current.append(i)
        longest = new_longest
    if current:
        groups.append(sorted(current))
    return groups


def collate(completions: list[Completion], rows: list[int], advantages: torch.Tensor, pad_id: int) -> MicroBatch:
    seqs = [completions[i].prompt_ids + completions[i].completion_ids for i in rows]
    L = max(map(len, seqs))
    T = max(len(completions[i].completion_ids) for i in rows)
    b = len(rows)
    ids = torch.full((b, L), pad_id, dtype=torch.long)
    attn = torch.zeros((b, L), dtype=torch.long)
    targets = torch.full((b, T), pad_id, dtype=torch.long)
    mask = torch.zeros((b, T), dtype=torch.float32)
    slp = torch.zeros((b, T), dtype=torch.float32)
    for j, (i, s) in enumerate(zip(rows, seqs)):
        c = completions[i]
        ids[j, L - len(s):] = torch.tensor(s)
        attn[j, L - len(s):] = 1
        n = len(c.completion_ids)
        if n:
            targets[j, T - n:] = torch.tensor(c.completion_ids)
            mask[j, T - n:] = 1.0
            slp[j, T - n:] = torch.tensor(c.logprobs, dtype=torch.float32)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    return MicroBatch(rows, ids, attn, pos, targets, mask, slp, advantages[rows].float())


def make_micro_batches(completions: list[Completion], advantages: torch.Tensor, budget: int, pad_id: int,
                       subset: list[int] | None = None) -> list[MicroBatch]:
    idx = list(range(len(completions))) if subset is None else subset
    lengths = [len(completions[i].prompt_ids) + len(completions[i].completion_ids) for i in idx]
    return [collate(completions, [idx[k] for k in g], advantages, pad_id) for g in pack(lengths, budget)]


def dummy_micro_batch(pad_id: int = 0) -> MicroBatch:
    """One padding token with a zero mask: a forward/backward that adds nothing to any loss or statistic.

    Sharded training (FSDP/TP) needs every rank to run the same number of passes (they are collectives); a rank
    with fewer micro-batches in a mini-batch than its peers runs these. Its old and reference logprobs are set
    (zeros) so it can enter an update without having been through `prepare`.
    """
    # two tokens: a one-token "prompt" and a one-token "completion", the smallest shape the logprob code handles
    ids = torch.full((1, 2), pad_id, dtype=torch.long)
    zeros = torch.zeros((1, 1), dtype=torch.float32)
    return MicroBatch([], ids, torch.ones_like(ids), torch.arange(2).view(1, 2), ids[:, 1:].clone(), zeros.clone(),
                      zeros.clone(), torch.zeros(1), old_logprobs=zeros.clone(), ref_logprobs=zeros.clone())
