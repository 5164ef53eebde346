"""Mixture-of-experts routing: the experts each token went to, recorded from a model's routers, and forwards that send
tokens to given experts instead (router replay); the expert load and the load-balancing loss of a forward."""
from __future__ import annotations

import math
from contextlib import contextmanager
from functools import partial
from typing import Iterator, Mapping

import torch

def _softmax_weights(logits: torch.Tensor, used: torch.Tensor, renormalize: bool) -> torch.Tensor:
    top = torch.softmax(logits.float(), dim=-1).gather(-1, used)
    return top / top.sum(dim=-1, keepdim=True) if renormalize else top


def _sigmoid_weights(router: torch.nn.Module, logits: torch.Tensor, used: torch.Tensor) -> torch.Tensor:
    """GLM-4.5's (DeepSeek-V3's) weights: the experts' sigmoid scores (the correction bias only chooses), as its
    config's norm_topk_prob says renormalized, times routed_scaling_factor."""
    top = logits.float().sigmoid().gather(-1, used)
    if router.norm_topk_prob:
        top = top / (top.sum(dim=-1, keepdim=True) + 1e-20)
    return top * router.routed_scaling_factor


# How a router weighs the experts it chose, by name (tandem.architectures.SUPPORT names each MoE's router classes with
# theirs). Each returns the chosen experts' weights. Qwen3-MoE and Mixtral choose the top-k of softmax(logits) in
# float32 and differ only in whether the chosen weights are renormalized to sum to 1 (Qwen3-MoE: as its config's
# norm_topk_prob says; Mixtral and Qwen3.5-MoE: always); GLM-4.5 and DeepSeek-V3 choose by sigmoid scores plus a
# correction bias within their best groups; gpt-oss takes the top-k of its (biased) logits and softmaxes those alone,
# in the logits' dtype. A replayed forward recomputes the weights the router's way from its own logits, so the
# gradient reaches the router through the weights of the experts it was given, as it reaches it through those of the
# experts it chose.
WEIGHINGS = {
    "softmax_norm_topk_prob": lambda router, logits, used: _softmax_weights(logits, used, bool(router.norm_topk_prob)),
    "softmax_renormalized": lambda router, logits, used: _softmax_weights(logits, used, True),
    "sigmoid": _sigmoid_weights,
    "softmax_of_top": lambda router, logits, used: torch.softmax(logits.gather(-1, used), dim=-1),
}


def routers(model: torch.nn.Module, classes: Mapping[str, str]) -> list[torch.nn.Module]:
    """The model's MoE routers in layer order: its modules of the `classes` (router class name -> weighing, a
    profile's `routers`); empty for a dense model."""
    return [m for m in model.modules() if type(m).__name__ in classes]


def route_dtype(num_experts: int) -> torch.dtype:
    """The narrowest integer type that holds every expert index (routes ride with every sampled row)."""
    return torch.uint8 if num_experts <= 256 else torch.int16


class Record:
    """What the routers did over the forwards of one `Routing.capture` block, per MoE layer and forward: the experts
    each router chose itself (`natural`), the ones the forward used (`used`: the given ones where replayed), and the
    router logits when asked for them."""

    def __init__(self, layers: int, compact: torch.dtype | None, logits: bool) -> None:
        self.natural: list[list[torch.Tensor]] = [[] for _ in range(layers)]  # [N, k] per forward
        self.used: list[list[torch.Tensor]] = [[] for _ in range(layers)]
        self.logits: list[list[torch.Tensor]] = [[] for _ in range(layers)]  # [N, E]
        self._compact, self._keep_logits = compact, logits

    def add(self, layer: int, natural: torch.Tensor, used: torch.Tensor, logits: torch.Tensor) -> None:
        if self._compact is not None:  # an engine keeps only the choices, as small as they go
            self.natural[layer].append(natural.to(self._compact))
            return
        self.natural[layer].append(natural.detach())
        self.used[layer].append(used.detach())
        if self._keep_logits:
            self.logits[layer].append(logits)

    def forwards(self) -> list[torch.Tensor]:
        """[N, layers, k] of each forward in order: the experts the routers chose."""
        return [torch.stack(step, dim=1) for step in zip(*self.natural)]

    def last(self, which: str = "used") -> torch.Tensor:
        """[N, layers, k] of the last forward: `used` or `natural`."""
        return torch.stack([layer[-1] for layer in getattr(self, which)], dim=1)


