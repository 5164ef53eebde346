"""The padding-free layout: a micro-batch's rows end to end, each attending to itself only; the same logprobs,
entropies and gradients as the padded layout in every zoo architecture whose profile packs, sized by real tokens,
and the prompt-once layout kept only where it runs fewer positions."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import zoo_models  # noqa: E402

from tandem.architectures import SUPPORT, profile  # noqa: E402
from tandem.modeling import load_causal_lm  # noqa: E402
from tandem.samples import Completion, Samples  # noqa: E402
from tandem.train.batch import collate, dummy_micro_batch, make_micro_batches, pack, prompt_once_pays  # noqa: E402
from tandem.train.logprobs import token_logprobs  # noqa: E402

# fp32: packed and padded sum the same terms in other orders (other matrix shapes), so they agree to float rounding
LOGPROB_TOL = 1e-5  # absolute, on logprobs and entropies
GRAD_TOL = 1e-5  # relative to the largest entry of each parameter's gradient (at least 1)


def _completions(vocab: int = 200) -> list[Completion]:
    """Rows of uneven prompts and completions (one completion empty, one a single token), a loss mask that drops a
    token: what a step's micro-batch holds."""
    g = torch.Generator().manual_seed(0)
    shapes = [(5, 7), (9, 3), (3, 12), (14, 1), (6, 0), (4, 6)]
    out = []
    for k, (p, c) in enumerate(shapes):
        ids = torch.randint(5, vocab, (p + c,), generator=g).tolist()
        out.append(Completion(ids[:p], ids[p:], [0.0] * c, "", "stop", k,
                              loss_mask=[1, 1, 0, 1, 1, 1] if k == 5 else None))
    return out


def test_the_packed_layout_lays_rows_end_to_end():
    """ids are the rows' tokens in order, positions restart at each row, and each kept logit's position is the one
    before its target's, which `at` finds in the right-aligned [b, T] targets."""
    comps = _completions()
    mb = collate(comps, list(range(len(comps))), 0, packed=True)
    p, (b, T) = mb.packed, mb.targets.shape
    seqs = [c.prompt_ids + c.completion_ids for c in comps]
    assert p.ids.tolist() == [[t for s in seqs for t in s]]
    assert p.positions.tolist() == [[i for s in seqs for i in range(len(s))]]
    assert p.lengths.tolist() == [len(s) for s in seqs]
    assert p.keep.shape == p.at.shape == (sum(len(c.completion_ids) for c in comps),)
    assert bool((p.keep[1:] > p.keep[:-1]).all())
    assert torch.equal(p.ids[0, p.keep + 1], mb.targets.flatten()[p.at])
    placed = torch.zeros(b * T)
    placed[p.at] = 1
    assert torch.equal(placed.view(b, T), _completion_columns(comps, T))  # every completion token, once
    dummy = dummy_micro_batch()
    assert dummy.packed.ids.shape == (1, 2) and dummy.packed.keep.tolist() == [0] and dummy.packed.at.tolist() == [0]


def _completion_columns(comps: list[Completion], T: int) -> torch.Tensor:
    """[b, T] 1 on each row's completion columns (right-aligned)."""
    return torch.tensor([[0.0] * (T - len(c.completion_ids)) + [1.0] * len(c.completion_ids) for c in comps])


