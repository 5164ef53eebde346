"""Context parallel (Ulysses): a packed sequence's split, the attention over the whole sequence from chunks (GQA,
sliding windows), and training under cp = 2 (dp 1, dp 2, with tp 2) equal to one process's, on the zoo's dense models.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # conftest's tiny-model helper, also in children
from conftest import free_port, save_tiny_model  # noqa: E402
import zoo_models  # noqa: E402

from tandem.config import AlgoConfig, OldLogprobs, OptimConfig  # noqa: E402
from tandem.rollout.base import Completion, Samples  # noqa: E402
from tandem.train.batch import Packed, make_micro_batches  # noqa: E402

ROWS, BUDGET = 6, 40  # tokens per packed micro-batch: several micro-batches, rows cut across the cp chunks
SPLIT = {0: [0, 1, 2, 3, 4], 1: [5]}  # dp rank -> its rows (uneven: rank 1 runs padding passes)
# fp32 on CPU; the cp ranks' partial gradients and the whole-sequence attention add in another order than one
# process. Losses and stats: measured <= 5.6e-6 relative (Phi-3), 1e-5 is the zoo's bound (test_parallel); the first
# step's KL (~3e-5: the reference is the policy before it) has rounding relative to 1, so 1e-8 absolute beside.
# Weights after 3 AdamW steps of lr 1e-3: measured <= 1.4e-5 apart (Adam divides by sqrt(v), so a rounding-level
# gradient difference on a tiny gradient moves an element by a visible fraction of its step); 5e-5 is 5% of the
# 1e-3 a step moves one, far below a wrong gradient's difference (the gradient norm is compared too).
LOSS_RTOL, ATOL, STATS_ATOL = 1e-5, 5e-5, 1e-8
# Llama: GQA, rope scaling; Qwen3: q/k norms; Phi-3: fused qkv; Gemma 3: a sliding window shorter than the rows
ZOO = ("llama", "qwen3", "gemma", "mistral", "phi3", "gemma3_text")


def _completions(seed: int) -> tuple[list[Completion], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(ROWS):
        p, c = 3 + int(torch.randint(0, 6, (1,), generator=g)), 2 + int(torch.randint(0, 9, (1,), generator=g))
        ids = torch.randint(3, 250, (p + c,), generator=g).tolist()
        lps = (-torch.rand(c, generator=g) * 3).tolist()
        out.append(Completion(ids[:p], ids[p:], lps, "", "stop", prompt_index=i // 2))
    return out, torch.randn(ROWS, generator=g)


def _policy(model_dir: str, mesh=None, agg: str = "token_mean"):
    from tandem.train.policy import Policy

    torch.manual_seed(0)
    return Policy(model_dir, "float32", False, AlgoConfig(kl_coef=0.1, loss_agg=agg),
                  OptimConfig(lr=1e-3, grad_clip=0.5), 3, 1.0, 16, mesh=mesh)


def _step(rows: list[int] | None, seeds: list[int]):
    parts = [_completions(seed) for seed in seeds]
    samples = Samples.of_call(parts[0][0])
    for comps, _ in parts[1:]:
        samples = samples.concat(Samples.of_call(comps))
    subset = list(range(ROWS)) if rows is None else rows
    minis = [make_micro_batches(samples, BUDGET, 0, [k * ROWS + r for r in subset], packed=True) if subset else []
             for k in range(len(seeds))]
    return minis, torch.cat([adv for _, adv in parts]), len(samples)


def _train(policy, rows: list[int] | None) -> list[float]:
    """3 optimizer steps: 2 mini-batches off-policy (old and reference forwards), then one on-policy."""
    minis, adv, n = _step(rows, [1, 2])
    stats = policy.update(policy.prepare(minis, n), adv)
    # the gradient's norm before clipping: clipping and Adam would hide a gradient off by a constant factor
    losses = list(policy.last_losses) + [stats["entropy"], stats["kl"], stats["grad_norm"]]
    minis, adv, n = _step(rows, [3])
    policy.old_logprobs = OldLogprobs.CURRENT
    policy.update(policy.prepare(minis, n), adv)
    return losses + list(policy.last_losses)


def _trained(model_dir: str, mesh, rows, agg: str = "token_mean") -> dict:
    policy = _policy(model_dir, mesh, agg)
    out = {"losses": _train(policy, rows), "weights": policy.full_state_dict()}
    if mesh is not None:
        from tandem.sync.layout import layout_from_dtensors
        from tandem.sync.planner import plan_to_replicas
        from tandem.sync.reshard import Resharder

        named = dict(policy.named_weights())
        layout = layout_from_dtensors(named, row_orders=policy.tp.row_orders)
        out["synced"] = Resharder(plan_to_replicas(layout, range(mesh.size()))).run(named)
    return out


def _two(rank: int, world: int, port: int, model_dir: str, out_dir: str, zoo: dict[str, str]) -> None:
    """dp 1 x cp 2: the tiny Qwen2 under two loss aggregations, and the zoo's dense models."""
    import torch.distributed as dist

    from tandem.train.parallel import build_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    mesh = build_mesh([0, 1], 1, 1, "cpu", cp=2)
    result = {"qwen2": _trained(model_dir, mesh, None),
              "qwen2_seq_mean": _trained(model_dir, mesh, None, "seq_mean_token_mean")}
    result.update({arch: _trained(path, mesh, None) for arch, path in zoo.items()})
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def _four(rank: int, world: int, port: int, model_dir: str, out_dir: str) -> None:
    """dp 2 x cp 2, then dp 1 x cp 2 x tp 2, on the tiny Qwen2 (4 heads, 2 KV heads: under tp 2 each rank's one KV
    head is copied to its query heads)."""
    import torch.distributed as dist

    from tandem.train.parallel import build_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    mesh = build_mesh([0, 1, 2, 3], 2, 1, "cpu", cp=2)
    result = {"dp2cp2": _trained(model_dir, mesh, SPLIT[rank // 2])}
    mesh = build_mesh([0, 1, 2, 3], 1, 2, "cpu", cp=2)
    result["cp2tp2"] = _trained(model_dir, mesh, None)
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def _same(got: dict, want: dict, what: str) -> None:
    torch.testing.assert_close(got["losses"], want["losses"], rtol=LOSS_RTOL, atol=STATS_ATOL,
                               msg=lambda m: f"{what}: {m}")
    assert got["weights"].keys() == want["weights"].keys()
    for k, w in want["weights"].items():
        torch.testing.assert_close(got["weights"][k], w, rtol=0, atol=ATOL, msg=lambda m, k=k: f"{what}: {k}: {m}")
    # what a colocated sync gives each engine is the trainer's weights exactly
    assert got["synced"] and all(torch.equal(t, got["weights"][k]) for k, t in got["synced"].items()), what


def test_context_parallel_training_matches_one_process(tmp_path, monkeypatch):
    import torch.multiprocessing as mp

    model_dir = str(save_tiny_model(tmp_path / "model", layers=2))
    zoo = {arch: str(zoo_models.build(tmp_path / arch, arch)) for arch in ZOO}
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    mp.spawn(_two, args=(2, free_port(), model_dir, str(tmp_path), zoo), nprocs=2, join=True)
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    want = {"qwen2": _trained(model_dir, None, None),
            "qwen2_seq_mean": _trained(model_dir, None, None, "seq_mean_token_mean")}
    want.update({arch: _trained(path, None, None) for arch, path in zoo.items()})
    for r, res in enumerate(results):
        for name, w in want.items():
            _same(res[name], w, f"{name} under dp 1 x cp 2, rank {r}")


def test_context_parallel_with_data_and_tensor_parallel_matches_one_process(tmp_path, monkeypatch):
    import torch.multiprocessing as mp

    model_dir = str(save_tiny_model(tmp_path / "model", layers=2))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    mp.spawn(_four, args=(4, free_port(), model_dir, str(tmp_path)), nprocs=4, join=True)
    want = _trained(model_dir, None, None)
    for r in range(4):
        res = torch.load(tmp_path / f"rank{r}.pt", weights_only=False)
        _same(res["dp2cp2"], want, f"dp 2 x cp 2, rank {r}")
        _same(res["cp2tp2"], want, f"cp 2 x tp 2, rank {r}")


def _packed(lengths: list[int], prompts: list[int]) -> Packed:
    """Rows of these lengths end to end (ids 100 + their index), each completing after its prompt's length."""
    from tandem.train.batch import collate

    rows = [Completion(list(range(p)), list(range(n - p)), [0.0] * (n - p), "", "stop", prompt_index=0)
            for n, p in zip(lengths, prompts)]
    p = collate(rows, list(range(len(rows))), 0, packed=True).packed
    p.ids = 100 + torch.arange(p.ids.shape[1]).view(1, -1)
    return p


def test_split_gives_each_rank_a_contiguous_chunk_and_the_logits_it_holds():
    """Chunks end to end are the sequence padded to a multiple of cp; every kept logit is scored by the one rank
    holding it, a chunk's last one included (its token is the next chunk's first: found by `at`, global)."""
    from tandem.train.context_parallel import split

    p = _packed([5, 4, 4], [2, 3, 1])  # 13 tokens: 3 of padding at the end for cp 4
    chunks = [split(p, r, 4) for r in range(4)]
    assert torch.equal(torch.cat([c.ids for c in chunks], dim=1)[:, :13], p.ids)
    assert [c.ids.shape[1] for c in chunks] == [4] * 4
    assert torch.equal(torch.cat([c.positions for c in chunks], dim=1), torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 0,
                                                                                         1, 2, 3, 0, 1, 2]]))
    assert torch.equal(chunks[0].segments, torch.tensor([0] * 5 + [1] * 4 + [2] * 4 + [3] * 3))
    kept = torch.cat([c.keep + 4 * r for r, c in enumerate(chunks)])
    assert torch.equal(kept, p.keep) and torch.equal(torch.cat([c.at for c in chunks]), p.at)
    assert 3 in chunks[0].keep.tolist()  # position 3 predicts position 4's token, in the same chunk ...
    assert 3 in chunks[1].keep.tolist()  # ... position 7 (chunk 1's last) predicts position 8's, chunk 2's first


