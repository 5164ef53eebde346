"""Resharding across 4 gloo processes, bit-exact: the reference article's four cases, FSDP -> TP x DP, disjoint
trainer -> sampler ranks, flat ZeRO streamed through a tiny bucket, and real FSDP2 / TP DTensors. One spawn runs
every case (each process pays for `import torch` once); each case is its own test."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' shared helpers
import reshard_cases  # noqa: E402
from conftest import free_port  # noqa: E402

WORLD = 4
CASES = (list(reshard_cases.layout_cases()) + ["fsdp2_4", "fsdp2_x_tp_2x2", "fsdp2_x_cp_x_tp_1x2x2"]
         + reshard_cases.CHANNEL_CASES)


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory) -> list[dict[str, str]]:
    import torch.multiprocessing as mp

    folder = tmp_path_factory.mktemp("reshard")
    old = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(folder)
    try:
        mp.spawn(reshard_cases.worker, args=(WORLD, free_port(), str(folder), free_port()), nprocs=WORLD, join=True)
    finally:
        if old is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = old
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.parametrize("case", CASES)
def test_case(verdicts, case):
    failures = {r: v[case] for r, v in enumerate(verdicts) if v[case] != "ok"}
    assert not failures, failures
