"""Data, context and tensor parallelism for the policy: the (dp, cp, tp) mesh, FSDP2 + TP wrapping, and sharded grad
clipping (context parallel's attention: `tandem.train.context_parallel`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from tandem.architectures import ModelProfile
from tandem.util import residency

# Prefixes that wrappers add to parameter names (activation checkpointing, torch.compile); FSDP2 and TP add none.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.", "module.")

# Qwen2/Llama-style decoder layers: column-parallel inputs of attention and MLP, row-parallel outputs, so each
# layer needs one all-reduce after attention and one after the MLP and nothing between. DeepSeek-V3's multi-head
# latent attention splits by heads its up-projections (q_b_proj, kv_b_proj: rows head by head) and keeps its
# low-rank down-projections and their norms whole on every rank (see _LATENT_KV).
_COLWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj",
            "self_attn.q_b_proj", "self_attn.kv_b_proj")
_ROWWISE = ("self_attn.o_proj", "mlp.down_proj")


def _qkv_parts(linear: nn.Linear, cfg) -> tuple[int, ...]:
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    d = linear.out_features // (heads + 2 * kv)
    return heads * d, kv * d, kv * d


def _halves(linear: nn.Linear, cfg) -> tuple[int, ...]:
    return linear.out_features // 2, linear.out_features // 2


# Phi-3's fused projections stack column-parallel projections in one weight: qkv_proj's rows are [q | k | v] (by
# heads, k and v fewer under GQA), gate_up_proj's [gate | up]. A plain column split would give rank 0 all of q and
# part of k, so each part is split on its own: the rows are stored in tensor-parallel block order (rank 0's q, k and
# v rows, then rank 1's, ...; see `block_order`) and that is split plainly. The DTensor's global tensor is then the
# block-ordered one; TPState.row_orders maps it back to the Hugging Face rows (state dicts, sync layouts).
_FUSED_COLWISE = {"self_attn.qkv_proj": _qkv_parts, "mlp.gate_up_proj": _halves}
# Replicated parameters fed by this rank's heads only: Qwen3's per-head q_norm/k_norm normalize each head of the
# sharded q and k, so each rank's gradient covers its own heads and the gradient is their sum over the tp group
# (transformers' plan calls this replicated_with_grad_allreduce). Summed once per optimizer step, after every
# micro-batch's backward (`sum_partial_grads`): a per-backward sum would add the accumulated gradient again.
_PARTIAL_GRADS = ("self_attn.q_norm", "self_attn.k_norm")
# Replicated parameters with one entry per attention head: gpt-oss's attention sinks (a logit per head that joins
# that head's softmax). Each rank's attention reads the entries of its own heads (`_read_rank_heads`), so its gradient
# covers those alone, summed over the tp group as the partial gradients above.
_PER_HEAD = ("self_attn.sinks",)
# MLA's kv down-projection, whole on every rank: its outputs are the kv latent, which reaches the heads through
# kv_b_proj (whose ColwiseParallel sums the latent's gradient over the tp group), then qk_rope_head_dim columns of one
# rotary key that every head uses directly. Each rank's backward gives those columns its own heads' part of their
# gradient only, so `_RotaryKeyGrad` sums it over the group as it flows back, before it reaches the projection's
# weight and the layer's input (every rank then holds the whole gradient of both).
_LATENT_KV = "self_attn.kv_a_proj_with_mqa"


class _RotaryKeyGrad(torch.autograd.Function):
    """The identity forward; backward sums the gradient of the last columns from `start` on over `group`."""

    @staticmethod
    def forward(ctx, latent: torch.Tensor, start: int, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.start, ctx.group = start, group
        return latent.view_as(latent)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        rotary = grad[..., ctx.start:].contiguous()
        dist.all_reduce(rotary, group=ctx.group)
        return torch.cat([grad[..., :ctx.start], rotary], dim=-1), None, None


@dataclass(frozen=True)
class TPState:
    """What tensor parallelism leaves to the policy beyond DTensor's own bookkeeping (empty without TP)."""

    # HF name -> the HF row of each row of the stored (block-ordered) tensor, for the fused weights
    row_orders: dict[str, torch.Tensor] = field(default_factory=dict)
    partial_grads: tuple[str, ...] = ()  # HF names whose gradients each tp rank holds a part of
    group: dist.ProcessGroup | None = None  # the tp group they are summed over


