"""Run metrics: a JSON line per step always, the trackers of run.report_to, PNG plots and a summary table at the end."""
from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

log = logging.getLogger("tandem.run.metrics")

METRICS_FILE = "metrics.jsonl"
# Every name a row may hold, with its unit and meaning: tandem.run.metric_names (a metric added to a row goes there
# too; tests/run/test_metric_names.py compares it with what the demos write).

# Curves drawn at the end of a run, if they were logged.
PLOTTED = ["reward/mean", "eval/accuracy", "train/accuracy", "loss", "kl", "entropy", "completion/length_mean",
           "logprob_diff", "time/step"]


class MetricsLog:
    """metrics.jsonl, the record (each row appended as it is logged; a resume cuts the rows it redoes), and every
    row passed on to the run's trackers (`tandem.run.trackers`)."""

    def __init__(self, output_dir: Path, resume_step: int | None = None, trackers=None):
        self.dir = output_dir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / METRICS_FILE
        self.history: list[dict] = []
        if resume_step is not None:
            self.history = resume_history(self.path, resume_step)
        else:
            self.path.write_text("")
        self.trackers = trackers

    def log(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, **{k: _clean(v) for k, v in metrics.items()}}
        self.history.append(row)
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self.trackers is not None:
            self.trackers.log(step, {k: v for k, v in row.items() if k != "step"})

    def close(self) -> None:
        if self.trackers is not None:
            self.trackers.close()

    def plot(self) -> Path | None:
        keys = [k for k in PLOTTED if any(k in r for r in self.history)]
        if not keys:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        cols = 3
        rows = math.ceil(len(keys) / cols)
        fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3 * rows), squeeze=False)
        for ax, k in zip(axes.flat, keys):
            pts = [(r["step"], r[k]) for r in self.history if isinstance(r.get(k), (int, float))]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="." if len(pts) < 30 else None)
            ax.set_title(k)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
        for ax in list(axes.flat)[len(keys):]:
            ax.axis("off")
        fig.tight_layout()
        out = self.dir / "curves.png"
        fig.savefig(out, dpi=80)
        plt.close(fig)
        return out

    def summary(self) -> str:
        """A table of the main metrics: first logged value, last value, and the best (max or min) seen."""
        lines = [f"{'metric':<28}{'first':>12}{'last':>12}{'best':>12}"]
        for k in PLOTTED + ["time/rollout", "time/update", "time/sync", "tokens_per_s"]:
            vals = [r[k] for r in self.history if isinstance(r.get(k), (int, float))]
            if not vals:
                continue
            best = min(vals) if k in ("loss", "logprob_diff") or k.startswith("time/") else max(vals)
            lines.append(f"{k:<28}{vals[0]:>12.4g}{vals[-1]:>12.4g}{best:>12.4g}")
        return "\n".join(lines)


def resume_history(path: Path, step: int) -> list[dict]:
    """The rows of `path` a run resumed from checkpoint `step` keeps, written back as the whole file.

    Rows after `step` are redone by the resumed run, so they go, and a line among them that does not parse (the
    tail a crash or a full disk tore: appends after the last checkpoint were never fsynced) goes with them, with
    a warning. A line that does not parse before that is an error: it is history the resumed run would keep."""
    if not path.is_file():
        return []
    lines = path.read_bytes().split(b"\n")
    kept: list[dict] = []
    last_kept = 0  # its line number
    for number, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            row = json.loads(raw)
            if not isinstance(row, dict) or not isinstance(row.get("step"), int):
                raise ValueError("not an object with an integer 'step'")
        except ValueError as exc:
            rest = [n for n, later in enumerate(lines[number:], number + 1) if later.strip()]
            if not rest or (kept and kept[-1]["step"] >= step):
                log.warning("%s: line %d is torn or unreadable (%s); cutting the file back to line %d, the last "
                            "one a resume from step %d keeps", path, number, _short(raw), last_kept, step)
                break
            raise ValueError(f"{path}:{number}: not a metrics row ({exc}): {_short(raw)}. This line is history "
                             f"before the checkpoint (step {step}) the run resumes from: repair or delete it") from None
        if row["step"] > step:
            break
        kept.append(row)
        last_kept = number
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:  # a new file renamed over the old: a crash now cannot lose the history kept
        f.write("".join(json.dumps(r) + "\n" for r in kept))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return kept


def _short(raw: bytes) -> str:
    text = raw.decode(errors="replace")
    return repr(text if len(text) <= 80 else text[:77] + "...")


def _clean(v):
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v
