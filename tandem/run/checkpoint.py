"""Checkpoints that survive a kill at any instant (temporary name, then rename), checked before a resume loads one."""
from __future__ import annotations

import fnmatch
import hashlib
import json
import logging
import os
import re
import shutil
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterable

import torch

from tandem.modeling import ModelFolderError, check_model_files, check_safetensors
from tandem.run.card import CARD_FILE
from tandem.util.rng import rng_state, set_rng_state

log = logging.getLogger("tandem.run.checkpoint")

STEP_DIR = re.compile(r"^step-(\d{8})$")
# Every file of a checkpoint with its size and checksum, written into the folder before the rename publishes it.
CHECKSUMS = "checksums.json"
# xxh3_128 (the xxhash package): several times sha256's rate (bench/bench_checkpoint.py prints both). It finds
# accidental damage (a flipped bit, a torn copy); it is no defence against someone who edits files on purpose. The
# list records the algorithm it used.
ALGORITHM = "xxh3_128"
CHUNK = 4 << 20  # bytes read at a time: memory stays bounded whatever the file's size
HASH_THREADS = max(1, min(8, os.cpu_count() or 1))  # one file per thread; both hashes release the GIL
# An unlisted file in a checkpoint is damage where a resume or a loader (transformers, vLLM, PEFT) would read it:
# weights, optimizer or RNG state, configs, tokenizer files. Anything else (notes, a subfolder) is left alone.
READ_BY_LOADERS = ("*.safetensors", "*.pt", "*.pth", "*.bin", "*.json", "*.model", "*.tiktoken", "merges.txt",
                   "vocab.txt")


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
    """Why checkpoint `folder` cannot be resumed from; empty if it can. First what headers, sizes and small files
    show (a truncated, missing or garbled file), then the folder against its checksums.json: every listed file
    present at its size, no unlisted file a loader reads, and, where nothing else is wrong, every byte of every
    file read back (streaming, CHUNK at a time) against its checksum, which finds a flipped bit inside the tensor
    data. A checkpoint without checksums.json (an older tandem's) is checked without them: see `unverified`."""
    found: list[str] = []
    state = None
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
    promised = isinstance(state, dict) and state.get("checksums") == CHECKSUMS
    return found + _checksum_problems(folder, found, promised)


def damage(folder: Path) -> list[str]:
    """`problems` of `folder` where it is a checkpoint tandem saved (its trainer state or CHECKSUMS says so), for a
    command that reads one without resuming it (eval, export); none for any other folder (a Hugging Face model, an
    export), which records nothing to check its files against."""
    if (folder / "trainer_state.json").is_file() or (folder / CHECKSUMS).is_file():
        return problems(folder)
    return []


def unverified(folder: Path) -> str | None:
    """Why the files of checkpoint `folder` cannot be checked against checksums (to warn about), or None."""
    if not (folder / CHECKSUMS).is_file():
        return f"it has no {CHECKSUMS} (saved by a tandem from before checksums)"
    return None


