"""StepStats: token-weighted means as (sum, count), maxima, and their reduction over data-parallel ranks."""
from __future__ import annotations

import pytest
import torch.multiprocessing as mp

from conftest import free_port
from tandem.train.stats import StepStats


def test_means_are_sums_over_counts_and_maxima_are_maxima():
    s = StepStats()
    s.add("kl", 3.0, 4)
    s.add("kl", 1.0, 4)  # a second pass over the same tokens (mu = 2) counts them again
    s.max("diff", 0.5)
    s.max("diff", 0.25)
    assert s.mean("kl") == 0.5 and s.maxima["diff"] == 0.5
    assert s.mean("never_added") == 0.0  # no tokens: 0, not a division by zero
    r = s.reduced()  # one process: the same numbers, in a new object
    assert r is not s and r.mean("kl") == 0.5 and r.maxima == {"diff": 0.5}


def _rank(rank: int, port: int, out) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    s = StepStats()
    s.add("entropy", [1.0, 5.0][rank], [1, 3][rank])  # rank 1 holds more tokens
    s.max("logprob_diff", [0.1, 0.7][rank])
    r = s.reduced(dist.group.WORLD)
    out.put((rank, r.mean("entropy"), r.maxima["logprob_diff"]))
    dist.destroy_process_group()


def test_reduced_over_ranks_weights_each_ranks_tokens():
    port = free_port()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    got = sorted(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    # (1 + 5) / (1 + 3) tokens, not the mean of the ranks' means (1 and 5/3)
    assert got == [(0, pytest.approx(1.5), pytest.approx(0.7)), (1, pytest.approx(1.5), pytest.approx(0.7))]
