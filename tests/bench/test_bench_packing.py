"""bench/bench_packing.py --quick runs end to end: both layouts update through the trainer, and the table prints with
their throughputs, peaks and ratios (its times compare nothing at this size: not checked)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NUMBER = r"[0-9.]+"


def test_quick_bench_updates_both_layouts_and_prints_the_table():
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_packing.py"), "--quick"], capture_output=True,
                       text=True, timeout=300, cwd=ROOT)
    out = r.stdout
    assert r.returncode == 0, out[-4000:] + r.stderr[-4000:]
    assert re.search(r"lognormal\(median 24, sigma 1.3\) clipped to \[16, 2048\], seed 0", out), out[-3000:]
    for layout in ("padded", "packed"):  # micro-batches, positions, update s, tok/s, peak MB, the two ratios
        assert re.search(rf"^{layout}( +{NUMBER}){{7}}$", out, re.M), out[-3000:]
    last = out.strip().splitlines()[-1]
    assert re.fullmatch(rf"packed / padded throughput: {NUMBER}x \((meets|misses) the 1.5x target\)", last), last
