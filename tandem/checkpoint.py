"""Checkpoints that survive a kill at any instant (temporary name, then rename), checked before a resume loads one."""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import zipfile
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import torch

from tandem.modeling import ModelFolderError, check_model_files, check_safetensors

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


def partial(root: Path) -> list[Path]:
    """Folders of saves that did not finish (killed mid-write): never read, but holding disk space."""
    return sorted(root.glob("step-*.tmp")) if root.is_dir() else []


def problems(folder: Path) -> list[str]:
    """Why checkpoint `folder` cannot be resumed from; empty if it can. Reads headers and small files only (what a
    truncated, missing or garbled file shows), nothing as large as the weights or the optimizer state."""
    found: list[str] = []
    try:
        state = json.loads((folder / "trainer_state.json").read_text())
        if not isinstance(state, dict) or not isinstance(state.get("step"), int) or "data" not in state:
            found.append("trainer_state.json: no 'step' and 'data' in it")
        elif (m := STEP_DIR.match(folder.name)) and int(m.group(1)) != state["step"]:
            found.append(f"trainer_state.json: says step {state['step']}, not {int(m.group(1))}")
    except (OSError, ValueError) as exc:
        found.append(f"trainer_state.json: {_why(exc)}")
    try:
        rng = torch.load(folder / "rng.pt", weights_only=False)["rng"]
        if set(rng) != {"python", "numpy", "torch"}:
            found.append(f"rng.pt: holds {sorted(rng)}, not the python, numpy and torch generator states")
    except Exception as exc:  # noqa: BLE001 - whatever a damaged pickle raises, the checkpoint is unusable
        found.append(f"rng.pt: {_why(exc)}")
    if (folder / "adapter_config.json").is_file():  # a LoRA run's: the adapter alone, in PEFT's format
        try:
            check_safetensors(folder / "adapter_model.safetensors")
        except (ModelFolderError, OSError) as exc:
            found.append(f"the adapter: {_why(exc) if isinstance(exc, OSError) else exc}")
    elif not any(folder.glob("*.safetensors")):
        found.append("no model weights (*.safetensors)")
    else:
        try:
            check_model_files(folder)  # config.json, the shard index, each shard's header against its size
        except (ModelFolderError, OSError) as exc:
            found.append(str(exc))
    optimizers = sorted(folder.glob("optimizer*.pt"))
    if not optimizers:
        found.append("no optimizer state (optimizer*.pt)")
    for path in optimizers:
        try:
            zipfile.ZipFile(path).close()  # torch.save writes a zip; a truncated one has lost its directory
        except (OSError, zipfile.BadZipFile) as exc:
            found.append(f"{path.name}: {_why(exc)}")
    ranks = [re.fullmatch(r"optimizer-rank(\d+)-of-(\d+)\.pt", p.name) for p in optimizers]
    for size in {int(m.group(2)) for m in ranks if m}:
        missing = sorted(set(range(size)) - {int(m.group(1)) for m in ranks if m and int(m.group(2)) == size})
        if missing:
            found.append(f"optimizer state of {size} ranks lacks rank(s) {missing}")
    return found


def save(root: Path, step: int, write_model: Callable[[str], None], state: dict, keep: int,
         flush_first: Iterable[Path] = ()) -> Path:
    """Write checkpoint `step`: the worker writes its files into a temporary folder, the trainer state goes
    last (its presence marks the folder complete), then one rename publishes it; older ones beyond `keep` go.
    `flush_first`: files a resume reads up to this step (the metrics log), put on disk before the rename."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:08d}"
    tmp = root / f"step-{step:08d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        write_model(str(tmp))
        torch.save({"rng": rng_state()}, tmp / "rng.pt")
        (tmp / "trainer_state.json").write_text(json.dumps(state, indent=2))
        for path in flush_first:
            if path.is_file():  # nothing logged yet: nothing to flush
                _fsync_file(path)
        _fsync_dir(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a part-written checkpoint must not keep the space a full disk needs
        raise
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


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as fh:  # fsync flushes the file's data whichever descriptor wrote it
        os.fsync(fh.fileno())


def _fsync_dir(path: Path) -> None:
    for f in path.iterdir():
        if f.is_file():
            _fsync_file(f)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _why(exc: BaseException) -> str:
    if isinstance(exc, FileNotFoundError):
        return "missing"
    return f"{type(exc).__name__}: {exc}"