class Routing:
    """Forward hooks on a model's routers. Outside `capture` they do nothing. Inside, each router forward is
    recorded, and with `routes` given, the forward uses them where `routed` says (its own choice elsewhere)."""

    def __init__(self, model: torch.nn.Module, classes: Mapping[str, str]) -> None:
        """`classes`: the router class names -> their weighing (`WEIGHINGS`), as the model's profile has them."""
        self.routers = routers(model, classes)
        if not self.routers:
            raise ValueError(f"{type(model).__name__}: no mixture-of-experts router of the classes "
                             f"{', '.join(sorted(classes)) or 'its profile names (none: a dense model)'}")
        self._weighs = {name: WEIGHINGS[how] for name, how in dict(classes).items()}
        self.num_experts, self.top_k = int(self.routers[0].num_experts), int(self.routers[0].top_k)
        self._record: Record | None = None
        self._replay: tuple[torch.Tensor, torch.Tensor] | None = None
        self._handles = [r.register_forward_hook(partial(self._hook, i)) for i, r in enumerate(self.routers)]

    @property
    def layers(self) -> int:
        return len(self.routers)

    @contextmanager
    def capture(self, routes: torch.Tensor | None = None, routed: torch.Tensor | None = None, logits: bool = False,
                compact: bool = False) -> Iterator[Record]:
        """Record the routers' forwards in the block. `routes` [N, layers, k] with `routed` [N] bool: every forward
        of the block (of N router rows: batch x sequence, row-major) uses those experts where routed. `logits`: keep
        the router logits (with their gradient); `compact`: keep only the choices, in `route_dtype`."""
        if routes is not None and (routes.dim() != 3 or routes.shape[1:] != (self.layers, self.top_k)):
            raise ValueError(f"routes of shape {tuple(routes.shape)} for a model of {self.layers} MoE layers with "
                             f"top_k {self.top_k}: the routes were recorded by another model")
        self._record = Record(self.layers, route_dtype(self.num_experts) if compact else None, logits)
        self._replay = None if routes is None else (routes, routed)
        try:
            yield self._record
        finally:
            self._record, self._replay = None, None

    def _hook(self, layer: int, router: torch.nn.Module, args, output):
        record = self._record
        if record is None:
            return None
        logits, weights, chosen = output
        if self._replay is None:
            record.add(layer, chosen, chosen, logits)
            return None
        routes, routed = self._replay
        if routes.shape[0] != chosen.shape[0]:
            raise ValueError(f"router replay: {routes.shape[0]} routed rows given, the router sees {chosen.shape[0]}")
        given = routes[:, layer].to(chosen.device, chosen.dtype)
        used = torch.where(routed.to(chosen.device)[:, None], given, chosen)
        top = self._weighs[type(router).__name__](router, logits, used)
        record.add(layer, chosen, used, logits)
        return logits, top.to(weights.dtype), used

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def differs(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[..., layers] True where two routes [..., layers, k] chose different sets of experts (order aside)."""
    return (a.sort(dim=-1).values != b.to(a.dtype).sort(dim=-1).values).any(dim=-1)


def expert_counts(used: torch.Tensor, weight: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[layers, E] float64: how many (token, slot) assignments each expert got, counting row r `weight[r]` times
    (0 for padding). `used` [N, layers, k]."""
    layers, k = used.shape[1], used.shape[2]
    index = used.long().permute(1, 0, 2).reshape(layers, -1)  # [layers, N * k]
    w = weight.to(torch.float64).repeat_interleave(k).expand(layers, -1)
    return torch.zeros(layers, num_experts, dtype=torch.float64, device=used.device).scatter_add_(1, index, w)


def load_balancing_loss(record: Record, mask: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The Switch-style load-balancing loss of the last forward, as transformers' `load_balancing_loss_func`
    computes it (assignment shares and mean router probabilities pooled over layers and unpadded rows, E * their
    dot product), but counting the experts the forward used, so that under replay it balances the routing that ran.
    `mask` [N] 1 on real tokens."""
    if not record.logits[0]:
        raise ValueError("load_balancing_loss: the record holds no router logits; capture with logits=True")
    m = mask.reshape(-1).float()
    used = record.last("used")
    counts = expert_counts(used, m, num_experts).sum(0).float()
    probs = sum((torch.softmax(layer[-1], dim=-1).float() * m[:, None]).sum(0) for layer in record.logits)
    rows = m.sum() * used.shape[1]
    return num_experts * torch.sum((counts / rows) * (probs / rows))


def sampled_routes(forwards: list[torch.Tensor], prompt_lengths: list[int], n: int,
                   lengths: list[int]) -> list[torch.Tensor]:
    """Each sampled row's routes [len(prompt) + len(completion) - 1, layers, k] (the `Completion.routes` layout)
    from a decode loop's router record (`Record.forwards`): the prefill of the distinct prompts, left-padded
    [u * P rows], then one forward per decode step [B rows: u * n, prompt i's rows at i*n..]. Step t fed each row's
    completion token t, at position len(prompt) + t; a row's last token is never needed (nothing reads its output)."""
    layers, k = forwards[0].shape[1:]
    prefill = forwards[0].view(len(prompt_lengths), -1, layers, k).cpu()
    P, B = prefill.shape[1], len(lengths)
    steps = (torch.stack(forwards[1:], dim=1).cpu() if len(forwards) > 1
             else torch.empty(B, 0, layers, k, dtype=prefill.dtype))
    out = []
    for row, length in enumerate(lengths):
        p = prompt_lengths[row // n]
        if steps.shape[1] < length - 1:
            raise ValueError(f"sampled_routes: row {row} has {length} tokens, the record {steps.shape[1]} decode "
                             "steps: the record is not of this decode loop")
        out.append(torch.cat([prefill[row // n, P - p:], steps[row, :max(length - 1, 0)]])[:p + length - 1].clone())
    return out


def batch_routes(routes: list[torch.Tensor | None], lengths: list[int], width: int, layers: int, k: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows' routes laid out like a left-padded [b, width] batch of sequences of these `lengths`: routes
    [b, width, layers, k] and routed [b, width] bool (False on padding, on a row's last token and wherever a
    row has no routes)."""
    dtype = next((r.dtype for r in routes if r is not None), torch.uint8)
    out = torch.zeros(len(routes), width, layers, k, dtype=dtype)
    routed = torch.zeros(len(routes), width, dtype=torch.bool)
    for i, (r, length) in enumerate(zip(routes, lengths)):
        if r is None:
            continue
        if r.shape[0] > length - 1 or r.shape[1:] != (layers, k):
            raise ValueError(f"routes of row {i}: shape {tuple(r.shape)} for a sequence of {length} tokens and a "
                             f"model of {layers} MoE layers, top_k {k} (expected at most [{length - 1}, {layers}, "
                             f"{k}]): the sampler's model is not the trainer's")
        start = width - length
        out[i, start:start + r.shape[0]] = r.to(dtype)
        routed[i, start:start + r.shape[0]] = True
    return out, routed


def load_metrics(counts: torch.Tensor, top_k: int) -> dict[str, float]:
    """Expert load of a step from its [layers, E] assignment counts (`expert_counts`; each token makes `top_k`).
    `moe/expert_load_max`: the largest share of one layer's tokens that one expert received, the worst layer's
    (top_k / E when balanced, 1 when every token of a layer went to it). `moe/load_entropy`: each layer's entropy
    of its assignment shares divided by log E (1 balanced, 0 all on one expert), averaged over layers."""
    counts = counts.to(torch.float64)
    share = counts / counts.sum(-1, keepdim=True).clamp(min=1e-12)  # of the layer's assignments
    entropy = -(share * torch.log(share.clamp(min=1e-30))).sum(-1) / math.log(counts.shape[-1])
    return {"moe/expert_load_max": float(share.max()) * top_k, "moe/load_entropy": float(entropy.mean())}
