"""A step's training stats: per-token means and maxima, accumulated over passes and reduced over data-parallel ranks."""
from __future__ import annotations

from collections import defaultdict

import torch


class StepStats:
    """Means kept as (sum, count) and maxima, by name. Each rank adds its own rows; `reduced` combines the ranks
    (sums and counts added, maxima maxed), so a mean is over the whole step however its rows were shared out.
    Every rank must add the same names (sharded training runs the same passes on every rank, padding included)."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = defaultdict(float)
        self.counts: dict[str, float] = defaultdict(float)
        self.maxima: dict[str, float] = {}
        self.tallies: dict[str, torch.Tensor] = {}  # float64 tensors added elementwise (an MoE's expert counts)

    def add(self, name: str, total: float, count: float) -> None:
        """Add to a mean: `total` over `count` items (tokens)."""
        self.sums[name] += total
        self.counts[name] += count

    def max(self, name: str, value: float) -> None:
        self.maxima[name] = max(self.maxima.get(name, value), value)

    def tally(self, name: str, counts: torch.Tensor) -> None:
        """Add elementwise to a tally (every addition of a name has the same shape)."""
        counts = counts.detach().to("cpu", torch.float64)
        self.tallies[name] = self.tallies[name] + counts if name in self.tallies else counts.clone()

    def mean(self, name: str) -> float:
        return self.sums.get(name, 0.0) / max(self.counts.get(name, 0.0), 1)

    def reduced(self, group=None) -> "StepStats":
        """These statistics over every rank of `group` (a torch.distributed process group; None: this process's)."""
        out = StepStats()
        out.tallies = {k: v.clone() for k, v in self.tallies.items()}
        means, maxima = sorted(self.sums), sorted(self.maxima)
        s = torch.tensor([self.sums[k] for k in means] + [self.counts[k] for k in means], dtype=torch.float64)
        m = torch.tensor([self.maxima[k] for k in maxima], dtype=torch.float64)
        if group is not None:
            import torch.distributed as dist

            dist.all_reduce(s, group=group)
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
            for k in sorted(out.tallies):  # a copy: `reduced` may be asked more than once a step
                dist.all_reduce(out.tallies[k], group=group)
        for i, k in enumerate(means):
            out.add(k, float(s[i]), float(s[len(means) + i]))
        out.maxima.update(zip(maxima, m.tolist()))
        return out
