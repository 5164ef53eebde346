"""Expert parallelism for mixture-of-experts layers: each rank holds a slice of every layer's fused experts, and
each routed token travels to its expert's owner and back by all-to-all."""
from __future__ import annotations

import types
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh


class _AllToAll(torch.autograd.Function):
    """all_to_all_single along dim 0 with uneven splits; its backward is the same exchange the other way round (each
    row's gradient goes back to the rank the row came from)."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _exchange(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return _exchange(grad, in_splits, out_splits, ctx.group), None, None, None


def _exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


class _ScaleGrad(torch.autograd.Function):
    """The identity, whose gradient is scaled: see `_local_experts`."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


@dataclass(frozen=True)
class EPGroup:
    """Where a layer's experts live: `size` ranks of `group`, rank r holding experts [r * per, (r + 1) * per)."""
    group: dist.ProcessGroup
    size: int
    per: int  # experts per rank


def expert_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every fused-experts module (transformers 5's `*Experts`: 3-D `gate_up_proj`, `down_proj`)."""
    return [(n, m) for n, m in model.named_modules()
            if isinstance(getattr(m, "gate_up_proj", None), torch.Tensor) and m.gate_up_proj.dim() == 3
            and isinstance(getattr(m, "down_proj", None), torch.Tensor)]


def expert_mesh(dp_mesh: DeviceMesh, ep: int, group_of) -> DeviceMesh:
    """An ("edp", "ep") mesh over the data-parallel ranks, ep fastest: each row an EP group (adjacent ranks, one node
    on GPUs), each column the ranks holding the same experts (FSDP shards and sums those over "edp")."""
    ranks = dp_mesh.mesh.flatten().tolist()
    if len(ranks) % ep:
        raise ValueError(f"placement.expert_parallel: {ep} does not divide the {len(ranks)} data-parallel ranks")
    grid = torch.tensor(ranks, dtype=torch.int).view(-1, ep)
    row, col = [(r, c) for r in range(grid.shape[0]) for c in range(ep) if int(grid[r, c]) == dist.get_rank()][0]
    # its own groups (tagged), not the dp group's: the exchange then never queues behind FSDP's async reductions
    ep_group, edp_group = group_of(grid[row].tolist(), "ep"), group_of(grid[:, col].tolist(), "edp")
    return DeviceMesh.from_group([edp_group, ep_group], dp_mesh.device_type, mesh=grid, mesh_dim_names=("edp", "ep"))


def shard_experts(model: nn.Module, mesh: DeviceMesh) -> list[nn.Module]:
    """Give each fused-experts module its rank's experts as DTensors Shard(0) on mesh["ep"] (the global tensor stays
    the fused one: checkpoints, sync layouts and the optimizer see it so) and an all-to-all forward. Returns the
    modules, for FSDP to shard over "edp"."""
    from torch.distributed.tensor import DTensor, Shard

    ep_mesh = mesh["ep"]
    size, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    out = []
    for name, module in expert_modules(model):
        _check_module(name, module, size)
        per = module.gate_up_proj.shape[0] // size
        for pname in _expert_parameters(module):
            full = getattr(module, pname)
            local = full.detach()[rank * per:(rank + 1) * per].clone()  # this rank's experts only; the rest freed
            setattr(module, pname, nn.Parameter(DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False,
                                                                   shape=full.shape, stride=full.stride()),
                                                requires_grad=full.requires_grad))
        module._tandem_ep = EPGroup(ep_mesh.get_group(), size, per)
        module.forward = types.MethodType(_ep_forward, module)
        out.append(module)
    return out


def _check_module(name: str, module: nn.Module, size: int) -> None:
    experts = module.gate_up_proj.shape[0]
    if experts % size:
        raise ValueError(f"placement.expert_parallel: {size} does not divide {name}'s {experts} experts")
    # the forward below is transformers' eager one (integrations/moe.py), with the flags it reads: fused [gate, up]
    # weights (their halves concatenated or, gpt-oss's, interleaved: the module's own _apply_gate splits them),
    # stored [out, in] or (is_transposed) [in, out], with biases or without
    if not getattr(module, "has_gate", True):
        raise ValueError(f"expert parallel: {name} ({type(module).__name__}) has no gate, unlike the fused [gate, up] "
                         "experts tandem shards (Qwen3-MoE, Mixtral, GLM-4.5, gpt-oss); use "
                         "placement.expert_parallel: 1")


