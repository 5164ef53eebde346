"""The resharding planner without processes: hand-checked layouts and plans, and properties over random layouts
(complete, each destination element written once, from a rank that holds it, moving exactly the lower bound)."""
from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from qwen2_shape import Qwen2Shape
from tandem.sync.layout import (Mesh, ModelLayout, ParamLayout, Spec, build_layout, chunk, flat_chunk, full_shard,
                                local_tensor, replicated_layout, slices, take)
from tandem.sync.planner import assign_ranks, plan, renumber


def simulate(p, src: ModelLayout, dst: ModelLayout, fulls: dict[str, torch.Tensor]) -> None:
    """Run a plan in memory on element ids and check every property the executor relies on."""
    held = {(n, r): local_tensor(pl, r, fulls[n]) for n, pl in src.items() for r in pl.shards}
    got = {(n, r): torch.full(s.shape, -1, dtype=torch.long) for n, pl in dst.items() for r, s in pl.shards.items()}
    writes = {k: torch.zeros(v.shape, dtype=torch.long) for k, v in got.items()}
    for m in p.moves:
        assert m.src_piece in src[m.name].shards[m.src].pieces, "sent from a piece the sender does not hold"
        assert m.dst_piece in dst[m.name].shards[m.dst].pieces
        src_rel = slices(tuple((a - o, b - o) for (a, b), (o, _) in zip(m.box, m.src_piece.box)))
        values = m.src_piece.view(held[(m.name, m.src)])[src_rel]
        assert torch.equal(values, fulls[m.name][slices(m.box)])
        rel = slices(tuple((a - o, b - o) for (a, b), (o, _) in zip(m.box, m.dst_piece.box)))
        m.dst_piece.view(got[(m.name, m.dst)])[rel].copy_(values)
        m.dst_piece.view(writes[(m.name, m.dst)])[rel].add_(1)
    lower = 0
    for n, pl in dst.items():
        for r, shard in pl.shards.items():
            assert torch.equal(got[(n, r)], local_tensor(pl, r, fulls[n])), f"{n} on rank {r} is wrong"
            assert bool((writes[(n, r)] == 1).all()), (
                f"{n} on rank {r}: an element written {writes[(n, r)].max()} times")
            mask = torch.zeros(pl.shape, dtype=torch.bool)  # what rank r already holds, found independently
            for sp in src[n].shards[r].pieces if r in src[n].shards else ():
                mask[slices(sp.box)] = True
            for dp in shard.pieces:
                lower += int((~mask[slices(dp.box)]).sum()) * src[n].dtype.itemsize
    assert p.lower_bound == lower
    assert p.bytes_moved == lower == sum(m.nbytes for m in p.moves if m.src != m.dst)


def ids(layout: ModelLayout) -> dict[str, torch.Tensor]:
    return {n: torch.arange(torch.Size(pl.shape).numel()).view(pl.shape) for n, pl in layout.items()}


def test_column_split_to_replicas_by_hand():
    src = build_layout({"w": ((4, 2), torch.float32)}, Mesh.of(tp=2), Spec(tp_dim=0))
    dst = replicated_layout({"w": ((4, 2), torch.float32)}, [0, 1])
    p = plan(src, dst)
    assert [(m.src, m.dst, m.box) for m in p.moves] == [
        (0, 0, ((0, 2), (0, 2))), (1, 0, ((2, 4), (0, 2))), (1, 1, ((2, 4), (0, 2))), (0, 1, ((0, 2), (0, 2)))]
    assert p.bytes_moved == p.lower_bound == 2 * 4 * 4 and p.local_bytes == 32
    simulate(p, src, dst, ids(src))


def test_fused_qkv_gqa_split_per_part():
    # q has 4 rows, k and v 2 each: TP rank 1 holds q[2:4], k[1:2], v[1:2] = global rows 2,3,5,7
    layout = build_layout({"qkv": ((8, 3), torch.float32)}, Mesh.of(tp=2), Spec(tp_dim=0, parts=(4, 2, 2)))
    s = layout["qkv"].shards[1]
    assert s.shape == (4, 3)
    assert [(p.box[0], p.local[0]) for p in s.pieces] == [((2, 4), (0, 2)), ((5, 6), (2, 3)), ((7, 8), (3, 4))]


def test_fsdp_chunks_are_uneven_and_may_be_empty():
    layout = build_layout({"w": ((2, 3), torch.float32)}, Mesh.of(dp=4), Spec(zero="dim0"))
    assert [layout["w"].shards[r].shape for r in range(4)] == [(1, 3), (1, 3), (0, 3), (0, 3)]
    assert layout["w"].shards[3].pieces == ()
    layout = build_layout({"w": ((5,), torch.float32)}, Mesh.of(dp=2), Spec(zero="dim0"))
    assert [layout["w"].shards[r].shape for r in range(2)] == [(3,), (2,)]


