"""bench/gpu_check.py --dry-run: every check of the GPU script run on the CPU through its own plumbing (argument
handling, one child process per check, the report), so that the script a lent GPU runs first has not rotted."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.py"
HAS_VLLM = importlib.util.find_spec("vllm") is not None
# Not `importorskip("ray")`: importing Ray here, before the Ray test modules set its environment (RAY_AUTH_MODE...),
# made a later ray.init(address=...) wait forever on its GCS connection (seen: tests/workers/test_multinode.py).
# The whole dry run starts Ray (its heavy checks); the quick tier leaves this module out.
pytestmark = [pytest.mark.ray,
              pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed")]


def _checks() -> list[str]:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return list(mod.CHECKS)


# Left out of the suite's dry run for time (each starts a vLLM engine, most of them Ray too, on the CPU: 15-45 s
# apiece; the whole dry run takes 4 min on 2 cores), each run on the CPU elsewhere in the suite: the suite runs the
# vLLM placements in tests/workers/test_vllm_*.py (gpt-oss-sync's and moe-sync's: the zoo's vLLM steps on gpt-oss and
# the MoE models), nccl's sharded-against-plain loss on gloo in tests/train/test_parallel.py, cp2's context parallel
# on gloo in tests/train/test_context_parallel.py and (Ray, the hf engine) tests/workers/test_placement.py, and
# trl-vllm is a timing (TRL's loss match: tests/bench/test_trl_match.py). `python bench/gpu_check.py --dry-run` runs
# them all.
HEAVY = ["vllm-sleep", "vllm-train", "colocated-ray", "tp2-engine", "split-channel", "lora-vllm", "vllm-stream",
         "stream-split", "gpt-oss-sync", "mla-sync", "vision", "vision-ray", "moe-sync", "nccl", "trl-vllm", "cp2"]


@pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed: its checks would fail")
def test_the_gpu_checks_pass_their_dry_run_on_the_cpu(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--skip", *HEAVY], capture_output=True,
                          text=True, timeout=900, cwd=tmp_path)
    report = done.stdout[done.stdout.rindex("check          result"):] if "check          result" in done.stdout else ""
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    verdicts = {line.split()[0]: line.split()[1] for line in report.splitlines()[1:] if line.strip()}
    assert verdicts == {name: "PASS" for name in _checks() if name not in HEAVY}, report


def test_a_failing_check_fails_the_script_and_the_others_still_report(tmp_path):
    """A check whose child cannot produce a result (here: one second is too short for any) is a FAIL with its
    reason; the script exits 1 and still prints every check's line."""
    done = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--only", "offload", "memory", "--timeout", "1"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 1, done.stdout[-3000:]
    assert "offload        FAIL    no result within 1 s (a hang?)" in done.stdout
    assert "memory         FAIL    no result within 1 s (a hang?)" in done.stdout
