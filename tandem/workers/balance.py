"""Split work across workers by cost, not by count: the longest items first, each onto the lightest worker."""
from __future__ import annotations


def balance(costs: list[float], parts: int) -> list[list[int]]:
    """Indices of `costs` in `parts` lists of near-equal total cost (LPT: within 4/3 of the best split).

    Ties go to the lower part, and each list is ascending, so every worker computing this gets the same answer.
    """
    loads = [0.0] * parts
    out: list[list[int]] = [[] for _ in range(parts)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        j = min(range(parts), key=lambda j: (loads[j], j))
        out[j].append(i)
        loads[j] += costs[i]
    return [sorted(x) for x in out]