def _run(model, mb, packed: bool) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Logprobs, entropies (with their gradient) and the gradients of a loss that weighs every token differently."""
    model.zero_grad()
    logp, entropy = token_logprobs(model, mb, 0.7, with_entropy=True, entropy_grad=True, packed=packed)
    weights = torch.linspace(-1, 1, logp.numel()).view_as(logp)
    ((logp * weights + 0.1 * entropy) * mb.mask).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logp.detach(), entropy.detach(), grads


@pytest.mark.parametrize("arch", zoo_models.ARCHITECTURES)
def test_every_zoo_architecture_packs_or_its_profile_says_why(arch, tmp_path):
    """Where the profile packs, packed and padded give the same logprobs, entropies and gradients (fp32, within
    LOGPROB_TOL and GRAD_TOL); where it does not, `Support.no_packing` says why, and the packed forward would indeed
    differ (its rows would read each other): the profile is needed, not merely careful."""
    path = zoo_models.build(tmp_path / arch, arch)
    prof = profile(path)
    assert prof.packs == (not SUPPORT[arch].no_packing)
    model = load_causal_lm(str(path)).train()
    comps = _completions()
    mb = collate(comps, list(range(len(comps))), 0, packed=True)
    padded = _run(model, mb, packed=False)
    packed = _run(model, mb, packed=True)
    diff = ((packed[0] - padded[0]).abs() * mb.mask).max()
    if not prof.packs:
        assert diff > 1e-3, f"{arch} packs after all: drop its Support.no_packing"
        return
    assert diff < LOGPROB_TOL
    assert ((packed[1] - padded[1]).abs() * mb.mask).max() < LOGPROB_TOL
    assert padded[2].keys() == packed[2].keys()
    for name, g in padded[2].items():
        assert (g - packed[2][name]).abs().max() < GRAD_TOL * max(1.0, float(g.abs().max())), name


def test_a_row_that_sees_its_neighbour_is_caught(tmp_path):
    """The equality above detects cross-row attention: the same packed ids with positions that do not restart (one
    long sequence: every row attends to the rows before it) move the logprobs of every row but the first by more
    than 1e-3; restarting, they match the padded layout's within LOGPROB_TOL."""
    model = load_causal_lm(str(zoo_models.build(tmp_path / "llama", "llama")))
    comps = _completions()
    mb = collate(comps, list(range(len(comps))), 0, packed=True)
    with torch.no_grad():
        padded = token_logprobs(model, mb, 1.0, packed=False)[0]
        assert ((token_logprobs(model, mb, 1.0)[0] - padded).abs() * mb.mask).max() < LOGPROB_TOL
        mb.packed.positions = torch.arange(mb.packed.ids.shape[1]).view(1, -1)
        leaked = token_logprobs(model, mb, 1.0)[0]
    per_row = ((leaked - padded).abs() * mb.mask).amax(dim=1)
    assert per_row[0] < LOGPROB_TOL  # the first row has no row before it
    assert all(per_row[r] > 1e-3 for r in range(1, len(comps)) if comps[r].completion_ids)


def test_pack_sizes_packed_micro_batches_by_their_real_tokens():
    """One long row among short ones: padded, the short rows pay the long one's width (rows x longest); packed, only
    their own tokens, so all fit one micro-batch."""
    lengths, budget = [10, 2, 2, 2], 16
    assert pack(lengths, budget) == [[1, 2, 3], [0]]  # 4 x 10 > 16
    assert pack(lengths, budget, packed=True) == [[0, 1, 2, 3]]  # 16 real tokens
    assert pack(lengths + [1], budget, packed=True) == [[1, 2, 3, 4], [0]]  # 17 > 16: split
    comps = _completions()
    samples = Samples.of_call(comps, len(comps))
    for budget in (20, 32, 64):
        for mb in make_micro_batches(samples, budget, 0, packed=True):
            assert mb.packed.ids.shape[1] <= budget or len(mb.rows) == 1


def _group(prompt: int, completions: list[int], k: int) -> list[Completion]:
    return [Completion(list(range(1, prompt + 1)), [7] * n, [0.0] * n, "", "stop", k) for n in completions]


def test_the_prompt_once_layout_is_kept_where_it_runs_fewer_positions():
    """A long prompt's group of short completions runs its prompt once (fewer positions than every row whole); short
    prompts with completions of very different widths run padding-free (prompt-once pads each bucket of rows to its
    widest and pays a pass per bucket)."""
    long_prompt = Samples.of_call(_group(40, [3, 4, 3, 5], 0), 1)
    (mb,) = make_micro_batches(long_prompt, 4096, 0, by_prompt=True, packed=True)
    assert mb.shared is not None and prompt_once_pays(mb.shared, mb.packed)
    ragged = Samples.of_call(_group(2, [1, 40, 3, 90], 0), 1)
    (mb,) = make_micro_batches(ragged, 4096, 0, by_prompt=True, packed=True)
    assert mb.shared is None and mb.packed is not None
    (mb,) = make_micro_batches(ragged, 4096, 0, by_prompt=True)  # padded: prompt-once whenever a prompt repeats
    assert mb.shared is not None