def block_order(parts: Sequence[int], tp: int) -> torch.Tensor:
    """The Hugging Face row of each row of a fused weight in tensor-parallel block order: rank by rank, that rank's
    chunk of every part in turn, so that cutting it into `tp` equal blocks gives each rank its chunk of each part
    (parts [4, 2, 2] over 2 ranks: rows 0 1 4 6 | 2 3 5 7)."""
    blocks: list[list[torch.Tensor]] = [[] for _ in range(tp)]
    start = 0
    for size in parts:
        step = size // tp  # _check_tp saw heads, kv heads and the MLP width divide by tp
        for r in range(tp):
            blocks[r].append(torch.arange(start + r * step, start + (r + 1) * step))
        start += size
    return torch.cat([t for block in blocks for t in block])


class _RankHeads:
    """A layer's view of the model config with this rank's attention heads, for attention code that slices its fused
    qkv output by the config's head count (Phi-3: `qkv[..., :config.num_attention_heads * head_dim]`); every other
    field reads through to the model's config."""

    def __init__(self, config, tp: int):
        self._config = config
        self.num_attention_heads = config.num_attention_heads // tp

    def __getattr__(self, name: str):
        if name == "_config" or name.startswith("__"):  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self._config, name)


def _read_rank_heads(module: nn.Module, name: str, rank: int, tp: int, reader: nn.Module | None = None) -> None:
    """Make the forward of `reader` (default: `module`) read this rank's heads' part of `module`'s per-head parameter
    `name`: the slice stands in for the whole parameter while that forward runs (a view, so the gradient reaches the
    whole one), which is put back after it, failed or not, for FSDP, the optimizer and the state dict to find as it
    was."""
    whole: list[torch.Tensor] = []

    def before(_: nn.Module, args) -> None:
        param = module._parameters[name]
        size = param.shape[0] // tp
        whole.append(param)
        module._parameters[name] = param[rank * size:(rank + 1) * size]

    def after(_: nn.Module, args, output) -> None:
        if whole:
            module._parameters[name] = whole.pop()

    reader = reader or module
    reader.register_forward_pre_hook(before)
    reader.register_forward_hook(after, always_call=True)


