"""Run untrusted (model-written) Python in a separate, resource-limited, unprivileged process and capture its output.

What confines the program, on Linux (each step is best effort; `SandboxResult.isolation` says which ones held):

- a fresh interpreter `python -I -S` (no user site, no site-packages, no PYTHON* variables) with a scrubbed
  environment (`PATH` and `LANG` only), in a new session so its whole process group can be killed;
- rlimits set inside the child before the program runs: CPU seconds, address space, open files, file size
  (which also caps stdout/stderr, both written to files: a flood of output dies of SIGXFSZ), no core dumps, and the
  number of processes;
- as root: new network and mount namespaces (`unshare(2)`): no network at all (not even loopback); every mount
  remounted read-only and a small private tmpfs mounted on /tmp as the working directory, so the program can write
  nowhere else; then it drops to a fresh random uid/gid with no groups and `no_new_privs`, so it cannot signal
  the trainer, read `/proc/<trainer>/environ`, or share a process-count budget with anything else;
- not root: the same inside a new user namespace that maps only the caller's own ids (when the kernel allows
  unprivileged user namespaces), plus a pid namespace and a fresh /proc, since the program keeps the trainer's uid:
  it can then neither see nor signal the trainer nor read its /proc/<pid>/environ. RLIMIT_NPROC counts all of the
  user's processes, so it is set to the user's current count plus the limit. Without user namespaces it runs as
  the calling user in a private temporary directory: rlimits, session and scrubbed environment only (`isolation`
  reports net=0 fs=0 uid=0; the network test then skips).

The parent enforces wall time, then kills the process group and sweeps every process left with the sandbox uid (a
program may `setsid()` out of its group). The interpreter's standard library must be world-readable, since modules
imported after the uid drop are read as that uid.
"""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

_STATUS_PREFIX = b"\x00tandem-sandbox "

