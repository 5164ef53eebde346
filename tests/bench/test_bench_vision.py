"""bench/bench_vision.py --quick runs end to end: both frameworks train the same tiny VLM, the table and the ratio print
(its times compare nothing at this size: not checked)."""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

if importlib.util.find_spec("trl") is None:
    pytest.skip("trl is not installed (pip install -e '.[bench]')", allow_module_level=True)

NUMBER = r"[0-9.]+(?:e-?[0-9]+)?"


def test_quick_bench_trains_both_and_prints_the_table():
    """A child process: TRL's trainer imports vLLM where it is installed, which changes the process it lands in."""
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_vision.py"), "--quick"], capture_output=True,
                       text=True, timeout=300, cwd=ROOT)
    out = r.stdout
    assert r.returncode == 0, out[-4000:] + r.stderr[-4000:]
    for framework in ("TRL", "tandem"):  # the tower and the language model both trained
        moved = re.search(rf"{framework} vision side ({NUMBER}), language model ({NUMBER})", out)
        assert moved, out[-4000:]
        assert float(moved[1]) > 0 and float(moved[2]) > 0, moved[0]
    assert re.search(rf"losses finite on both \(TRL -?{NUMBER}, tandem -?{NUMBER}", out), out[-4000:]
    for phase in ("rollout", "reward", "logprobs", "update", "step"):  # tandem s, TRL s (and their ratio)
        assert re.search(rf"^{phase} +{NUMBER} +{NUMBER}( +{NUMBER})?$", out, re.M), f"no {phase} row:\n{out[-3000:]}"
    assert re.search(rf"^ideal ratio at these proportions .*: {NUMBER}$", out, re.M), out[-3000:]
    last = out.strip().splitlines()[-1]
    assert re.fullmatch(rf"ratio tandem/TRL step time: {NUMBER} \((meets|misses) the 0.5 target\)", last), last