def _gated_delta_parallel(layer: nn.Module, prefix: str, rank: int, tp: int, plan: dict,
                          orders: dict[str, torch.Tensor], partial: list[str]) -> None:
    """A Gated DeltaNet layer (Qwen3.5's linear attention) split by heads, each head's recurrence whole on one rank:
    its input projections column-parallel (in_proj_qkv's [q | k | v] rows by parts, in block order), its output
    row-parallel; the depthwise convolution's channels (in in_proj_qkv's block order) and the per-head decay
    parameters read by each rank for its own heads, their gradients summed over the tp group as the gated norm's
    (one weight over the head dimension, which each rank applies to its own heads)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    gdn = layer.get_submodule("linear_attn")
    order = block_order((gdn.key_dim, gdn.key_dim, gdn.value_dim), tp)
    for name in ("in_proj_qkv", "conv1d"):
        _store_in_block_order(gdn.get_submodule(name), order)
        orders[f"{prefix}.linear_attn.{name}.weight"] = order
    plan |= {f"linear_attn.{n}": ColwiseParallel() for n in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")}
    plan["linear_attn.out_proj"] = RowwiseParallel()
    for owner, name in ((gdn.conv1d, "weight"), (gdn, "A_log"), (gdn, "dt_bias")):
        _read_rank_heads(owner, name, rank, tp, reader=gdn)
    partial += [f"{prefix}.linear_attn.{n}" for n in ("conv1d.weight", "A_log", "dt_bias", "norm.weight")]
    for attr in ("num_k_heads", "num_v_heads", "key_dim", "value_dim", "conv_dim"):  # its forward splits by these
        setattr(gdn, attr, getattr(gdn, attr) // tp)


# One process group per rank set, made once and reused by later meshes (a communicator is not free).
_GROUPS: dict[tuple, dist.ProcessGroup] = {}


def _group(ranks: list[int], tag: str = "") -> dist.ProcessGroup:
    """The process group over `ranks` (a `tag` makes another one over the same ranks, for traffic of its own)."""
    key = (tag, *ranks)
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(list(ranks), use_local_synchronization=True)
    return _GROUPS[key]


def build_mesh(ctx_group_ranks: list[int], dp: int, tp: int, device_type: str, cp: int = 1) -> DeviceMesh:
    """A (dp, cp, tp) mesh named ("dp", "cp", "tp") over this worker group's global ranks, tp varying fastest, then
    cp; with cp > 1 also its flattened ("dp_cp",) dimension, which FSDP shards over (`fsdp_mesh`).

    Only the group's members take part: the subgroups are made with `use_local_synchronization=True`, so the
    other processes of a larger world (split placement) need not call anything. Every member must call this
    with the same arguments, and the members must have made the same number of process groups before: torch names
    a locally synchronized group by its ranks *and* that count, so members with different histories wait for each
    other forever (true of processes running the same code, e.g. the trainers of a split placement).
    """
    ranks = list(ctx_group_ranks)
    if dp * cp * tp != len(ranks):
        raise ValueError(f"parallel: dp ({dp}) x cp ({cp}) x tp ({tp}) = {dp * cp * tp}, but the train group has "
                         f"{len(ranks)} workers")
    me = dist.get_rank()
    if me not in ranks:
        raise ValueError(f"build_mesh: global rank {me} is not in the group {ranks}")
    grid = torch.tensor(ranks, dtype=torch.int).view(dp, cp, tp)
    # Each member builds the one group of each dimension it belongs to; a member of none only waits for the
    # members of the groups it is in (local synchronization), never for the whole world.
    i, j, k = [(a, b, c) for a in range(dp) for b in range(cp) for c in range(tp) if int(grid[a, b, c]) == me][0]
    groups = [_group(grid[:, j, k].tolist()), _group(grid[i, :, k].tolist()), _group(grid[i, j].tolist())]
    mesh = DeviceMesh.from_group(groups, device_type, mesh=grid, mesh_dim_names=("dp", "cp", "tp"))
    if cp > 1:
        _flatten_dp_cp(mesh, _group(grid[:, :, k].flatten().tolist()))
    return mesh


# Each context-parallel mesh's flattened ("dp_cp",) mesh, by the mesh's id (the mesh is kept with it, so the id is
# not reused): torch deprecates reaching a flattened dimension by slicing the root mesh, and asks callers to keep it.
_FLATTENED: dict[int, tuple[DeviceMesh, DeviceMesh]] = {}


def _flatten_dp_cp(mesh: DeviceMesh, group: dist.ProcessGroup) -> None:
    """Make `group` (this rank's dp x cp ranks) the mesh's flattened "dp_cp" dimension. torch's own `_flatten` would
    make its groups over the whole world, which a split placement's samplers never join; this is what it builds,
    over the locally synchronized group instead (FSDP with TP needs the dp mesh and the tp mesh to come from one
    root mesh)."""
    from torch.distributed._mesh_layout import _MeshLayout

    flat = DeviceMesh(mesh.device_type, _layout=_MeshLayout([mesh["dp", "cp"]._layout.collapse()]),
                      _rank_map=mesh._rank_map, mesh_dim_names=("dp_cp",), _root_mesh=mesh, _init_backend=False)
    flat._dim_group_names = [group.group_name]
    _FLATTENED[id(mesh)] = (mesh, flat)


def fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """What FSDP shards over: the dp ranks, and with context parallel the dp x cp ranks (a cp group's ranks hold
    the same weights and each computes a part of their gradient, which FSDP's reduction sums in)."""
    return _FLATTENED[id(mesh)][1] if mesh["cp"].size() > 1 else mesh["dp"]


def _check_tp(model: nn.Module, tp: int) -> None:
    cfg = model.config
    for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "linear_num_key_heads",
                "linear_num_value_heads"):
        value = getattr(cfg, key, None)
        if value is not None and value % tp:
            raise ValueError(f"parallel.tp = {tp} does not divide the model's {key} ({value})")


def _has(layer: nn.Module, name: str) -> bool:
    try:
        layer.get_submodule(name)
        return True
    except AttributeError:
        return False


@torch.no_grad()
def _store_in_block_order(linear: nn.Linear, order: torch.Tensor) -> None:
    for p in linear.parameters(recurse=False):  # weight rows, and the bias's entries alike
        p.copy_(p[order])  # indexing copies first, so no row is read after it was overwritten


def _tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, layers: list[nn.Module]) -> TPState:
    """Each decoder layer's projections column- or row-parallel over `tp_mesh` (fused ones by parts, in block
    order), Phi-3's attention told its rank's head counts, and the parameters with partial gradients named. `layers`:
    the model's decoder layers."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = tp_mesh.size()
    _check_tp(model, tp)
    names = {id(m): n for n, m in model.named_modules()}
    orders: dict[str, torch.Tensor] = {}
    partial: list[str] = []
    group, latent = tp_mesh.get_group(), getattr(model.config, "kv_lora_rank", None)

    def sum_rotary_key_grad(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        return _RotaryKeyGrad.apply(out, latent, group)

    for layer in layers:
        prefix = names[id(layer)]
        plan = ({n: ColwiseParallel() for n in _COLWISE if _has(layer, n)}
                | {n: RowwiseParallel() for n in _ROWWISE if _has(layer, n)})
        for n, parts in ((n, f) for n, f in _FUSED_COLWISE.items() if _has(layer, n)):
            linear = layer.get_submodule(n)
            order = block_order(parts(linear, model.config), tp)
            _store_in_block_order(linear, order)
            orders.update({f"{prefix}.{n}.{p}": order for p, _ in linear.named_parameters()})
            plan[n] = ColwiseParallel()
        if _has(layer, "self_attn.qkv_proj"):  # its forward slices q, k, v by head counts: this rank's now
            attn = layer.get_submodule("self_attn")
            attn.config = _RankHeads(attn.config, tp)
            attn.num_key_value_heads //= tp
        for n in (n for n in _PARTIAL_GRADS if _has(layer, n)):
            partial += [f"{prefix}.{n}.{p}" for p, _ in layer.get_submodule(n).named_parameters()]
        for n in (n for n in _PER_HEAD if n in dict(layer.named_parameters())):
            owner, _, param = n.rpartition(".")
            _read_rank_heads(layer.get_submodule(owner), param, tp_mesh.get_local_rank(), tp)
            partial.append(f"{prefix}.{n}")
        if _has(layer, "linear_attn"):
            _gated_delta_parallel(layer, prefix, tp_mesh.get_local_rank(), tp, plan, orders, partial)
        if _has(layer, _LATENT_KV):
            layer.get_submodule(_LATENT_KV).register_forward_hook(sum_rotary_key_grad)
        parallelize_module(layer, tp_mesh, plan)
    return TPState(orders, tuple(partial), group)


def parallelize(model: nn.Module, mesh: DeviceMesh | None, profile: ModelProfile, expert_parallel: int = 1
                ) -> TPState:
    """TP over "tp" in each decoder layer, then FSDP2 (ZeRO-3) per layer and at the root over "dp" (over "dp" x
    "cp" with context parallel: `fsdp_mesh`). In place;
    returns what TP leaves to the caller (fused weights' row orders, parameters with partial gradients). `profile`
    (tandem.architectures): where the model's decoder layers and vision tower's blocks are.

    Embeddings, norms and the LM head stay whole on every tp rank (so tied embeddings stay tied and the logits
    need no gather); FSDP shards them over dp like everything else. Parameters compute in their own dtype
    (`model.dtype`): FSDP's mixed precision (bf16 compute over fp32 parameters) is not offered yet.

    `expert_parallel` E > 1 (tp 1): each MoE layer's experts split over EP groups of E adjacent dp ranks, tokens
    exchanged by all-to-all (`tandem.train.expert_parallel`), and FSDP over the dp / E ranks holding the same
    experts; everything else FSDP over all dp ranks as without EP.
    """
    if mesh is None or mesh.size() == 1:
        return TPState()
    dp, tp = mesh["dp"].size() * mesh["cp"].size(), mesh["tp"].size()
    if expert_parallel > 1 and tp > 1:
        raise ValueError(f"placement.expert_parallel: {expert_parallel} with placement.tensor_parallel: {tp} is not "
                         "supported; use one of them")
    state = _tensor_parallel(model, mesh["tp"], profile.layers(model)) if tp > 1 else TPState()
    if dp > 1 or tp > 1:
        # With tp > 1 and dp == 1 FSDP still wraps (over a mesh of one): it costs nothing and keeps one code path
        # (DTensor parameters everywhere, the same state-dict and gather helpers).
        from torch.distributed.fsdp import fully_shard

        dp_mesh = fsdp_mesh(mesh)
        if expert_parallel > 1:
            from tandem.train.expert_parallel import expert_mesh, shard_experts

            emesh = expert_mesh(dp_mesh, expert_parallel, _group)
            for experts in shard_experts(model, emesh):  # their own FSDP group, before their layer takes the rest
                fully_shard(experts, mesh=emesh["edp"], reshard_after_forward=True)
        for layer in profile.tower_layers(model) + profile.layers(model):
            # ZeRO-3: a layer's full weights live only while it runs (one more all-gather in backward for memory);
            # a vision tower's blocks too, so a big tower's full weights do not live beside the language model's
            fully_shard(layer, mesh=dp_mesh, reshard_after_forward=True)
        fully_shard(model, mesh=dp_mesh)
    return state


def sum_partial_grads(model: nn.Module, state: TPState) -> None:
    """Sum over the tp group the gradients each rank holds a part of (`TPState.partial_grads`), in one all-reduce.
    Call once per optimizer step, after the last backward: the sum of accumulated parts is the accumulated sum.
    Under FSDP each grad is this dp rank's shard, the same rows on every tp rank of its dp column."""
    params = dict(model.named_parameters())
    # every tp rank ran the same passes, so the same gradients exist on each
    grads = [residency.local(params[n].grad) for n in state.partial_grads if params[n].grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=state.group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def hf_name(name: str) -> str:
    """A parameter's Hugging Face name: any wrapper prefixes removed."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> float:
    """clip_grad_norm_ for parameters that may be DTensors on different meshes (FSDP-only vs FSDP+TP ones).

    The global norm is sum over parameters of each one's full-tensor norm squared; grouping by mesh lets one
    reduction serve a whole group. Same formula as torch's (coefficient max_norm / (norm + 1e-6), capped at 1).
    """
    groups: dict[object, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            key = (p.grad.device_mesh, p.grad.placements) if isinstance(p.grad, DTensor) else None
            groups.setdefault(key, []).append(p.grad)
    squares = []
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads, 2.0, foreach=False)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squares.append(norm.float() ** 2)
    if not squares:
        return 0.0
    total = float(torch.stack(squares).sum().sqrt())
    coef = min(max_norm / (total + 1e-6), 1.0)
    if coef < 1.0:
        for grads in groups.values():
            for g in grads:
                g.mul_(coef)
    return total
