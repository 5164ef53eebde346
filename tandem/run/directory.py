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

from tandem.run import checkpoint
from tandem.run.evaluation import RESULTS_FILE
from tandem.run.metrics import METRICS_FILE, resume_history
from tandem.run.trackers import IDS_FILE, TRACKERS

log = logging.getLogger("tandem.run.directory")

LOCK_FILE = "tandem.lock"
# What a run writes into its directory: a start that replaces a previous run removes these and nothing else.
RUN_FILES = ("checkpoints", METRICS_FILE, "curves.png", RESULTS_FILE, IDS_FILE,
             *(store for _, store in TRACKERS.values()))  # run.report_to's local stores

# start: a new run; refused over a run that has checkpoints. resume: continue from the newest valid checkpoint,
# refused where there is none. resume_or_start: resume, or start where the directory holds no run yet.
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
                with tempfile.NamedTemporaryFile(dir=folder, prefix=".tandem-write-test-"):
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
            for name in mine:
                p = out / name
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p)
                else:
                    p.unlink()
        return None
    if not found:
        left = _previous_run(out)
        if start == "resume_or_start" and not left:
            log.info("run.output_dir %s holds no run yet: starting one", out)
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


def _previous_run(out: Path) -> list[str]:
    """What is in `out` besides the lock: any of it means the directory is not new."""
    if not out.is_dir():
        return []
    return sorted(p.name + ("/" if p.is_dir() else "") for p in out.iterdir() if p.name != LOCK_FILE)


def _no_checkpoint(out: Path, what: str) -> RunDirError:
    return RunDirError(
        f"--resume: no checkpoint in {out / 'checkpoints'} (run.output_dir {out} {what}). Check run.output_dir for "
        f"a typo; to start a new run, leave out --resume (it replaces a previous run's metrics where no checkpoint "
        f"was saved), or pass --resume-or-start, which starts only in a new, empty directory")


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
