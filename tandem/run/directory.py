"""The run directory: one run at a time (a lock), writable before models load, a previous run resumed or refused."""
from __future__ import annotations

import datetime
import errno
import fcntl
import json
import logging
import os
import shlex
import shutil
import socket
import sys
import tempfile
from pathlib import Path
from typing import Literal

from tandem.config.trackers import TRACKERS
from tandem.run import checkpoint
from tandem.run.evaluation import RESULTS_FILE
from tandem.run.metrics import METRICS_FILE, resume_history
from tandem.run.trackers import IDS_FILE

log = logging.getLogger("tandem.run.directory")

LOCK_FILE = "tandem.lock"
WRITE_TEST = ".tandem-write-test-"  # check_writable's file, left behind only by a kill in that instant
# What a run writes into its directory: a start that replaces a previous run removes these and nothing else.
RUN_FILES = ("checkpoints", METRICS_FILE, "curves.png", RESULTS_FILE, IDS_FILE,
             *(store for _, store in TRACKERS.values()))  # run.report_to's local stores

# start: a new run; refused over a run that has checkpoints. resume: continue from the newest valid checkpoint,
# refused where there is none. resume_or_start: resume, or where there is no checkpoint start over what a run left
# without one (a requeued job's command: the job may have been killed before its first checkpoint).
# replace: a new run that removes the previous one's files first (the demo, which is meant to be rerun).
Start = Literal["start", "resume", "resume_or_start", "replace"]


class RunDirError(ValueError):
    """The run directory cannot be used as asked. The message names the directory, what is wrong and the fix."""


def claim(out: Path, start: Start) -> tuple["RunLock", Path | None]:
    """Make `out` this run's: writable, locked for the run's lifetime, its previous contents dealt with as `start`
    says. Returns the lock (release it when the run ends) and the checkpoint to resume from, if any."""
    if start == "resume" and not out.exists():  # a typo must not leave a directory behind
        raise _no_checkpoint(out, "does not exist")
    check_writable(out)
    lock = RunLock.take(out)
    try:
        return lock, _starting_point(out, start)
    except BaseException:
        lock.release()
        raise


