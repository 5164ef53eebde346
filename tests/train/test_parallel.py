"""Sharded training (FSDP2, FSDP+TP; Qwen3 and Phi-3 under FSDP+TP too) matches one process; offload keeps training
bit-identical; engine sleep/wake; a fused weight's block-ordered shards read as Hugging Face slices."""
from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # conftest's tiny-model helper, also in children
from conftest import free_port, save_tiny_model  # noqa: E402
import zoo_models  # noqa: E402

from tandem.config import AlgoConfig, OldLogprobs, OptimConfig  # noqa: E402
from tandem.rollout.base import Completion, Samples, Sampling  # noqa: E402
from tandem.train.batch import make_micro_batches  # noqa: E402
from tandem.train.policy import GROUPS  # noqa: E402

ROWS = 6
BUDGET = 30  # tokens per micro-batch: rank 0's five rows need several micro-batches, rank 1's one row needs one
# dp rank -> its rows of each mini-batch: deliberately uneven, so rank 1 runs dummy micro-batches
SPLIT = {0: [0, 1, 2, 3, 4], 1: [5]}
# fp32 on CPU, sharded reductions add in another order. Losses: measured ~1e-7 relative. Weights: measured up to
# 5e-7 absolute after 3 AdamW steps of lr 1e-3 (Adam divides by sqrt(v), so a rounding-level gradient difference on
# an element with a tiny gradient becomes a visible fraction of its step): 2e-6 is 0.07% of the 3e-3 moved.
LOSS_RTOL, RTOL, ATOL = 1e-6, 1e-5, 2e-6
# Architectures whose TP plan is more than plain column and row splits, here under FSDP x TP, where the gradients
# summed over tp are dp shards and the block-ordered fused rows are cut again by dp: Qwen3 (per-head q_norm/k_norm
# gradients summed over tp) and Phi-3 (qkv_proj and gate_up_proj split by parts, GQA). Losses: measured <= 3.5e-7
# relative, 1.3e-4 with Qwen3's sum left out, 3.3e-3 with Phi-3's parts split as one; the zoo's 1e-5 sits between.
# Weights are compared loosely: the losses catch a wrong gradient, the weights rows in the wrong order (off by the
# weights themselves, ~0.1); AdamW moves an element by at most ~lr per step, so 3 steps of lr 1e-3 stay within 6e-3
# of each other however rounding-level gradient differences are amplified (seen: 1.3e-5).
ZOO_TP, ZOO_LOSS_RTOL, ZOO_ATOL = ("qwen3", "phi3"), 1e-5, 6e-3