def test_flat_zero_shard_is_a_few_boxes():
    layout = build_layout({"w": ((3, 4), torch.float32)}, Mesh.of(dp=2), Spec(zero="flat"))
    assert [p.box for p in layout["w"].shards[0].pieces] == [((0, 1), (0, 4)), ((1, 2), (0, 2))]
    assert [p.box for p in layout["w"].shards[1].pieces] == [((1, 2), (2, 4)), ((2, 3), (0, 4))]
    assert layout["w"].shards[1].shape == (6,)


def test_mesh_numbering_tp_fastest_pp_outermost():
    mesh = Mesh.of(pp=2, dp=2, tp=2, base=8)
    assert mesh.coords(8) == {"pp": 0, "dp": 0, "cp": 0, "ep": 0, "tp": 0}
    assert mesh.coords(9)["tp"] == 1 and mesh.coords(10)["dp"] == 1 and mesh.coords(12)["pp"] == 1
    assert list(mesh.ranks) == list(range(8, 16))


def test_pp_and_ep_place_params_on_their_ranks():
    q = Qwen2Shape(vocab=16, hidden=8, layers=2, heads=2, kv_heads=1, intermediate=8, experts=4)
    lay = build_layout(q.params(), Mesh.of(pp=2, ep=2), q.spec(pp=2, ep=2))
    assert set(lay["model.embed_tokens.weight"].shards) == {0, 1}  # stage 0, replicated over ep
    assert set(lay["lm_head.weight"].shards) == {2, 3}
    assert set(lay["model.layers.1.mlp.experts.3.down_proj.weight"].shards) == {3}  # stage 1, ep rank 1
    assert set(lay["model.layers.0.mlp.experts.1.down_proj.weight"].shards) == {0}


def test_replica_sources_share_the_sending():
    # Four full replicas feed four other ranks: each sender carries a quarter, within one parameter.
    params = {f"w{i}": ((8, 4), torch.float32) for i in range(16)}
    p = plan(replicated_layout(params, range(4)), replicated_layout(params, range(4, 8)))
    assert p.bytes_moved == p.lower_bound == 16 * 8 * 4 * 4 * 4
    share = p.bytes_moved / 4
    assert max(p.sent.values()) - share <= 8 * 4 * 4


def test_colocated_identical_layouts_copy_only():
    q = Qwen2Shape(vocab=16, hidden=8, layers=1, heads=2, kv_heads=1, intermediate=8)
    lay = build_layout(q.params(), Mesh.of(dp=2, tp=2), q.spec())
    p = plan(lay, lay)
    assert p.bytes_moved == p.lower_bound == 0 and all(m.src == m.dst for m in p.moves)


def random_spec(rng: random.Random, shape: tuple[int, ...], mesh: Mesh) -> Spec:
    tp_dim = rng.choice([None, 0, len(shape) - 1])
    parts = None
    if tp_dim is not None and rng.random() < 0.4 and shape[tp_dim] >= 3:
        a = rng.randint(1, shape[tp_dim] - 2)
        b = rng.randint(1, shape[tp_dim] - a - 1)
        parts = (a, b, shape[tp_dim] - a - b)
    zero = rng.choice([None, "dim0", "flat"]) if mesh.size("dp") > 1 else None
    stage = rng.randrange(mesh.size("pp")) if rng.random() < 0.5 else None
    return Spec(tp_dim=tp_dim, parts=parts, zero=zero, stage=stage)


def random_mesh(rng: random.Random, base: int) -> Mesh:
    sizes = {d: rng.choice([1, 1, 2, 3]) for d in ("pp", "dp", "cp", "tp")}
    return Mesh.of(base=base, **sizes)


@pytest.mark.parametrize("seed", range(6))
def test_random_layouts(seed):
    rng = random.Random(seed)
    for _ in range(40):
        params = {}
        for i in range(rng.randint(1, 4)):
            shape = tuple(rng.randint(1, 7) for _ in range(rng.randint(1, 3)))
            params[f"p{i}"] = (shape, rng.choice([torch.float32, torch.bfloat16, torch.float64]))
        meshes = []
        for _ in range(2):  # source and destination: same, shifted or overlapping rank sets
            mesh = random_mesh(rng, base=rng.choice([0, 0, 1, 3]))
            specs = {n: random_spec(rng, shape, mesh) for n, (shape, _) in params.items()}
            meshes.append(build_layout(params, mesh, lambda n, specs=specs: specs[n]))
        src, dst = meshes
        if rng.random() < 0.3:  # the destination may be plain replicas, as the rollout engines hold them
            dst = replicated_layout(params, range(rng.randint(0, 3), rng.randint(4, 6)))
        simulate(plan(src, dst), src, dst, ids(src))


