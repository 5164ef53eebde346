"""The trainer's fused experts as the checkpoint's per-expert tensors (tandem.sync.convert): views equal to what
transformers saves, refused by name when dropped, out of order or mis-shaped, planned from FSDP shards each byte once,
and handed to the vLLM engine's buckets without a copy. No engine starts here."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import zoo_models  # noqa: E402

from tandem.rollout.manifest import ManifestError, check_plan  # noqa: E402
from tandem.sync.convert import ConversionError, Cut, ToCheckpoint  # noqa: E402
from tandem.sync.layout import Mesh, Spec, build_layout, local_tensor, replicated_layout, shift, slices  # noqa: E402
from tandem.sync.planner import plan  # noqa: E402

MOE = ("qwen3_moe", "mixtral", "glm4_moe", "qwen3_5_moe_text", "deepseek_v3")
EXPERTS = 4  # zoo_models: num_experts / num_local_experts


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> dict[str, tuple[Path, torch.nn.Module]]:
    """Each MoE of the zoo saved (per-expert tensors on disk) and loaded back by transformers (fused experts)."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("moe")
    out = {}
    for arch in MOE:
        path = zoo_models.build(root / arch, arch)
        out[arch] = (path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))
    return out


def _named(model) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("arch", MOE)
def test_checkpoint_tensors_are_views_of_the_fused_ones_equal_to_what_transformers_saves(moe, arch):
    """Every name, shape and value is what transformers' own save (revert_weight_conversion) writes, and every
    per-expert tensor lies in its fused tensor's storage: no copy of a layer's experts is made to send it."""
    from transformers.core_model_loading import revert_weight_conversion

    _, model = moe[arch]
    named = _named(model)
    conv = ToCheckpoint.of_model(model, named.items())
    views = dict(conv.views(named.items()))
    saved = revert_weight_conversion(model, dict(model.state_dict()))
    buffers = set(model.state_dict()) - set(named)  # GLM-4.5's correction bias: saved, never trained or sent
    saved = {k: v for k, v in saved.items() if k not in buffers}
    assert views.keys() == saved.keys()
    for name, t in saved.items():
        assert torch.equal(views[name], t), name  # an expert or a part out of order shows here
    experts = [n for n in views if re.search(r"\.experts\.\d+\.", n)]
    moe_layers = sum(n.endswith("experts.gate_up_proj") for n in named)  # GLM-4.5's first layer is dense
    assert moe_layers and len(experts) == moe_layers * EXPERTS * 3
    offsets = set()
    for name in experts:
        fused = named[conv.cuts[name].source]
        assert views[name].untyped_storage().data_ptr() == fused.untyped_storage().data_ptr(), name
        assert views[name].is_contiguous(), name  # the engine's .contiguous() is then no copy either
        offsets.add((conv.cuts[name].source, views[name].storage_offset()))
    assert len(offsets) == len(experts)  # each a slice of its own


def _swap(cuts: dict[str, Cut], a: str, b: str) -> dict[str, Cut]:
    out = dict(cuts)
    out[a], out[b] = cuts[b], cuts[a]
    return out


def _narrow(cut: Cut) -> Cut:
    """`cut` one row short along its first dimension the checkpoint tensor keeps."""
    d = next(d for d in range(len(cut.box)) if d not in cut.drop)
    lo, hi = cut.box[d]
    return Cut(cut.source, cut.box[:d] + ((lo, hi - 1),) + cut.box[d + 1:], cut.drop)


@pytest.mark.parametrize("case", ["swapped experts", "gate and up exchanged", "dropped", "duplicated",
                                  "mis-shaped", "foreign name"])
def test_a_conversion_not_transformers_own_is_refused_naming_the_tensor(moe, case):
    """The cuts are checked against transformers' reverse before any weight moves: what a sync with experts out of
    order (NeMo-RL's and SGLang's failures: stacked tensors taken in the wrong order, or dropped) would have sent."""
    _, model = moe["qwen3_moe"]
    conv = ToCheckpoint.of_model(model, _named(model).items())
    name = "model.layers.1.mlp.experts.{}.{}_proj.weight".format
    cuts = dict(conv.cuts)
    if case == "swapped experts":
        cuts, wrong = _swap(cuts, name(1, "up"), name(2, "up")), name(1, "up")
    elif case == "gate and up exchanged":
        cuts, wrong = _swap(cuts, name(3, "gate"), name(3, "up")), name(3, "gate")
    elif case == "dropped":
        wrong = name(3, "down")
        del cuts[wrong]
    elif case == "duplicated":  # two names, one slice
        cuts[name(2, "down")], wrong = cuts[name(0, "down")], name(2, "down")
    elif case == "mis-shaped":
        cuts[name(0, "gate")], wrong = _narrow(cuts[name(0, "gate")]), name(0, "gate")
    else:
        wrong = "model.layers.1.mlp.experts.9.gate_proj.weight"
        cuts[wrong] = cuts.pop(name(0, "gate"))
    with pytest.raises(ConversionError, match=re.escape(repr(wrong))):
        ToCheckpoint(cuts, conv.source_shapes, model)
    ToCheckpoint(conv.cuts, conv.source_shapes, model)  # the untouched cuts pass the same check