def _completions(seed: int) -> tuple[list[Completion], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(ROWS):
        p, c = 3 + int(torch.randint(0, 4, (1,), generator=g)), 2 + int(torch.randint(0, 6, (1,), generator=g))
        ids = torch.randint(3, 250, (p + c,), generator=g).tolist()
        lps = (-torch.rand(c, generator=g) * 3).tolist()
        out.append(Completion(ids[:p], ids[p:], lps, "", "stop", prompt_index=i // 2))
    return out, torch.randn(ROWS, generator=g)


def _policy(model_dir: str, mesh=None):
    from tandem.train.policy import Policy

    torch.manual_seed(0)
    return Policy(model_dir, "float32", False, AlgoConfig(kl_coef=0.1), OptimConfig(lr=1e-3, grad_clip=0.5), 3,
                  1.0, 8, mesh=mesh)


def _step(rows: list[int] | None, seeds: list[int], packed: bool = True):
    """A step of one mini-batch per seed (each seed's completions); `rows` of each are this rank's share, laid out
    padding-free where `packed` (the policy's `padding_free`, as TrainWorker lays them out)."""
    parts = [_completions(seed) for seed in seeds]
    samples = Samples.of_call(parts[0][0])
    for comps, _ in parts[1:]:
        samples = samples.concat(Samples.of_call(comps))
    subset = list(range(ROWS)) if rows is None else rows
    minis = [make_micro_batches(samples, BUDGET, 0, [k * ROWS + r for r in subset], packed=packed) if subset else []
             for k in range(len(seeds))]
    return minis, torch.cat([adv for _, adv in parts]), len(samples)


def _train(policy, rows: list[int] | None, between=None) -> list[float]:
    """3 optimizer steps: one call with 2 mini-batches (off-policy: old + reference forwards), then one on-policy."""
    minis, adv, n = _step(rows, [1, 2], policy.padding_free)
    policy.update(policy.prepare(minis, n), adv)
    losses = list(policy.last_losses)
    if between is not None:
        between(policy)
    minis, adv, n = _step(rows, [3], policy.padding_free)
    policy.old_logprobs = OldLogprobs.CURRENT  # one mini-batch, mu 1: what Config.old_logprobs picks
    policy.update(policy.prepare(minis, n), adv)
    return losses + list(policy.last_losses)


def _offload_roundtrip(policy) -> None:
    policy.to_host(*GROUPS)
    report = policy.residency()
    assert all(v == 0 for v in report.values()), report
    assert all(p.to_local().untyped_storage().nbytes() == 0 for p in policy.model.parameters())
    policy.to_device(*GROUPS)
    assert policy.residency()["params"] > 0 and policy.residency()["optim"] > 0
    # this rank's optimizer shards survive a save/load (as plain tensors) and training goes on unchanged
    buf = io.BytesIO()
    torch.save(policy.state_dict(), buf)
    policy.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=False))


def _synced(policy) -> dict[str, torch.Tensor]:
    """What a colocated sync gives each of the 4 ranks' engines: the trainer's layout (with the fused weights' row
    orders, as TrainWorker.weight_layout reads it) planned whole onto every rank, resharded."""
    from tandem.sync.layout import layout_from_dtensors
    from tandem.sync.planner import plan_to_replicas
    from tandem.sync.reshard import Resharder

    named = dict(policy.named_weights())
    layout = layout_from_dtensors(named, row_orders=policy.tp.row_orders)
    return Resharder(plan_to_replicas(layout, range(4))).run(named)


def _worker(rank: int, world: int, port: int, model_dir: str, out_dir: str, zoo: dict[str, str]) -> None:
    import torch.distributed as dist

    from tandem.train.parallel import build_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    result = {}
    mesh = build_mesh([0, 1, 2, 3], 2, 2, "cpu")
    policy = _policy(model_dir, mesh)
    result["dp2tp2_losses"] = _train(policy, SPLIT[policy.dp_rank], between=_offload_roundtrip)
    result["dp2tp2_weights"] = policy.full_state_dict()
    for arch, path in zoo.items():
        policy = _policy(path, mesh)
        result[f"{arch}_losses"] = _train(policy, SPLIT[policy.dp_rank])
        result[f"{arch}_weights"] = policy.full_state_dict()
        result[f"{arch}_synced"] = _synced(policy)
    del policy
    # A mesh over ranks 0-1 only: ranks 2-3 (say, samplers in a split placement) take no part in building it.
    if rank < 2:
        mesh = build_mesh([0, 1], 2, 1, "cpu")
        policy = _policy(model_dir, mesh)
        result["dp2_losses"] = _train(policy, SPLIT[policy.dp_rank])
        result["dp2_weights"] = policy.full_state_dict()
        # full HF weights (tied LM head stored once, as HF saves it) load into the sharded model
        shifted = {k: v + 1 for k, v in result["dp2_weights"].items() if k != "lm_head.weight"}
        policy.load_full_state_dict(shifted)
        back = policy.full_state_dict()
        assert all(torch.equal(back[k], v) for k, v in shifted.items()) and torch.equal(back["lm_head.weight"],
                                                                                       shifted["model.embed_tokens.weight"])
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def _close(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=RTOL, atol=ATOL, msg=lambda m, k=k: f"{k}: {m}")


def test_sharded_training_matches_one_process(tmp_path, monkeypatch):
    import torch.multiprocessing as mp

    model_dir = str(save_tiny_model(tmp_path / "model", layers=2))
    zoo = {arch: str(zoo_models.build(tmp_path / arch, arch)) for arch in ZOO_TP}
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    mp.spawn(_worker, args=(4, free_port(), model_dir, str(tmp_path), zoo), nprocs=4, join=True)

    single = _policy(model_dir)
    losses = _train(single, None)
    weights = single.full_state_dict()
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(4)]
    for r, res in enumerate(results):
        if r < 2:
            torch.testing.assert_close(res["dp2_losses"], losses, rtol=LOSS_RTOL, atol=0)
            _close(res["dp2_weights"], weights)
        torch.testing.assert_close(res["dp2tp2_losses"], losses, rtol=LOSS_RTOL, atol=0)
        _close(res["dp2tp2_weights"], weights)
    for arch, path in zoo.items():
        single = _policy(path)
        losses, weights = _train(single, None), single.full_state_dict()
        for r, res in enumerate(results):
            torch.testing.assert_close(res[f"{arch}_losses"], losses, rtol=ZOO_LOSS_RTOL, atol=0,
                                       msg=lambda m, a=arch: f"{a} under dp 2 x tp 2: {m}")
            assert res[f"{arch}_weights"].keys() == weights.keys()
            for k, w in weights.items():
                torch.testing.assert_close(res[f"{arch}_weights"][k], w, rtol=0, atol=ZOO_ATOL,
                                           msg=lambda m, a=arch, r=r, k=k: f"{a} rank {r}: {k}: {m}")
            synced = res[f"{arch}_synced"]
            assert synced.keys() <= weights.keys() and len(synced) > 0
            assert all(torch.equal(t, res[f"{arch}_weights"][k]) for k, t in synced.items()), (arch, r)


