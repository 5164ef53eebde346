"""A step's completions as tensors for the trainer: micro-batches packed by a token budget, left-padded, and where the
trainer runs them padding-free, also laid end to end (`Packed`).

Left padding puts every sequence's last token in the last column, so the completion tokens of a micro-batch
sit in its last `T` columns (T = longest completion in it): the LM head runs on those columns only, and the
per-token tensors (targets, masks, logprobs) are [rows, T], right-aligned. The padding-free layout changes only
what the forward takes and where its logits land: the per-token tensors stay [rows, T].

For a trainer that runs each distinct prompt once instead of once per completion, a micro-batch whose rows repeat
a prompt (GRPO's groups) also carries the prompt-once layout (`SharedPrompts`).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from tandem import moe
from tandem.samples import Completion, Images, Samples, batch_images


@dataclass
class SharedPrompts:
    """A micro-batch's distinct prompts, to be run once each: every row's completion then attends to its prompt's
    keys and values instead of recomputing them (GRPO samples `group_size` completions of each prompt).

    The prompts run without their last token; each row then feeds its prompt's last token and its completion but
    the last token, right-aligned like `targets` [b, T], so the logits of column t predict `targets[:, t]`.
    """

    ids: torch.Tensor  # [u, P] the distinct prompts but their last token, left-padded
    attention_mask: torch.Tensor  # [u, P]
    position_ids: torch.Tensor  # [u, P]
    of_row: torch.Tensor  # [b] which prompt each row continues
    inputs: torch.Tensor  # [b, T] the prompt's last token, then the completion but its last token, right-aligned
    inputs_mask: torch.Tensor  # [b, T] 1 on those tokens (the loss mask may drop some; this does not)
    inputs_positions: torch.Tensor  # [b, T]
    buckets: list[tuple[torch.Tensor, int]]  # rows run together and their width: the last `width` columns suffice
    # a vision-language model's: the distinct prompts' images as one forward takes them (`batch_images`), or empty
    images: dict[str, torch.Tensor] = field(default_factory=dict)

    def to(self, device: torch.device) -> "SharedPrompts":
        """Every tensor moved to `device`, in place (no copy where they already are)."""
        for f in fields(self):
            if f.name not in ("buckets", "images"):
                setattr(self, f.name, getattr(self, f.name).to(device))
        self.buckets = [(rows.to(device), width) for rows, width in self.buckets]
        self.images = {k: v.to(device) for k, v in self.images.items()}
        return self


@dataclass
class Packed:
    """A micro-batch's rows end to end in one sequence: what the padding-free forward takes.

    Each row's positions restart at 0, which is how transformers tells the rows apart with no attention mask
    (`find_packed_sequence_indices`: attention stays within a row). `positions` is the 1-D positions; a 3-D rotary
    model's forward puts its own three sections after them ([4, 1, N], transformers' packed form for mRoPE:
    `tandem.train.logprobs`)."""

    ids: torch.Tensor  # [1, N] every row's prompt + completion, rows in the micro-batch's order
    positions: torch.Tensor  # [1, N] each row's own positions from 0
    keep: torch.Tensor  # [K] the positions of `ids` whose logits predict a completion token, ascending
    at: torch.Tensor  # [K] where each kept logit's token goes in the [b, T] per-token tensors, flat: row * T + col
    lengths: torch.Tensor  # [b] each row's length in `ids` (the segments, in order)

    def to(self, device: torch.device) -> "Packed":
        """Every tensor moved to `device`, in place (no copy where they already are)."""
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name).to(device))
        return self


@dataclass
class MicroBatch:
    rows: list[int]  # the rows of the step's Samples this micro-batch holds: its advantages are looked up by them
    input_ids: torch.Tensor  # [b, L] left-padded prompt + completion
    attention_mask: torch.Tensor  # [b, L]
    position_ids: torch.Tensor  # [b, L]
    targets: torch.Tensor  # [b, T] the completion tokens, right-aligned
    mask: torch.Tensor  # [b, T] 1 on completion tokens the policy sampled (not on an environment's)
    sampler_logprobs: torch.Tensor  # [b, T]
    old_logprobs: torch.Tensor | None = None  # [b, T], filled before updates when mu > 1 or mini_batches > 1
    ref_logprobs: torch.Tensor | None = None  # [b, T], filled when kl_coef > 0
    teacher_logprobs: torch.Tensor | None = None  # [b, T], filled when algo.distill names a teacher (or collated)
    shared: SharedPrompts | None = None  # set when rows repeat a prompt: the prompt-once layout of the same rows
    packed: Packed | None = None  # set for a padding-free trainer: the same rows end to end, what its forward takes
    # Mixture of experts, where the sampler recorded them (`Completion.routes`): the experts each position of
    # input_ids went to [b, L, MoE layers, top_k], and where that is known [b, L] bool (`tandem.moe.batch_routes`)
    routes: torch.Tensor | None = None
    routed: torch.Tensor | None = None
    # a vision-language model's: every row's prompt images as one forward takes them (`batch_images`), or empty
    images: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def width(self) -> int:
        return self.targets.shape[1]

    def to(self, device: torch.device) -> "MicroBatch":
        """Every tensor moved to `device`, in place (no copy where they already are): batches are laid out on
        the host, the policy runs on its device."""
        for f in fields(self):
            value = getattr(self, f.name)
            if torch.is_tensor(value) or isinstance(value, (SharedPrompts, Packed)):
                setattr(self, f.name, value.to(device))
        self.images = {k: v.to(device) for k, v in self.images.items()}
        return self

    @property
    def tokens(self) -> int:
        return int(self.mask.sum())

    def advantages(self, of_rows: torch.Tensor) -> torch.Tensor:
        """[b] this micro-batch's rows' advantages from the step's (one per row of its Samples)."""
        if not self.rows:  # a padding pass (`dummy_micro_batch`): its one row is masked out
            return torch.zeros(self.targets.shape[0], device=self.targets.device)
        return of_rows[self.rows].float().to(self.targets.device)


