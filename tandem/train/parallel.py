"""Data and tensor parallelism for the policy: the (dp, tp) mesh, FSDP2 + TP wrapping, and sharded grad clipping."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

# Prefixes that wrappers add to parameter names (activation checkpointing, torch.compile); FSDP2 and TP add none.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.", "module.")

# Qwen2/Llama-style decoder layers: column-parallel inputs of attention and MLP, row-parallel outputs, so each
# layer needs one all-reduce after attention and one after the MLP and nothing between.
_COLWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
_ROWWISE = ("self_attn.o_proj", "mlp.down_proj")


# One process group per rank set, made once and reused by later meshes (a communicator is not free).
_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}


def _group(ranks: list[int]) -> dist.ProcessGroup:
    key = tuple(ranks)
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(list(key), use_local_synchronization=True)
    return _GROUPS[key]


def build_mesh(ctx_group_ranks: list[int], dp: int, tp: int, device_type: str) -> DeviceMesh:
    """A (dp, tp) mesh named ("dp", "tp") over this worker group's global ranks, tp varying fastest.

    Only the group's members take part: the subgroups are made with `use_local_synchronization=True`, so the
    other processes of a larger world (split placement) need not call anything. Every member must call this
    with the same arguments, and the members must have made the same number of process groups before: torch names
    a locally synchronized group by its ranks *and* that count, so members with different histories wait for each
    other forever (true of processes running the same code, e.g. the trainers of a split placement).
    """
    ranks = list(ctx_group_ranks)
    if dp * tp != len(ranks):
        raise ValueError(f"parallel: dp ({dp}) x tp ({tp}) = {dp * tp}, but the train group has {len(ranks)} workers")
    me = dist.get_rank()
    if me not in ranks:
        raise ValueError(f"build_mesh: global rank {me} is not in the group {ranks}")
    grid = torch.tensor(ranks, dtype=torch.int).view(dp, tp)
    # Each member builds the one dp group and the one tp group it belongs to; a member of neither only waits
    # for the members of the groups it is in (local synchronization), never for the whole world.
    row, col = [(r, c) for r in range(dp) for c in range(tp) if int(grid[r, c]) == me][0]
    tp_group = _group(grid[row].tolist())
    dp_group = _group(grid[:, col].tolist())
    return DeviceMesh.from_group([dp_group, tp_group], device_type, mesh=grid, mesh_dim_names=("dp", "tp"))


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a Hugging Face causal LM (model.model.layers for Qwen2/Llama/Mistral)."""
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise ValueError(f"parallelize: {type(model).__name__} has no .model.layers; only decoder-only LMs are supported")
    return list(layers)


def _check_tp(model: nn.Module, tp: int) -> None:
    cfg = model.config
    for field in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(cfg, field, None)
        if value is not None and value % tp:
            raise ValueError(f"parallel.tp = {tp} does not divide the model's {field} ({value})")


def parallelize(model: nn.Module, mesh: DeviceMesh | None) -> nn.Module:
    """TP over "tp" in each decoder layer, then FSDP2 (ZeRO-3) per layer and at the root over "dp". In place.

    Embeddings, norms and the LM head stay whole on every tp rank (so tied embeddings stay tied and the logits
    need no gather); FSDP shards them over dp like everything else. Parameters compute in their own dtype
    (`model.dtype`): FSDP's mixed precision (bf16 compute over fp32 parameters) is not offered yet.
    """
    if mesh is None or mesh.size() == 1:
        return model
    dp, tp = mesh["dp"].size(), mesh["tp"].size()
    if tp > 1:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        _check_tp(model, tp)
        plan = {name: ColwiseParallel() for name in _COLWISE} | {name: RowwiseParallel() for name in _ROWWISE}
        for layer in decoder_layers(model):
            parallelize_module(layer, mesh["tp"], plan)
    if dp > 1 or tp > 1:
        # With tp > 1 and dp == 1 FSDP still wraps (over a mesh of one): it costs nothing and keeps one code path
        # (DTensor parameters everywhere, the same state-dict and gather helpers).
        from torch.distributed.fsdp import fully_shard

        dp_mesh = mesh["dp"]
        for layer in decoder_layers(model):
            # ZeRO-3: a layer's full weights live only while it runs (one more all-gather in backward for memory).
            fully_shard(layer, mesh=dp_mesh, reshard_after_forward=True)
        fully_shard(model, mesh=dp_mesh)
    return model


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