def test_a_trainer_tensor_of_another_shape_is_refused_naming_it(moe):
    _, model = moe["mixtral"]
    named = _named(model)
    conv = ToCheckpoint.of_model(model, named.items())
    fused = "model.layers.0.mlp.experts.down_proj"
    named[fused] = named[fused][: EXPERTS - 1]  # an expert short
    with pytest.raises(ConversionError, match=re.escape(repr(fused))):
        list(conv.views(named.items()))


@pytest.mark.parametrize("arch", MOE)
def test_fsdp_shards_of_fused_experts_plan_into_the_engines_tensors_each_byte_once(moe, arch):
    """FSDP2 shards each fused [experts, ...] tensor by experts (Shard(0), here unevenly over 3 ranks, one of them
    empty for some); the converted layout is planned straight into the engine's per-expert tensors on every rank:
    the plan checks against the engine's manifest, each piece read from the real fused shard is that expert's
    slice, and the bytes moved are the lower bound (nothing gathered whole first)."""
    from tandem.rollout.vllm.weights import _Checkpoint

    path, model = moe[arch]
    named = _named(model)
    conv = ToCheckpoint.of_model(model, named.items())
    trainer = build_layout({n: (tuple(t.shape), t.dtype) for n, t in named.items()}, Mesh.of(dp=3), Spec(zero="dim0"))
    src = conv.layout(trainer)
    dst = replicated_layout({n: (p.shape, p.dtype) for n, p in src.items()}, range(3))
    moves = plan(src, dst)
    manifest = _Checkpoint(str(path), torch.float32).manifest()
    check_plan(manifest, {n: (p.shape, p.dtype) for n, p in src.items()}, "the engine")
    held = {r: conv.sources_of({n: local_tensor(p, r, named[n]) for n, p in trainer.items()}) for r in range(3)}
    views = dict(conv.views(named.items()))
    for m in moves.moves:
        got = m.src_piece.view(held[m.src][m.name])[slices(shift(m.box, [a for a, _ in m.src_piece.box]))]
        assert torch.equal(got, views[m.name][slices(m.box)]), (m.name, m.src, m.box)
    assert moves.bytes_moved == moves.lower_bound
    dropped = next(n for n in src if ".experts.3." in n)
    del src[dropped]
    with pytest.raises(ManifestError, match=re.escape(repr(dropped))):
        check_plan(manifest, {n: (p.shape, p.dtype) for n, p in src.items()}, "the engine")


def test_the_engine_sends_a_layers_experts_together_as_the_views_themselves(moe):
    """vLLM's CPU reload rebuilds a layer's fused-MoE module once all its experts have arrived: they travel in one
    bucket, as the trainer's views (no copy), and an update with part of them is refused by name."""
    from tandem.rollout.vllm.weights import EngineWeights

    path, model = moe["qwen3_moe"]
    named = _named(model)
    views = list(ToCheckpoint.of_model(model, named.items()).views(named.items()))
    updates = EngineWeights(str(path), "float32", bucket_mb=0)  # each group that must travel together: a bucket
    updates.attach({"qkv_proj": ["q_proj", "k_proj", "v_proj"]}, on_cpu=True)
    sent: list[list[tuple[str, torch.Tensor]]] = []
    updates.load(views, sent.append, lambda: None)
    experts = "model.layers.0.mlp.experts."
    (bucket,) = [b for b in sent if any(n.startswith(experts) for n, _ in b)]
    assert sum(n.startswith(experts) for n, _ in bucket) == EXPERTS * 3
    fused = named["model.layers.0.mlp.experts.gate_up_proj"].untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == fused for n, t in bucket if n.startswith(experts) and "down" not in n)
    part = [(n, t) for n, t in views if n.startswith(experts) and ".1." not in n]
    with pytest.raises(ManifestError, match=re.escape(repr(experts + "1.down_proj.weight"))):
        updates.load(part, sent.append, lambda: None)