# Runs in the child, as root (or the calling user) until it drops privileges, then executes the program in-process
# (one interpreter start per run). Only the standard library; must not print anything but the status line.
_BOOT = r'''
import os, resource, sys
# argv: src workdir uid cpu as fsize nofile nproc tmpfs_mb isolate (no json: importing it costs ~30 ms a run)
a = sys.argv[1:]
cfg = {"src": a[0], "workdir": a[1], "uid": None if a[2] == "-" else int(a[2]), "cpu": int(a[3]), "as": int(a[4]),
       "fsize": int(a[5]), "nofile": int(a[6]), "nproc": int(a[7]), "tmpfs_mb": int(a[8]), "isolate": a[9] == "1"}
with open(cfg["src"], encoding="utf-8") as f:
    src = f.read()
done = {"net": 0, "fs": 0, "uid": 0, "pid": 0}
try:
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
except Exception:
    libc = None

def unshare(flags):
    return libc is not None and libc.unshare(flags) == 0

NEWNS, NEWNET, NEWUSER, NEWPID = 0x00020000, 0x40000000, 0x10000000, 0x20000000
ns = pidns = False
if cfg["isolate"]:
    if os.geteuid() == 0:
        ns = unshare(NEWNS | NEWNET)
    else:
        # Not root: a user namespace, mapping only our own ids, makes the rest possible. Same uid as the trainer,
        # so also a pid namespace (and below a fresh /proc): it can neither see nor signal the trainer.
        uid0, gid0 = os.geteuid(), os.getegid()
        ns = unshare(NEWUSER | NEWNS | NEWNET | NEWPID)
        if ns:
            try:
                for path, text in (("/proc/self/setgroups", "deny"), ("/proc/self/uid_map", f"{uid0} {uid0} 1"),
                                   ("/proc/self/gid_map", f"{gid0} {gid0} 1")):
                    with open(path, "w") as f:
                        f.write(text)
            except OSError:
                pass
            child = os.fork()  # the child is pid 1 of the new namespace; when it dies, all it started dies
            if child:
                while True:
                    try:
                        status = os.waitpid(child, 0)[1]
                        break
                    except InterruptedError:
                        continue
                os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))
            pidns = done["pid"] = True
            libc.prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG: die with the waiting parent (killed on wall timeout)
    done["net"] = int(ns)

def remount_readonly():
    # Per-mount read-only bind remount; keep the flags a user namespace locks (nosuid, nodev, noexec, atime).
    bits = {"nosuid": 2, "nodev": 4, "noexec": 8, "noatime": 1024, "nodiratime": 2048, "relatime": 1 << 21}
    ok = True
    with open("/proc/self/mountinfo") as f:
        lines = f.read().splitlines()
    for line in lines:
        parts = line.split()
        mnt = parts[4].encode().decode("unicode_escape")
        flags = 1 | 32 | 4096  # MS_RDONLY | MS_REMOUNT | MS_BIND
        for opt in parts[5].split(","):
            flags |= bits.get(opt, 0)
        if libc.mount(None, mnt.encode(), None, flags, None) != 0 and mnt == "/":
            ok = False
    return ok

uid = cfg["uid"]
workdir = cfg["workdir"]
if ns:
    MS_REC, MS_PRIVATE, MS_NOSUID, MS_NODEV = 16384, 1 << 18, 2, 4
    if libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) == 0 and remount_readonly():
        if pidns:  # a /proc of the new pid namespace: the trainer's /proc/<pid>/environ is not there
            libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | 8, None)
        owner = uid if (uid is not None and os.geteuid() == 0) else os.geteuid()
        opts = f"size={cfg['tmpfs_mb']}m,nr_inodes=4096,mode=0700,uid={owner},gid={owner}".encode()
        if libc.mount(b"tandem-sandbox", b"/tmp", b"tmpfs", MS_NOSUID | MS_NODEV, opts) == 0:
            workdir, done["fs"] = "/tmp", 1
os.chdir(workdir)

R = resource
limits = [(R.RLIMIT_CPU, cfg["cpu"], cfg["cpu"] + 1), (R.RLIMIT_AS, cfg["as"], cfg["as"]),
          (R.RLIMIT_FSIZE, cfg["fsize"], cfg["fsize"]), (R.RLIMIT_NOFILE, cfg["nofile"], cfg["nofile"]),
          (R.RLIMIT_CORE, 0, 0), (R.RLIMIT_NPROC, cfg["nproc"], cfg["nproc"])]
for what, soft, hard in limits:
    try:
        R.setrlimit(what, (soft, hard))
    except (ValueError, OSError):
        pass
if uid is not None and os.geteuid() == 0:
    try:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        done["uid"] = 1
    except OSError:
        pass
if libc is not None:
    libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
    libc.prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG = SIGKILL: die with whoever launched us
os.write(2, ("\x00tandem-sandbox net=%d fs=%d uid=%d pid=%d\n" % (done["net"], done["fs"], done["uid"], done["pid"])).encode())
sys.argv = ["solution.py"]
g = {"__name__": "__main__", "__builtins__": __builtins__}
del os, resource, R, cfg, limits, libc, a
exec(compile(src, "solution.py", "exec"), g)
'''


@dataclass(frozen=True)
class SandboxLimits:
    """Per-run limits. `output_bytes` caps stdout and stderr each (the file-size limit); `tmpfs_mb` caps the
    working directory when it is a private tmpfs."""

    cpu_s: int = 2
    wall_s: float = 5.0
    memory_mb: int = 1024
    nproc: int = 16
    output_bytes: int = 4 << 20
    nofile: int = 64
    tmpfs_mb: int = 32


@dataclass(frozen=True)
class SandboxResult:
    returncode: int | None  # negative: killed by that signal (e.g. -9 after the wall limit, -24 SIGXCPU)
    stdout: str
    stderr: str
    timed_out: bool  # hit the wall-time limit
    wall_s: float
    uid: int | None  # the uid it ran as, when it dropped privileges
    # net: no network; fs: writes only to a private tmpfs; uid: ran as its own uid; pid: in its own pid namespace
    isolation: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