def _attention(rank: int, world: int, port: int, out_dir: str) -> None:
    """Each rank's chunk through `_attend` against the whole sequence's attention, forward and backward."""
    import torch.distributed as dist

    from tandem.train import context_parallel as cp

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    group = dist.new_group([0, 1])
    p = _packed([7, 6, 3], [2, 2, 1])  # 16 tokens, rows across the chunk boundary
    chunk = cp.split(p, rank, 2)
    n, result = chunk.ids.shape[1], {}
    module = torch.nn.Module()
    for heads, kv, window in ((4, 2, None), (4, 1, None), (4, 4, 3)):  # GQA; fewer KV heads than ranks; a window
        g = torch.Generator().manual_seed(heads * 10 + kv)
        q, k, v = (torch.randn(1, h, 16, 8, generator=g) for h in (heads, kv, kv))
        mine = [x[:, :, rank * n:(rank + 1) * n].clone().requires_grad_() for x in (q, k, v)]
        with cp._running(cp._Sequence(group, chunk.segments, {})):
            out, _ = cp._attend(module, *mine, None, scaling=0.5, sliding_window=window)
        out.square().sum().backward()
        result[(heads, kv, window)] = (out.detach(), [x.grad for x in mine])
    torch.save(result, Path(out_dir) / f"attn{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def _reference(p: Packed, q, k, v, window, scaling: float, rows_only: int | None = None):
    """sdpa over the whole sequence, each row causal within itself; `rows_only`: also within chunks of that many
    positions (what a rank attending to its own chunk only would compute)."""
    seg = torch.repeat_interleave(torch.arange(len(p.lengths)), p.lengths)
    i = torch.arange(len(seg))
    allowed = (seg[:, None] == seg[None, :]) & (i[None, :] <= i[:, None])
    if window is not None:
        allowed &= i[:, None] - i[None, :] < window
    if rows_only is not None:
        allowed &= (i[:, None] // rows_only) == (i[None, :] // rows_only)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scaling,
                                                           enable_gqa=k.shape[1] != q.shape[1])
    return out.transpose(1, 2)


def test_ulysses_attention_equals_the_whole_sequence_attention(tmp_path, monkeypatch):
    """Outputs and q/k/v gradients of each rank's chunk equal those of one whole-sequence attention; and they would
    not if a chunk attended within itself only (the data's rows cross the chunks)."""
    import torch.multiprocessing as mp

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    mp.spawn(_attention, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    got = [torch.load(tmp_path / f"attn{r}.pt", weights_only=False) for r in range(2)]
    p = _packed([7, 6, 3], [2, 2, 1])
    for (heads, kv, window), _ in got[0].items():
        g = torch.Generator().manual_seed(heads * 10 + kv)
        whole = [x.requires_grad_() for x in (torch.randn(1, h, 16, 8, generator=g) for h in (heads, kv, kv))]
        out = _reference(p, *whole, window, 0.5)
        out.square().sum().backward()
        torch.testing.assert_close(torch.cat([got[r][(heads, kv, window)][0] for r in range(2)], dim=1), out,
                                   rtol=1e-5, atol=1e-6)
        for i, x in enumerate(whole):
            torch.testing.assert_close(torch.cat([got[r][(heads, kv, window)][1][i] for r in range(2)], dim=2),
                                       x.grad, rtol=1e-5, atol=1e-6)
        local = _reference(p, *(x.detach() for x in whole), window, 0.5, rows_only=8)
        assert not torch.allclose(local, out.detach(), atol=1e-3)


def test_ulysses_attention_outside_a_context_parallel_forward_says_so():
    from tandem.train.context_parallel import _attend

    x = torch.zeros(1, 2, 4, 8)
    with pytest.raises(RuntimeError, match="inside a context-parallel forward"):
        _attend(torch.nn.Module(), x, x, x, None)