def pack(lengths: list[int], budget: int, groups: list[int] | None = None,
         prompt_lengths: list[int] | None = None, packed: bool = False) -> list[list[int]]:
    """Group indices into micro-batches whose size, as they will run, stays within `budget` tokens: padded, rows x
    longest; `packed` (padding-free, `Packed`), the sum of the rows' lengths.

    Sorting by length first keeps padding small. With `groups` (each index's prompt group, all of whose rows share
    a prompt) the rows of a group are kept next to each other instead, so a micro-batch holds whole groups where the
    budget allows and runs each prompt once (`SharedPrompts`); with `prompt_lengths` too, a micro-batch is sized as
    that prompt-once layout runs: its distinct prompts once each plus every row's completion (each part padded to
    its longest), so a long prompt's group of short completions is not cut into micro-batches that each run the
    prompt again; `packed` with it, as the cheaper of the two (`make_micro_batches` runs each micro-batch so).
    Each micro-batch is returned in ascending index order so results do not depend on how ties were broken.
    """
    if groups is None:
        order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    else:
        first = {}
        for i in sorted(range(len(lengths)), key=lambda i: (lengths[i], i)):
            first.setdefault(groups[i], len(first))  # groups in the order of their shortest row
        order = sorted(range(len(lengths)), key=lambda i: (first[groups[i]], lengths[i], i))
    shared = groups is not None and prompt_lengths is not None
    out: list[list[int]] = []
    current: list[int] = []
    prompts: set[int] = set()
    head = tail = total = 0  # prompt-once size = distinct prompts x longest head + rows x longest tail
    for i in order:
        # plain: no head, the whole sequence is the tail; prompt-once: the prompt but its last token is the head, and
        # each row runs its prompt's last token and its completion but its last: completion-many tokens
        h, t = (prompt_lengths[i] - 1, lengths[i] - prompt_lengths[i]) if shared else (0, lengths[i])
        heads = len(prompts | {groups[i]}) if shared else 0
        size = heads * max(head, h) + (len(current) + 1) * max(tail, t)
        if packed:
            size = min(size, total + lengths[i]) if shared else total + lengths[i]
        if current and size > budget:
            out.append(sorted(current))
            current, prompts, head, tail, total = [], set(), 0, 0, 0
        current.append(i)
        if shared:
            prompts.add(groups[i])
        head, tail, total = max(head, h), max(tail, t), total + lengths[i]
    if current:
        out.append(sorted(current))
    return out