def _interpreter() -> str:
    # The base interpreter, not the venv's: with -S it would not see site-packages anyway, and the venv path may
    # sit under a directory the sandbox uid cannot traverse.
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def _uid_processes(uid: int) -> list[int]:
    """Live (not zombie) pids whose real uid is `uid`, read from /proc/<pid>/status: a process that changed uid is
    not dumpable, so its /proc directory is owned by root and stat() would not tell. Zombies are skipped: they are
    already dead, holding only a pid until whoever inherited them (init) reaps them."""
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status", "rb") as f:
                zombie = False
                for line in f:
                    if line.startswith(b"State:"):
                        zombie = line.split()[1] in (b"Z", b"X")
                    elif line.startswith(b"Uid:"):
                        if not zombie and int(line.split()[1]) == uid:
                            pids.append(int(name))
                        break
        except (OSError, IndexError, ValueError):
            continue
    return pids


def _sweep(uid: int, rounds: int = 20) -> None:
    """Kill every process of the sandbox uid (escaped from its group, or still forking)."""
    for _ in range(rounds):
        pids = _uid_processes(uid)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.005)


def _user_process_count() -> int:
    return len(_uid_processes(os.getuid())) if os.path.isdir("/proc") else 0


def _read_capped(path: str, cap: int) -> bytes:
    with open(path, "rb") as f:
        return f.read(cap)


def run_python(source: str, stdin: str = "", limits: SandboxLimits = SandboxLimits(), *,
               isolate: bool = True, python: str | None = None) -> SandboxResult:
    """Run `source` as a Python program in the sandbox with `stdin`; never raises for anything the program does.

    `isolate=False` skips namespaces and the uid drop (rlimits, session and scrubbed environment still apply).
    """
    root = os.geteuid() == 0
    uid = (1 << 30) + secrets.randbelow((1 << 30) - 2) if (root and isolate) else None
    tmp = tempfile.mkdtemp(prefix="tandem-sandbox-")
    try:
        work = os.path.join(tmp, "work")
        os.mkdir(work, 0o700)
        if uid is not None:
            os.chown(work, uid, uid)  # used only when the private tmpfs could not be mounted
        src = os.path.join(tmp, "solution.py")
        with open(src, "w", encoding="utf-8") as f:
            f.write(source)
        in_path, out_path, err_path = (os.path.join(tmp, n) for n in ("stdin", "stdout", "stderr"))
        with open(in_path, "w", encoding="utf-8") as f:
            f.write(stdin)
        nproc = limits.nproc if root else _user_process_count() + limits.nproc
        args = [src, work, "-" if uid is None else str(uid), str(int(limits.cpu_s)), str(limits.memory_mb << 20),
                str(limits.output_bytes), str(limits.nofile), str(nproc), str(limits.tmpfs_mb), "1" if isolate else "0"]
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
        t0 = time.monotonic()
        timed_out = False
        with open(in_path, "rb") as fin, open(out_path, "wb") as fout, open(err_path, "wb") as ferr:
            # No preexec_fn: this is safe to call from any thread of a process that has threads (the trainer).
            proc = subprocess.Popen([python or _interpreter(), "-I", "-S", "-c", _BOOT, *args],
                                    stdin=fin, stdout=fout, stderr=ferr, env=env, cwd=work,
                                    start_new_session=True, close_fds=True)
            try:
                proc.wait(timeout=limits.wall_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # the program's children, even after it exited
                except (ProcessLookupError, PermissionError):
                    pass
                proc.wait()
                if uid is not None:
                    _sweep(uid)
        wall = time.monotonic() - t0
        out = _read_capped(out_path, limits.output_bytes)
        err = _read_capped(err_path, limits.output_bytes + 256)
        isolation: dict[str, int] = {}
        if err.startswith(_STATUS_PREFIX):
            line, _, err = err.partition(b"\n")
            for item in line[len(_STATUS_PREFIX):].decode("ascii", "replace").split():
                key, _, value = item.partition("=")
                isolation[key] = int(value == "1")
        return SandboxResult(proc.returncode, out.decode("utf-8", "replace"), err.decode("utf-8", "replace"),
                             timed_out, wall, uid if isolation.get("uid") else None, isolation)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


_ISOLATION: dict[str, int] | None = None


def isolation() -> dict[str, int]:
    """Which confinements hold on this machine (`net`, `fs`, `uid`, `pid`: 1 or 0), probed once with an empty program."""
    global _ISOLATION
    if _ISOLATION is None:
        _ISOLATION = dict(run_python("pass").isolation)
    return _ISOLATION