def test_offload_is_exact_and_engine_sleeps(tmp_path):
    from tandem.rollout.hf import HFEngine

    model_dir = str(save_tiny_model(tmp_path / "model"))
    plain, moved = _policy(model_dir), _policy(model_dir)

    def roundtrip(policy) -> None:
        # gradients exist only between backward and step: make some, so the grads group has something to move
        mb = _step(None, [4])[0][0][0]
        from tandem.train.logprobs import token_logprobs

        token_logprobs(policy.model, mb, 1.0)[0].sum().backward()
        grads = [p.grad.clone() for p in policy.params]
        policy.to_host(*GROUPS)
        report = policy.residency()
        assert report == dict.fromkeys(GROUPS, 0), report
        assert all(p.untyped_storage().nbytes() == 0 for p in policy.params)
        assert all(p.grad.untyped_storage().nbytes() == 0 for p in policy.params)
        policy.to_device(*GROUPS)
        assert all(torch.equal(p.grad, g) for p, g in zip(policy.params, grads))
        policy.optimizer.zero_grad(set_to_none=True)

    assert _train(plain, None) == _train(moved, None, between=roundtrip)
    for (n, a), (_, b) in zip(plain.model.named_parameters(), moved.model.named_parameters()):
        assert torch.equal(a, b), n

    engine = HFEngine(model_dir)
    prompts, sampling = [[5, 6, 7], [8, 9]], Sampling(n=2, max_new_tokens=5, seed=3)
    engine.load_weights(moved.named_weights())
    before = engine.generate(prompts, sampling)
    released = engine.sleep()
    assert released > 0 and sum(p.untyped_storage().nbytes() for p in engine.model.parameters()) == 0
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(prompts, sampling)
    assert engine.wake() == released
    engine.load_weights(moved.named_weights())
    after = engine.generate(prompts, sampling)
    assert [c.completion_ids for c in after] == [c.completion_ids for c in before]


def test_a_fused_weight_in_block_order_is_described_by_its_parts_under_fsdp_and_tp():
    """A GQA [q | k | v] weight (q 16 rows, k and v 4) stored in block order and sharded as FSDP2 over TP shards it
    ((dp, tp) placements _StridedShard(0, tp), Shard(0) of the block-ordered rows) is read, with its row order, as
    the planner's fused layout of the Hugging Face tensor: each rank its dp chunk of its tp chunk of each part
    (`build_layout`, Spec(parts=...)), here with dp chunks that cut a part in two."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from tandem.sync.layout import Mesh, ParamLayout, Spec, build_layout, dtensor_shards, local_tensor
    from tandem.train.parallel import block_order

    parts, shape, dp, tp = (16, 4, 4), (24, 3), 2, 2
    order = block_order(parts, tp)
    full = torch.arange(24 * 3, dtype=torch.float32).view(shape)
    stored = full[order]
    got = ParamLayout(shape, torch.float32, dtensor_shards(shape, torch.arange(dp * tp).view(dp, tp),
                                                           [_StridedShard(0, split_factor=tp), Shard(0)], rows=order))
    want = build_layout({"w": (shape, torch.float32)}, Mesh.of(dp=dp, tp=tp), Spec(tp_dim=0, parts=parts, zero="dim0"))
    for rank in range(dp * tp):
        i, j = divmod(rank, tp)
        # what the rank really holds: dp chunk i of tp chunk j of the stored rows (FSDP2 over TP)
        held = stored.chunk(tp)[j].chunk(dp)[i]
        assert torch.equal(local_tensor(got, rank, full), held), rank
        assert torch.equal(local_tensor(want["w"], rank, full), held), rank
        assert len(got.shards[rank].pieces) == (1 if i == 0 else 3)  # q's first rows; q's last, k's, v's
