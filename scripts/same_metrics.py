"""Whether four short `tandem demo` runs (text, MoE, tools, vision) log the same metrics but timings: a refactor check.

    .venv/bin/python scripts/same_metrics.py --save metrics-before       # on the code before the change
    .venv/bin/python scripts/same_metrics.py --against metrics-before    # on the changed code: exit 1 on a difference
    .venv/bin/python scripts/same_metrics.py --demos text --against metrics-before run.seed=1   # extra overrides

It runs the demos of the checkout it is started in (the current directory's `tandem`, `examples/`), one torch thread
each, into their own folders under --runs (a new temporary folder by default). Every metric but timings and memory
(tandem.run.metric_names.MACHINE_MEASURED) must be equal exactly, floats too: the same code path on the
same machine is bit-identical, so any difference is a change of behaviour, not noise. The demos' models come from
the demo cache (tandem.demo.cache_root: $TANDEM_CACHE, else ~/.cache/tandem), shared by every checkout: a change to
a model's builder that keeps its spec reuses the model built before it, unchecked. Set TANDEM_CACHE to an empty
folder to build the four anew (10-20 minutes on 2 busy cores) and check the builders too: a build is deterministic,
so the same code builds the cached model bit for bit.
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# tandem.run.metric_names.MACHINE_MEASURED, restated: this process imports no tandem, so that it runs against a
# checkout from before that name existed (the code before a refactor)
TIMING = ("time/", "tokens_per_s", "rollout/tokens_per_s", "memory/")
DEMOS: dict[str, list[str]] = {
    "text": [],
    "moe": ["--config", "examples/moe.yaml"],
    "tools": ["--config", "examples/tools.yaml"],
    "vision": ["--config", "examples/vision.yaml"],
}
# Short runs that still evaluate at step 0, in the middle and at the end, and save a checkpoint at the end.
SHORT = ["run.steps=6", "run.eval_every=3", "run.save_every=0", "data.eval_size=64", "run.threads=1",
         "run.progress=false", "run.plots=false", "run.report_to=none"]


def without_timing(rows: list[dict]) -> list[dict]:
    """The rows with the keys that differ from run to run (wall times, throughputs, memory) left out."""
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows]


def run_demo(name: str, out: Path, overrides: list[str]) -> list[dict]:
    """`tandem demo` for one demo into `out`, in the current directory; its metrics.jsonl rows, timings left out."""
    command = [sys.executable, "-m", "tandem.cli", "demo", *DEMOS[name], *SHORT, f"run.output_dir={out}",
               *overrides]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{name}: `{' '.join(command)}` failed (rc {done.returncode}):\n{done.stderr[-3000:]}")
    print(f"{name}: ran in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    with open(out / "metrics.jsonl") as f:
        return without_timing([json.loads(line) for line in f if line.strip()])


def same(a: object, b: object) -> bool:
    """Exact equality; a NaN logged by both runs counts as the same value."""
    both_nan = isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)
    return both_nan or (a == b and type(a) is type(b))


def first_difference(before: list[dict], after: list[dict]) -> str | None:
    """The first row (in log order) and key whose value differs, or a different number of rows; None if all equal."""
    for old, new in zip(before, after):
        for key in sorted(old.keys() | new.keys()):
            if not same(old.get(key, "absent"), new.get(key, "absent")):
                return f"step {old.get('step')}: {key}: {old.get(key, 'absent')!r} -> {new.get(key, 'absent')!r}"
    if len(before) != len(after):
        return f"{len(before)} rows before, {len(after)} now"
    return None


def compare(name: str, before: list[dict], after: list[dict]) -> bool:
    """Print the demo's steps compared and its first difference; whether it has none."""
    steps = sorted({r["step"] for r in after})
    found = first_difference(before, after)
    print(f"{name}: {len(after)} rows, steps {steps[0]}..{steps[-1]}, "
          f"{len({k for r in after for k in r}) - 1} metrics: {'DIFFERENT, ' + found if found else 'equal'}")
    return found is None


def tandem_location() -> str:
    """Where the demos' `tandem` is imported from (the current directory first, as `python -m` puts it)."""
    code = "import tandem; print(tandem.__file__)"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("overrides", nargs="*", help="key=value added to every demo's overrides (e.g. run.seed=1)")
    p.add_argument("--save", type=Path, help="write each demo's rows to DIR/<demo>.jsonl")
    p.add_argument("--against", type=Path, help="compare with the rows --save wrote there; exit 1 on a difference")
    p.add_argument("--runs", type=Path, help="the demos' output folders go under it (default: a new temporary one)")
    p.add_argument("--demos", nargs="+", choices=list(DEMOS), default=list(DEMOS), help="which demos (default all)")
    args = p.parse_args(argv)
    if not (args.save or args.against):
        p.error("give --save DIR, --against DIR, or both")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    runs = args.runs or Path(tempfile.mkdtemp(prefix="same-metrics-"))
    print(f"tandem from {tandem_location()}; runs under {runs}", file=sys.stderr)
    equal = True
    for name in args.demos:
        rows = run_demo(name, runs / name, args.overrides)
        if args.save:
            args.save.mkdir(parents=True, exist_ok=True)
            (args.save / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        if args.against:
            with open(args.against / f"{name}.jsonl") as f:
                equal &= compare(name, [json.loads(line) for line in f if line.strip()], rows)
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