def test_missing_bytes_are_refused():
    src = ParamLayout((4,), torch.float32, {0: chunk(full_shard((4,)), 0, 2, 0)})
    with pytest.raises(ValueError, match="no source rank holds"):
        plan({"w": src}, replicated_layout({"w": ((4,), torch.float32)}, [1]))


def test_rounds_keep_each_rank_under_the_bucket():
    from tandem.sync.reshard import ALIGN, rounds

    q = Qwen2Shape(vocab=64, hidden=16, layers=2, heads=4, kv_heads=2, intermediate=24)
    src = build_layout(q.params(), Mesh.of(dp=4), Spec(zero="flat"))
    p = plan(src, replicated_layout(q.params(), range(4)))
    for bucket in (64, 256, 1000, 1 << 20):
        cut = rounds(p, bucket)
        for moves in cut:
            use: dict[int, int] = {}
            for m in moves:
                if m.src != m.dst:
                    for r in (m.src, m.dst):
                        use[r] = use.get(r, 0) + -(-m.nbytes // ALIGN) * ALIGN
            assert max(use.values(), default=0) <= bucket
        # split moves still cover exactly what the plan moves
        assert sum(m.nbytes for moves in cut for m in moves if m.src != m.dst) == p.bytes_moved


def test_executor_in_one_process_copies_locally():
    # One rank re-lays its own tensors (fused TP pieces on rank 0 -> a flat shard and a full copy): no process group.
    from tandem.sync.reshard import Resharder

    params = {"qkv": ((8, 3), torch.bfloat16), "b": ((5,), torch.bfloat16)}
    # rows swapped
    src = {"qkv": ParamLayout((8, 3), torch.bfloat16, {0: take(full_shard((8, 3)), 0, [(4, 8), (0, 4)])}),
           "b": ParamLayout((5,), torch.bfloat16, {0: full_shard((5,))})}
    dst = {"qkv": ParamLayout((8, 3), torch.bfloat16, {0: flat_chunk(full_shard((8, 3)), 1, 0)}),
           "b": ParamLayout((5,), torch.bfloat16, {0: take(full_shard((5,)), 0, [(3, 5), (0, 3)])})}
    full = {n: torch.randn(s).to(dt) for n, (s, dt) in params.items()}
    mine = {n: local_tensor(pl, 0, full[n]) for n, pl in src.items()}
    p = plan(src, dst)
    out = {"qkv": torch.zeros(24, dtype=torch.bfloat16)}
    got = Resharder(p, 0).run(mine, out)
    assert got["qkv"].data_ptr() == out["qkv"].data_ptr() and p.bytes_moved == 0
    assert all(torch.equal(got[n], local_tensor(dst[n], 0, full[n])) for n in params)
    streamed = [name for batch in Resharder(p, 0, bucket_bytes=64).stream(mine) for name, _ in batch]
    assert sorted(streamed) == sorted(params)


def test_assigned_numbering_is_the_best_permutation():
    """assign_ranks finds the numbering of the destination with the least traffic (checked against every
    permutation of its ranks), and the renumbered layout is still filled exactly."""
    rng = random.Random(7)
    four = [dict(tp=4), dict(dp=4), dict(dp=2, tp=2), dict(pp=2, tp=2), dict(cp=2, tp=2), dict(pp=2, dp=2)]
    improved = 0
    for _ in range(25):
        params = {f"p{i}": (tuple(rng.randint(2, 8) for _ in range(2)), torch.float32) for i in range(3)}
        meshes = [Mesh.of(**rng.choice(four)) for _ in range(2)]
        specs = [{n: random_spec(rng, shape, m) for n, (shape, _) in params.items()} for m in meshes]
        src, dst = (build_layout(params, m, sp.__getitem__) for m, sp in zip(meshes, specs))
        dst = renumber(dst, dict(zip(range(4), rng.sample(range(4), 4))))  # any numbering, not the mesh's
        ranks = sorted({r for p in dst.values() for r in p.shards})  # all 4, unless pp left a stage empty
        best = min(plan(src, renumber(dst, dict(zip(ranks, perm)))).lower_bound
                   for perm in itertools.permutations(ranks))
        mapping = assign_ranks(src, dst)
        assert sorted(mapping) == sorted(mapping.values()) == ranks
        assigned = renumber(dst, mapping)
        p, as_given = plan(src, assigned), plan(src, dst).lower_bound
        assert p.lower_bound == best <= as_given
        improved += best < as_given
        simulate(p, src, assigned, ids(src))
    assert improved >= 5  # the numbering mattered in enough of the cases for the check to mean something


def test_assigned_numbering_meets_the_dp_fastest_bound_for_tp4_to_dp2_tp2():
    q = Qwen2Shape(vocab=96, hidden=32, layers=2, heads=8, kv_heads=4, intermediate=48)
    model_bytes = sum(math.prod(s) * d.itemsize for s, d in q.params().values())
    src = build_layout(q.params(), Mesh.of(tp=4), q.spec())
    dst = build_layout(q.params(), Mesh.of(dp=2, tp=2), q.spec())  # TP-fastest: ranks 0,1 one TP group
    dp_fastest = build_layout(q.params(), Mesh.of(order=("tp", "dp"), dp=2, tp=2), q.spec())
    as_given, assigned = plan(src, dst), plan(src, renumber(dst, assign_ranks(src, dst)))
    assert assigned.lower_bound == plan(src, dp_fastest).lower_bound < as_given.lower_bound
    # every rank needs half the model and holds a quarter of it: 4 x 1/4 of the model (vs naive 4 x 3/4)
    assert assigned.bytes_moved == assigned.lower_bound
    assert abs(assigned.lower_bound / model_bytes - 1.0) < 0.05 and as_given.lower_bound / model_bytes > 1.4


def test_a_segment_is_mapped_only_when_it_is_the_senders_own(tmp_path):
    """A receiver on another host sees no such file (and must not create one: torch.from_file would); a file of the
    same name that is not the sender's (wrong nonce) is refused too. Either way the pair stays on p2p."""
    from tandem.sync.reshard import _map_segment

    absent = tmp_path / "absent"
    assert _map_segment(f"{absent}|8|{'00' * 16}".encode()) is None and not absent.exists()
    path, nonce = tmp_path / "segment", bytes(range(16))
    seg = torch.from_file(str(path), shared=True, size=8 + 16, dtype=torch.uint8)
    seg[8:] = torch.tensor(list(nonce), dtype=torch.uint8)
    assert _map_segment(f"{path}|8|{'ff' * 16}".encode()) is None
    mapped = _map_segment(f"{path}|8|{nonce.hex()}".encode())
    seg[:8] = 7  # the sender's writes are what the receiver reads
    assert mapped is not None and mapped.tolist() == [7] * 8


def test_a_plan_is_a_value_and_its_executor_keeps_the_state(monkeypatch):
    """Running a plan leaves it as it was (frozen, equal to a fresh one): the rounds, the shared memory and this
    rank's part of each round live on the `Resharder`, worked out on its first run and reused by the next."""
    import dataclasses

    from tandem.sync import reshard as executor

    params = {"w": ((6, 4), torch.float32), "b": ((5,), torch.float32)}
    src = {"w": ParamLayout((6, 4), torch.float32, {0: take(full_shard((6, 4)), 0, [(3, 6), (0, 3)])}),
           "b": ParamLayout((5,), torch.float32, {0: full_shard((5,))})}
    dst = replicated_layout(params, [0])
    full = {n: torch.randn(s) for n, (s, _) in params.items()}
    mine = {n: local_tensor(pl, 0, full[n]) for n, pl in src.items()}
    p = plan(src, dst)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.bytes_moved = 1
    cuts, cut = [], executor.rounds
    monkeypatch.setattr(executor, "rounds", lambda plan, bucket: cuts.append(bucket) or cut(plan, bucket))
    resharder = executor.Resharder(p, 0, bucket_bytes=64)
    for _ in range(2):
        got = resharder.run(mine)
        assert all(torch.equal(got[n], full[n]) for n in params)
    assert cuts == [64]  # cut into rounds once, on the first run
    assert vars(p) == vars(plan(src, dst))


def test_a_tp_engine_gets_each_latent_attention_tensor_cut_as_vllm_cuts_it():
    """DeepSeek-V3 (tests/zoo_models.py's shapes: 2 heads, q/k heads 96 wide, v heads 32, head_dim 64 in its config:
    the rotary part's) into a vLLM engine at TP 2: its up-projections split by heads (vLLM's ColumnParallelLinear),
    o_proj by the v heads' columns (RowParallelLinear), the low-rank down-projections whole (vLLM replicates them)."""
    from tandem.sync.layout import EngineTP

    shapes = {"q_a_proj": (32, 64), "q_b_proj": (2 * 96, 32), "kv_a_proj_with_mqa": (512 + 64, 64),
              "kv_b_proj": (2 * (32 + 32), 512), "o_proj": (64, 2 * 32)}
    tp = EngineTP(2, heads=2, kv_heads=2)
    box = {(leaf, r): tp.box(f"model.layers.0.self_attn.{leaf}.weight", shape, r)
           for leaf, shape in shapes.items() for r in (0, 1)}
    assert box["q_b_proj", 1] == ((96, 192), (0, 32)) and box["kv_b_proj", 1] == ((64, 128), (0, 512))
    assert box["o_proj", 0] == ((0, 64), (0, 32)) and box["o_proj", 1] == ((0, 64), (32, 64))
    assert box["q_a_proj", 1] == ((0, 32), (0, 64)) and box["kv_a_proj_with_mqa", 1] == ((0, 576), (0, 64))