def write_checksums(folder: Path, algorithm: str = ALGORITHM) -> dict:
    """List every file under `folder` (but the list itself) with its size and checksum in `folder`/CHECKSUMS.
    The files were just written, so they are read back from the page cache, not the disk: the writers
    (safetensors, torch.save, a tokenizer's save_pretrained, perhaps in another process) take no hashing sink."""
    names = sorted(n for n in (p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
                   if n != CHECKSUMS)
    sums = _digests(folder, names, algorithm)
    listed = {"format": 1, "algorithm": algorithm,
              "files": {n: {"bytes": (folder / n).stat().st_size, algorithm: sums[n]} for n in names}}
    (folder / CHECKSUMS).write_text(json.dumps(listed, indent=1))
    return listed


def _checksum_problems(folder: Path, found: list[str], promised: bool) -> list[str]:
    """`folder` against its CHECKSUMS. `found`: what the other checks found (their files are not named twice, and
    a checkpoint they already reject is not read in full); `promised`: its trainer state says it has the list."""
    path = folder / CHECKSUMS
    if not path.is_file():
        return [f"{CHECKSUMS}: missing, though trainer_state.json says the save wrote one"] if promised else []
    try:
        listed = json.loads(path.read_text())
        algorithm, files = listed["algorithm"], listed["files"]
        entries = {n: (int(e["bytes"]), str(e[algorithm])) for n, e in files.items()}
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
        return [f"{CHECKSUMS}: unreadable, {_why(exc)}: the list of the checkpoint's files is damaged"]
    if algorithm != "xxh3_128" and algorithm not in hashlib.algorithms_available:
        return [f"{CHECKSUMS}: names the checksum {algorithm!r}, which is none tandem knows: the list is damaged"]

    def named(name: str) -> bool:  # a file the other checks reported already
        return any(f.startswith(f"{name}:") for f in found)

    out: list[str] = []
    for name, (size, _) in entries.items():
        file = folder / name
        if not file.is_file():
            out += [] if named(name) else [f"{name}: missing ({CHECKSUMS} lists it)"]
        elif file.stat().st_size != size and not named(name):
            out.append(f"{name}: {file.stat().st_size} bytes, {size} when saved: the file changed after it was saved")
    for file in sorted(folder.iterdir()):
        if (file.is_file() and file.name != CHECKSUMS and file.name not in entries
                and any(fnmatch.fnmatch(file.name, pattern) for pattern in READ_BY_LOADERS)):
            out.append(f"{file.name}: not in {CHECKSUMS}: added after the save, and a resume or a loader reads it")
    if out or found or unverified(folder):
        return out  # rejected already, or not checkable here: not worth reading every byte
    start = time.perf_counter()
    sums = _digests(folder, sorted(entries), algorithm, errors=True)
    for name, (_, recorded) in entries.items():
        if isinstance(sums[name], OSError):  # EIO from a failing disk is damage too
            out.append(f"{name}: unreadable, {_why(sums[name])}")
        elif sums[name] != recorded:
            out.append(f"{name}: checksum mismatch ({algorithm} {recorded} recorded, {sums[name]} now): the file "
                       "changed after it was saved")
    log.info("%s: %d files, %.1f MB, checked against %s in %.2f s", folder, len(entries),
             sum(size for size, _ in entries.values()) / 1e6, CHECKSUMS, time.perf_counter() - start)
    return out


def _digests(folder: Path, names: list[str], algorithm: str, errors: bool = False) -> dict:
    """Each file's checksum, up to HASH_THREADS files at once; `errors`: an OSError is returned in its place."""
    def one(name: str):
        try:
            return _digest(folder / name, algorithm)
        except OSError as exc:
            if not errors:
                raise
            return exc

    with ThreadPoolExecutor(min(HASH_THREADS, max(1, len(names)))) as pool:
        return dict(zip(names, pool.map(one, names)))


def _digest(path: Path, algorithm: str) -> str:
    if algorithm == "xxh3_128":
        import xxhash

        h = xxhash.xxh3_128()
    else:
        h = hashlib.new(algorithm)
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def save(root: Path, step: int, write_model: Callable[[str], None], state: dict, keep: int,
         flush_first: Iterable[Path] = (), card: str = "") -> Path:
    """Write checkpoint `step`: the worker writes its files into a temporary folder, then the RNG and trainer
    states (the trainer state's presence marks a folder as a checkpoint) and the model card `card` (README.md),
    then CHECKSUMS listing every file's size and checksum; all are fsynced and one rename publishes the folder;
    older ones beyond `keep` go. `flush_first`: files a resume reads up to this step (the metrics log), put on disk
    before the rename."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:08d}"
    tmp = root / f"step-{step:08d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        write_model(str(tmp))
        torch.save({"rng": rng_state()}, tmp / "rng.pt")
        state = {**state, "checksums": CHECKSUMS}  # a resume that finds none then knows it was lost
        (tmp / "trainer_state.json").write_text(json.dumps(state, indent=2))
        if card:
            (tmp / CARD_FILE).write_text(card)
        write_checksums(tmp)
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