def _expert_parameters(module: nn.Module) -> tuple[str, ...]:
    """The experts' parameters, each [experts, ...], which EP shards by expert: the fused weights, and their biases
    where the experts have them (gpt-oss's)."""
    biases = ("gate_up_proj_bias", "down_proj_bias") if getattr(module, "has_bias", False) else ()
    return ("gate_up_proj", "down_proj") + biases


def _ep_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts' output for this rank's tokens [T, H], given the router's top-k experts and weights [T, k].

    Each (token, slot) row goes to its expert's owner, sorted by expert (stable): the owner computes its experts on
    what it receives, the rows come back in the order they left, are weighted here (so the router's gradient stays
    on this rank) and added per token in expert order, as transformers' eager forward adds them."""
    ep: EPGroup = self._tandem_ep
    k = top_k_index.shape[-1]
    expert = top_k_index.reshape(-1)
    order = torch.argsort(expert, stable=True)
    token = order // k  # row t * k + slot is token t's slot
    counts = torch.bincount(expert, minlength=ep.size * ep.per)
    received = torch.empty_like(counts)  # [source rank, my local expert]: rows each source sends each of mine
    dist.all_to_all_single(received, counts, group=ep.group)
    send, recv = counts.view(ep.size, ep.per).sum(1).tolist(), received.view(ep.size, ep.per).sum(1).tolist()
    rows = _AllToAll.apply(hidden_states[token], recv, send, ep.group)
    # each received row's local expert (on the counts' device: the GPU's under NCCL)
    local = torch.arange(ep.per, device=received.device).repeat(ep.size).repeat_interleave(received)
    back = _AllToAll.apply(_local_experts(self, rows, local), send, recv, ep.group)
    weighted = (back * top_k_weights.reshape(-1)[order, None]).to(hidden_states.dtype)
    return torch.zeros_like(hidden_states).index_add(0, token, weighted)


def _local_experts(self, rows: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """Each received row through its local expert (transformers' eager math), in the order received.

    Every local expert runs, on no rows if none came, so that each rank's expert weights get a gradient (zeros)
    and FSDP's reduction over "edp" sees the same tensors on every rank. The weights' gradient is scaled by
    1 / ep: each rank's loss is scaled by dp to undo FSDP's average over dp (see Policy._pass), but an expert's
    gradient already sums the rows of the whole EP group, and FSDP averages it over "edp" = dp / ep ranks only
    (the biases' alike)."""
    ep: EPGroup = self._tandem_ep
    mine = {n: _ScaleGrad.apply(_local(getattr(self, n)), 1.0 / ep.size) for n in _expert_parameters(self)}
    gate_up, down = mine["gate_up_proj"], mine["down_proj"]
    gate_up_bias, down_bias = mine.get("gate_up_proj_bias"), mine.get("down_proj_bias")
    in_out = bool(getattr(self, "is_transposed", False))
    order = torch.argsort(local, stable=True)
    sizes = torch.bincount(local, minlength=ep.per).tolist()
    outs = [_project(self._apply_gate(_project(x, gate_up, gate_up_bias, e, in_out)), down, down_bias, e, in_out)
            for e, x in enumerate(torch.split(rows[order], sizes))]
    return torch.empty_like(rows).index_copy(0, order, torch.cat(outs))


def _project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, e: int, in_out: bool) -> torch.Tensor:
    """Expert `e`'s projection of the rows `x`, as transformers' eager forward computes it ([in, out] weights when
    `in_out`, is_transposed)."""
    y = x @ weight[e] if in_out else nn.functional.linear(x, weight[e])
    return y if bias is None else y + bias[e]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t
