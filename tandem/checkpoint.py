"""Checkpoints that survive a kill at any instant: written under a temporary name, then renamed into place."""
from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Callable

import numpy as np
import torch

STEP_DIR = re.compile(r"^step-(\d{8})$")


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under `root`, oldest first (a `.tmp` folder from an interrupted save is ignored)."""
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = STEP_DIR.match(p.name)
        if m and (p / "trainer_state.json").is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest(root: Path) -> Path | None:
    found = checkpoints(root)
    return found[-1][1] if found else None


def save(root: Path, step: int, write_model: Callable[[str], None], state: dict, keep: int) -> Path:
    """Write checkpoint `step`: the worker writes its files into a temporary folder, the trainer state goes
    last (its presence marks the folder complete), then one rename publishes it; older ones beyond `keep` go."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:08d}"
    tmp = root / f"step-{step:08d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    write_model(str(tmp))
    torch.save({"rng": rng_state()}, tmp / "rng.pt")
    (tmp / "trainer_state.json").write_text(json.dumps(state, indent=2))
    _fsync_dir(tmp)
    if final.exists():  # re-saving a step (e.g. after a resume): replace it only once the new one is whole
        old = root / f"step-{step:08d}.old"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    _fsync_dir(root)
    for _, p in checkpoints(root)[:-keep]:
        shutil.rmtree(p, ignore_errors=True)
    return final


def load_state(folder: Path) -> dict:
    state = json.loads((folder / "trainer_state.json").read_text())
    set_rng_state(torch.load(folder / "rng.pt", weights_only=False)["rng"])
    return state


def _fsync_dir(path: Path) -> None:
    for f in path.iterdir():
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