def check_writable(out: Path) -> None:
    """Create `out` if needed and create a file in it (and in its checkpoints folder): found now, not at the first
    checkpoint, and by trying, since permission bits say nothing to root and nothing about read-only mounts."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RunDirError(f"run.output_dir {out} cannot be created: {_os_error(exc)}. Set run.output_dir to a "
                          "directory this user can create and write") from exc
    for folder in (out, out / "checkpoints"):
        if folder.is_dir():
            try:
                with tempfile.NamedTemporaryFile(dir=folder, prefix=WRITE_TEST):
                    pass
            except OSError as exc:
                raise RunDirError(f"run.output_dir {out} is not writable ({folder}: {_os_error(exc)}). Make it "
                                  "writable, or set run.output_dir to a directory this user can write") from exc


class RunLock:
    """An exclusive `flock` on `<run.output_dir>/tandem.lock`, held while the run lives. The file holds the holder's
    pid, host, start time and command, so a refused run can name it. The kernel drops the lock when the holder
    dies however it dies; a holder that could not release it (kill -9) leaves its details behind, which is how
    the next run knows it takes over a dead run's lock. The descriptor is close-on-exec, so processes the run
    starts (reward workers, Ray, a vLLM server) do not hold it."""

    def __init__(self, path: Path, fd: int):
        self.path, self.fd = path, fd

    @classmethod
    def take(cls, out: Path) -> "RunLock":
        path = out / LOCK_FILE
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise RunDirError(f"run.output_dir {out}: cannot open its lock file: {_os_error(exc)}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _read_holder(fd)
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise RunDirError(
                    f"run.output_dir {out} is in use by another run ({_describe(holder)}); two runs in one directory "
                    f"would mix their checkpoints and metrics. Wait for it to end or stop it, or set run.output_dir "
                    f"to another directory") from None
            raise RunDirError(f"run.output_dir {out}: cannot lock {path}: {_os_error(exc)} (a filesystem "
                              "without flock?). Put run.output_dir on a local filesystem") from exc
        stale = _read_holder(fd)
        if stale:
            log.warning("run.output_dir %s: taking over the lock of a run that ended without releasing it (%s): "
                        "it was killed or crashed; its last checkpoint is what a --resume continues from",
                        out, _describe(stale))
        me = {"pid": os.getpid(), "host": socket.gethostname(),
              "since": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
              "command": shlex.join(sys.argv)}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        return cls(path, fd)

    def release(self) -> None:
        """Empty the file (a clean end: nothing for the next run to take over), then drop the lock."""
        if self.fd is None:
            return
        try:
            os.ftruncate(self.fd, 0)
        except OSError:
            pass  # the lock still goes with the descriptor; the next run only logs a takeover
        finally:
            os.close(self.fd)
            self.fd = None


def live_holder(out: Path) -> dict | None:
    """The details of the run that holds `out`'s lock now ({} where it has not written them yet), or None where
    none does. Probed with a shared lock taken and dropped at once, writing nothing; a run starting in that same
    instant would be refused as if `out` were in use."""
    try:
        fd = os.open(out / LOCK_FILE, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None  # no lock file: no run there
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        return _read_holder(fd) if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN) else None
    finally:
        os.close(fd)  # drops the probe's lock with the descriptor
    return None


def run_within(folder: Path) -> str | None:
    """What of a run `folder` holds, itself or below it, described for a refusal, or None: the directory of a run
    in use (its lock held), a run's files (metrics, checkpoints), a checkpoint. Replacing `folder` (`tandem export
    --force`) would delete that run, perhaps under a trainer still writing it. Symlinks below are not followed,
    as a recursive delete does not follow them."""
    for here, dirs, files in os.walk(folder):
        place = Path(here)
        holder = live_holder(place) if LOCK_FILE in files else None
        if holder is not None:
            return f"the directory of a run in use, {place} ({_describe(holder)})"
        mine = [name for name in (METRICS_FILE, "checkpoints") if name in files or name in dirs]
        if mine:
            return f"a run's files ({', '.join(str(place / name) for name in mine)})"
        if "trainer_state.json" in files:
            return f"a checkpoint ({place})"
    return None


def refuse_export_into(checkpoint: Path, out: Path) -> None:
    """Refuse (ValueError) a folder `out` for `tandem export` of `checkpoint` that is, holds or is inside the
    checkpoint, holds another checkpoint or a run's files, or a run in use: --force would delete them, or the run
    would (it prunes old checkpoints), or the export would change the checkpoint. Judged on resolved paths: a symlink
    counts as what it points at."""
    source, dest = checkpoint.resolve(), out.resolve()
    inside = next((p for p in dest.parents if p == source or (p / "trainer_state.json").is_file()), None)
    if dest == source:
        what = "is the checkpoint exported: the merged model would replace it"
    elif source.is_relative_to(dest):
        what = f"holds the checkpoint exported ({checkpoint}): --force would delete it"
    elif inside is not None:
        which = "the checkpoint exported" if inside == source else f"checkpoint {inside}"
        what = (f"is inside {which}: the export would change it, and go with it when its run deletes old "
                "checkpoints")
    elif dest.is_dir() and (held := run_within(dest)):
        what = f"holds {held}: --force would delete that"
    else:
        return
    link = f" (which resolves to {dest})" if dest != out.absolute() else ""
    raise ValueError(f"export: {out}{link} {what}. Choose a new output folder that holds no checkpoint and no run, "
                     "and is inside no checkpoint (e.g. merged/ beside the run's directory)")

def _starting_point(out: Path, start: Start) -> Path | None:
    root = out / "checkpoints"
    found = checkpoint.checkpoints(root)
    if start in ("start", "replace"):
        if found and start == "start":
            raise RunDirError(
                f"run.output_dir {out} already holds a run (checkpoints up to step {found[-1][0]}); a new run "
                f"would overwrite it. Continue it with --resume, or set run.output_dir to a new directory (or "
                f"delete this one) to start afresh")
        mine = [name for name in RUN_FILES if (out / name).exists()]
        if mine:
            log.warning("run.output_dir %s: removing what a previous run left there (%s) to start a new run",
                        out, ", ".join(mine))
        _remove(out, mine)
        return None
    if not found:
        left = _previous_run(out)
        if start == "resume_or_start":
            _start_over(out, left)
            return None
        raise _no_checkpoint(out, f"holds {', '.join(left)} but no checkpoint" if left else "is empty")
    for partial in checkpoint.partial(root):  # a save cut short; safe to remove under the lock
        log.info("removing %s, a checkpoint whose save did not finish", partial)
        shutil.rmtree(partial, ignore_errors=True)
    rejected: list[tuple[Path, str]] = []
    for step, folder in reversed(found):
        problems = checkpoint.problems(folder)
        if not problems:
            unverified = checkpoint.unverified(folder)
            if unverified:
                log.warning("checkpoint %s cannot be verified: %s; its headers and sizes were checked, not its bytes",
                            folder, unverified)
            resume_history(out / METRICS_FILE, step)  # checked now, before the models load
            for bad, why in rejected:  # out of the way of pruning and "latest", kept for inspection
                aside = bad.with_name(bad.name + ".bad")
                shutil.rmtree(aside, ignore_errors=True)
                os.rename(bad, aside)
                log.warning("checkpoint %s cannot be resumed from (%s): set aside as %s", bad, why, aside.name)
            return folder
        rejected.append((folder, "; ".join(problems)))
    raise RunDirError(f"--resume: no checkpoint in {root} can be resumed from: "
                      + " | ".join(f"{folder.name}: {why}" for folder, why in rejected)
                      + f". Repair one, or delete {root} to start a new run there, or use another run.output_dir")


def _remove(out: Path, names: list[str]) -> None:
    for name in names:
        p = out / name
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


def _start_over(out: Path, left: list[str]) -> None:
    """--resume-or-start where no checkpoint was found: start, over what a run killed before its first checkpoint
    left (its metrics, tracker files, an unfinished save), which a requeue of the same command must not be refused
    on forever. Anything else there is refused, and nothing removed: this is not that run's directory (a typo?),
    or its checkpoints went somewhere a new run must not overwrite (set aside as .bad, a damaged step folder)."""
    if not left:
        log.info("run.output_dir %s holds no run yet: starting one", out)
        return
    foreign = _not_left_without_a_checkpoint(out)
    if foreign:
        raise RunDirError(
            f"--resume-or-start: run.output_dir {out} holds no checkpoint to resume from, and {', '.join(foreign)}, "
            f"which a run stopped before its first checkpoint does not leave: starting over could lose it. Check "
            f"run.output_dir for a typo; to start a new run there, move those out of it (or delete them)")
    # the checkpoints folder stays, emptied (it may be a link to another disk); the rest goes as a new run's does
    mine = [name for name in RUN_FILES if name != "checkpoints" and (out / name).exists()]
    unfinished = [f"checkpoints/{p.name}" for p in checkpoint.partial(out / "checkpoints")]
    log.warning("run.output_dir %s holds no checkpoint, only what a run stopped before its first checkpoint left: "
                "starting the run over, removing %s", out, ", ".join(mine + unfinished) or "nothing")
    _remove(out, mine + unfinished)


def _not_left_without_a_checkpoint(out: Path) -> list[str]:
    """What in `out` a run that saved no checkpoint does not leave there: anything but the lock and RUN_FILES, and
    in checkpoints/ anything but a save cut short (step-N.tmp); nor, in either, a write test a kill left."""
    foreign = [p.name for p in sorted(out.iterdir())
               if p.name != LOCK_FILE and p.name not in RUN_FILES and not p.name.startswith(WRITE_TEST)]
    root = out / "checkpoints"
    if root.is_dir():
        unfinished = set(checkpoint.partial(root))
        foreign += [f"checkpoints/{p.name}" for p in sorted(root.iterdir())
                    if p not in unfinished and not p.name.startswith(WRITE_TEST)]
    elif root.exists() or root.is_symlink():
        foreign.append("checkpoints (not a folder)")
    return foreign


def _previous_run(out: Path) -> list[str]:
    """What is in `out` besides the lock: any of it means the directory is not new."""
    if not out.is_dir():
        return []
    return sorted(p.name + ("/" if p.is_dir() else "") for p in out.iterdir() if p.name != LOCK_FILE)


def _no_checkpoint(out: Path, what: str) -> RunDirError:
    return RunDirError(
        f"--resume: no checkpoint in {out / 'checkpoints'} (run.output_dir {out} {what}). Check run.output_dir for "
        f"a typo; to start a new run, leave out --resume (it replaces a previous run's metrics where no checkpoint "
        f"was saved), or pass --resume-or-start, which resumes where there is a checkpoint and otherwise starts the "
        f"run over what a run left without one")


def _read_holder(fd: int) -> dict:
    try:
        raw = os.pread(fd, 1 << 16, 0)
    except OSError:
        return {}
    if not raw.strip():
        return {}
    try:
        holder = json.loads(raw)
    except ValueError:
        return {"unreadable": raw[:200].decode(errors="replace")}
    return holder if isinstance(holder, dict) else {}


def _describe(holder: dict) -> str:
    if not holder:
        return "a run that has not written its details yet"
    if "unreadable" in holder:
        return f"a holder whose lock file is unreadable: {holder['unreadable']!r}"
    text = f"pid {holder.get('pid')} on host {holder.get('host')} since {holder.get('since')}"
    return text + (f", command: {holder['command']}" if holder.get("command") else "")


def _os_error(exc: OSError) -> str:
    return f"{exc.strerror or exc}" + (f": {exc.filename}" if exc.filename else "")