def collate(completions: list[Completion], rows: list[int], pad_id: int, share_prompts: bool = False,
            packed: bool = False) -> MicroBatch:
    """These rows as one micro-batch; with `share_prompts`, also their prompt-once layout (when a prompt repeats);
    with `packed`, also the rows end to end (`Packed`)."""
    prompts = [completions[i].prompt_ids for i in rows]
    outs = [completions[i].completion_ids for i in rows]
    seqs = [p + c for p, c in zip(prompts, outs)]
    L = max(map(len, seqs))
    T = max(map(len, outs))
    ids, attn = _left_pad(seqs, L, pad_id)
    targets, mask = _left_pad(outs, T, pad_id)
    loss_masks = [completions[i].loss_mask for i in rows]
    if any(m is not None for m in loss_masks):  # an environment's tokens (tool output) are context, never trained on
        mask = mask * torch.tensor([[0] * (T - len(c)) + (m if m is not None else [1] * len(c))
                                    for c, m in zip(outs, loss_masks)], dtype=torch.long).view(len(rows), T)
    slp = torch.tensor([[0.0] * (T - len(c)) + list(completions[i].logprobs) for i, c in zip(rows, outs)],
                       dtype=torch.float32).view(len(rows), T)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    mb = MicroBatch(rows, ids, attn, pos, targets, mask.float(), slp)
    images = [completions[i].images for i in rows]
    mb.images = batch_images([im for im in images if im is not None])
    if completions[rows[0]].teacher_logprobs is not None:  # scored on the teacher's own workers
        mb.teacher_logprobs = torch.tensor([[0.0] * (T - len(c)) + list(completions[i].teacher_logprobs)
                                            for i, c in zip(rows, outs)], dtype=torch.float32).view(len(rows), T)
    routes = [completions[i].routes for i in rows]
    shape = next((r.shape[1:] for r in routes if r is not None), None)
    if shape is not None:
        mb.routes, mb.routed = moe.batch_routes(routes, list(map(len, seqs)), L, *shape)
    if share_prompts:
        mb.shared = _shared_prompts(prompts, outs, T, pad_id, images)
    if packed:
        mb.packed = _packed(prompts, outs, T)
    return mb


def _packed(prompts: list[list[int]], outs: list[list[int]], T: int) -> Packed:
    """These rows end to end: row r's completion token j is predicted by the logit at its prompt's last position
    plus j, and lands in column T - len(completion) + j of row r (right-aligned, as `targets`)."""
    seqs = [p + c for p, c in zip(prompts, outs)]
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.long)
    starts = lengths.cumsum(0) - lengths
    keep, at = [], []
    for r, (p, c) in enumerate(zip(prompts, outs)):
        keep.append(torch.arange(len(c)) + int(starts[r]) + len(p) - 1)
        at.append(torch.arange(len(c)) + r * T + T - len(c))
    return Packed(ids=torch.tensor([t for s in seqs for t in s], dtype=torch.long).view(1, -1),
                  positions=torch.cat([torch.arange(len(s)) for s in seqs]).view(1, -1),
                  keep=torch.cat(keep).long(), at=torch.cat(at).long(), lengths=lengths)


def _left_pad(seqs: list[list[int]], width: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, width] right-aligned token ids and their 0/1 mask (one tensor built from lists: no per-row copies)."""
    ids = torch.tensor([[pad_id] * (width - len(s)) + s for s in seqs], dtype=torch.long).view(len(seqs), width)
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs], dtype=torch.long).view(len(seqs), width)
    return ids, mask


# What one more pass over a bucket of rows costs, in padded token positions: a pass is about a hundred small ops
# (~2 ms on a CPU core), one position of the demo's model forward and backward about 60 us. Bigger models make
# positions dearer, so this errs towards fewer buckets there.
BUCKET_PASS_TOKENS = 32


def length_buckets(widths: list[int], pass_tokens: int | None = None) -> list[tuple[list[int], int]]:
    """Rows (indices into `widths`) grouped by width, each group run as one pass padded to its widest row: the
    grouping with the fewest padded positions plus `pass_tokens` per pass. Exact: a best grouping takes contiguous
    ranges of the sorted widths, found by dynamic programming over them."""
    cost_of_pass = BUCKET_PASS_TOKENS if pass_tokens is None else pass_tokens
    widths = [max(w, 1) for w in widths]  # an empty completion still feeds its prompt's last token
    distinct = sorted(set(widths))
    rows_upto = [0]
    for w in distinct:
        rows_upto.append(rows_upto[-1] + widths.count(w))
    best, cut = [0] + [None] * len(distinct), [0] * (len(distinct) + 1)
    for j in range(1, len(distinct) + 1):
        for i in range(j):
            cost = best[i] + (rows_upto[j] - rows_upto[i]) * distinct[j - 1] + cost_of_pass
            if best[j] is None or cost < best[j]:
                best[j], cut[j] = cost, i
    out, j = [], len(distinct)
    while j:
        i = cut[j]
        lo, hi = distinct[i], distinct[j - 1]
        out.append(([r for r, w in enumerate(widths) if lo <= w <= hi], hi))
        j = i
    return out[::-1]


def _shared_prompts(prompts: list[list[int]], outs: list[list[int]], T: int, pad_id: int,
                    images: list[Images | None]) -> SharedPrompts | None:
    """The prompt-once layout of these rows; None when no prompt repeats (nothing to save), nothing is generated,
    or a prompt is a single token (nothing would be left to run once). A prompt is its ids and its images: two
    pictures of one size under the same question have the same ids, and are two prompts."""
    index: dict[tuple[tuple[int, ...], str], int] = {}
    first: dict[int, Images | None] = {}  # each distinct prompt's images
    of_row = []
    for p, im in zip(prompts, images):
        u = index.setdefault((tuple(p), im.key if im is not None else ""), len(index))
        first.setdefault(u, im)
        of_row.append(u)
    if len(index) == len(prompts) or T == 0 or min(map(len, prompts)) < 2:
        return None
    heads = [list(p[:-1]) for p, _ in index]
    ids, attn = _left_pad(heads, max(map(len, heads)), pad_id)
    inputs, mask = _left_pad([p[-1:] + c[:-1] if c else [] for p, c in zip(prompts, outs)], T, pad_id)
    start = T - torch.tensor([len(c) for c in outs])  # each row's first completion column
    plen = torch.tensor([len(p) for p in prompts])
    return SharedPrompts(
        ids=ids, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp(min=0), of_row=torch.tensor(of_row),
        inputs=inputs, inputs_mask=mask,
        inputs_positions=(plen[:, None] - 1 + torch.arange(T) - start[:, None]).clamp(min=0),
        buckets=[(torch.tensor(rows), width) for rows, width in length_buckets([len(c) for c in outs])],
        images=batch_images([im for im in first.values() if im is not None]),
    )


def make_micro_batches(samples: Samples, budget: int, pad_id: int, subset: list[int] | None = None,
                       by_prompt: bool = False, packed: bool = False) -> list[MicroBatch]:
    """`subset` (default all rows) packed by `budget`; `by_prompt`, for a trainer that runs each prompt once, keeps
    each group's rows together, sizes micro-batches as the prompt-once layout runs (see `pack`) and lays it out
    (`SharedPrompts`); `packed`, for a padding-free trainer, sizes them by their real tokens and lays them end to
    end (`Packed`). With both, each micro-batch keeps its prompt-once layout only where that runs fewer positions
    than the padding-free one (`prompt_once_pays`)."""
    idx = list(range(len(samples))) if subset is None else subset
    lengths = samples.sequence_lengths
    if by_prompt:
        groups = samples.group.tolist()
        prompts = [len(samples.completions[i].prompt_ids) for i in idx]
        parts = pack([lengths[i] for i in idx], budget, [groups[i] for i in idx], prompts, packed)
    else:
        parts = pack([lengths[i] for i in idx], budget, packed=packed)
    mbs = [collate(samples.completions, [idx[k] for k in g], pad_id, by_prompt, packed) for g in parts]
    for mb in mbs:
        if mb.shared is not None and mb.packed is not None and not prompt_once_pays(mb.shared, mb.packed):
            mb.shared = None
    return mbs


def prompt_once_pays(shared: SharedPrompts, packed: Packed) -> bool:
    """Whether the prompt-once layout runs fewer positions than the padding-free one of the same rows: its distinct
    prompts x their longest, plus each bucket's rows x its width and `BUCKET_PASS_TOKENS` for each bucket's pass
    (the prompts' pass is the one pass the padding-free layout runs too), against the sum of the rows' lengths."""
    once = shared.ids.numel() + sum(len(rows) * width + BUCKET_PASS_TOKENS for rows, width in shared.buckets)
    return once < packed.ids.shape[1]


def dummy_micro_batch(pad_id: int = 0) -> MicroBatch:
    """One padding token with a zero mask: a forward/backward that adds nothing to any loss or statistic.

    Sharded training (FSDP/TP) needs every rank to run the same number of passes (they are collectives); a rank
    with fewer micro-batches in a mini-batch than its peers runs these. Its old, reference and teacher logprobs are
    set (zeros) so it can enter an update without having been through `prepare`. It carries the padding-free layout
    too: one row end to end is the row itself, so it runs the same in either layout.
    """
    # two tokens: a one-token "prompt" and a one-token "completion", the smallest shape the logprob code handles
    ids = torch.full((1, 2), pad_id, dtype=torch.long)
    zeros = torch.zeros((1, 1), dtype=torch.float32)
    return MicroBatch([], ids, torch.ones_like(ids), torch.arange(2).view(1, 2), ids[:, 1:].clone(), zeros.clone(),
                      zeros.clone(), old_logprobs=zeros.clone(), ref_logprobs=zeros.clone(),
                      teacher_logprobs=zeros.clone(), packed=_packed([[pad_id]], [[pad_id]], 1))
