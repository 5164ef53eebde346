"""Run untrusted (model-written) Python confined and resource-limited; judge tests with a verdict it cannot forge.

What confines the program, on Linux (`SandboxResult.isolation` says which held; `self_test()` checks it works):

- a fresh interpreter `python -I -S` with a scrubbed environment (`PATH` and `LANG` only), in a new session;
- new mount, network and pid namespaces (as root directly; otherwise inside a user namespace that maps only the
  caller's own ids): no network at all (not even loopback), no view of the trainer's processes, and a root file
  system built for the run that holds only the interpreter, the standard library, the shared libraries they load and
  the packages a task allows, all read-only, plus a private tmpfs at /tmp as the working directory. Nothing else of
  the host is there to read or write, whoever runs the trainer: a Python under a 0700 home works, since the sandbox
  sees it through its own mounts, not through the home's permissions;
- as root, the program runs as a fresh random uid/gid with no groups; otherwise it keeps the caller's uid but loses
  every capability of its namespace. Either way `no_new_privs`, and rlimits: CPU seconds, address space, open files,
  file size (which also caps stdout/stderr: a flood of output dies of SIGXFSZ), no core dumps, processes;
- the parent enforces wall time and kills the whole process group; in a pid namespace, everything the program started
  dies with it (a `setsid()` does not escape), and as root every process of the sandbox uid is swept as well.

Without user namespaces (or any namespaces) the program runs as the calling user in a private directory with rlimits,
a new session and a scrubbed environment only: `isolation` reports net=0 fs=0 pid=0, `weak_spots()` names what is
then not contained, and the `code` reward refuses to run unless told `allow_weak_sandbox`.

Judging assert-style tests (`judge_python`): the program and the tests run in two processes with different uids (or,
without root, the harness not dumpable and the program without capabilities). The harness holds the tests and the only
channel the verdict travels on (one framed JSON record on the report pipe); the program's objects reach the tests as
mirrors over a socket, only data crosses, and a program object never judges its relation to a value of the tests
(the `judge` package). So an early `sys.exit(0)`, a printed verdict, a verdict shaped in an exception's text, a patched
`builtins` or `AssertionError`, an `atexit` hook, `os._exit` after a fake success line, or a result whose `__eq__`,
`__lt__`, `__contains__` or `__sub__` always says yes cannot pass a test: there is no secret to read and nothing the
program does in its own process reaches the harness. `boot.py` is the confined side.
"""
from __future__ import annotations

import fcntl
import functools
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from typing import Sequence

BOOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "boot.py")  # the confined side

# Run once per interpreter and package set with the sandbox's interpreter: which files it needs. It imports every
# extension module of the standard library (and the allowed packages), then lists the shared objects the dynamic
# loader opened, by the names it opened them under (symlinks included), and every file mapped into the process.
_PROBE = r'''
import ctypes, json, os, site, sys
out, pkgs = sys.argv[1], json.loads(sys.argv[2])
stdlib = [p for p in sys.path if p]
for d in stdlib:
    if os.path.isdir(d) and d.endswith("lib-dynload"):
        for f in sorted(os.listdir(d)):
            if f.endswith(".so") and not f.startswith(("_tkinter", "_curses", "readline")):  # no terminal, no GUI
                try:
                    __import__(f.split(".")[0])
                except BaseException:
                    pass
for parent, name in pkgs:
    sys.path.insert(0, parent)
    __import__(name)
names = []
try:
    class Info(ctypes.Structure):
        _fields_ = [("addr", ctypes.c_void_p), ("name", ctypes.c_char_p)]
    CB = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(Info), ctypes.c_size_t, ctypes.c_void_p)
    def cb(info, size, data):
        if info.contents.name:
            names.append(os.fsdecode(info.contents.name))
        return 0
    ctypes.CDLL(None).dl_iterate_phdr(CB(cb), None)
except Exception:
    pass
maps = set()
with open("/proc/self/maps") as f:
    for line in f:
        parts = line.split(None, 5)
        if len(parts) == 6 and parts[5].startswith("/"):
            maps.add(parts[5].strip())
sites = site.getsitepackages() + [site.getusersitepackages()]
with open(out, "w") as f:
    json.dump({"stdlib": stdlib, "loaded": names, "maps": sorted(maps), "executable": sys.executable,
               "sites": sites}, f)
'''
_DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")


@dataclass(frozen=True)
class SandboxLimits:
    """Per-run limits (each process of a run gets them). `output_bytes` caps stdout and stderr each (the file-size
    limit); `tmpfs_mb` caps the private working directory."""

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
    # net: no network; fs: sees only the interpreter, its libraries and allowed packages, writes only to a private
    # tmpfs; uid: ran as its own uid; pid: in its own pid namespace
    isolation: dict[str, int] = field(default_factory=dict)
    passed: bool | None = None  # judge_python: the harness's verdict (None for run_python)
    reason: str = ""  # judge_python: why a test did not pass
    library: tuple[str, ...] = ()  # judge_python: library names the program redefined, judged both ways

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


class SandboxBroken(RuntimeError):
    """The sandbox cannot run programs correctly on this machine (`self_test` says how)."""


def _interpreter() -> str:
    # The base interpreter, not the venv's: with -S it would not see site-packages anyway.
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def _path_entries(path: str, out: list[tuple[str, ...]]) -> None:
    """Entries that make `path` resolve in the sandbox's root as on the host: each symlink on the way, then the file."""
    parts = [p for p in path.split("/") if p]
    cur = ""
    for i, part in enumerate(parts):
        cur = f"{cur}/{part}"
        if os.path.islink(cur):
            target = os.readlink(cur)
            out.append(("link", cur, target))
            resolved = os.path.normpath(os.path.join(os.path.dirname(cur), target))
            rest = "/".join(parts[i + 1:])
            _path_entries(os.path.join(resolved, rest) if rest else resolved, out)
            return
    if os.path.isfile(cur):
        out.append(("file", cur))


def package_paths(packages: Sequence[str]) -> list[tuple[str, str, list[str]]]:
    """For each allowed top-level package or module: (its parent directory, its name, the paths to expose: the
    package or module itself and a wheel's bundled `<name>.libs` beside it).

    Raises ValueError naming what is missing."""
    import importlib.util

    out = []
    for name in packages:
        spec = importlib.util.find_spec(name) if name.isidentifier() else None
        if spec is None or not spec.origin or spec.origin in ("built-in", "frozen"):
            raise ValueError(f"sandbox package {name!r} is not installed as a file on this machine's sys.path "
                             "(list top-level packages the trainer's Python can import, e.g. 'numpy')")
        path = os.path.dirname(spec.origin) if spec.submodule_search_locations else spec.origin
        parent = os.path.dirname(path)
        shown = [path] + [os.path.join(parent, d) for d in os.listdir(parent)
                          if d.endswith(".libs") and d.split(".")[0].split("-")[0].lower() == name.lower()]
        out.append((parent, name, shown))
    return out


@functools.lru_cache(maxsize=8)
def _root_binds(python: str, packages: tuple[str, ...]) -> tuple[str, tuple[str, ...]]:
    """The sandbox root's entries (one tab-separated line each, parents before children) and the extra sys.path."""
    pkgs = package_paths(packages)
    with tempfile.TemporaryDirectory(prefix="tandem-probe-") as tmp:
        out = os.path.join(tmp, "probe.json")
        proc = subprocess.run([python, "-I", "-S", "-c", _PROBE, out, json.dumps([(p, n) for p, n, _ in pkgs])],
                              env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}, capture_output=True, timeout=120)
        if proc.returncode != 0:
            raise SandboxBroken(f"probing {python} for the files the sandbox needs failed: "
                                f"{proc.stderr.decode(errors='replace')[-500:]}")
        with open(out) as f:
            probe = json.load(f)
    dirs = [os.path.realpath(p) for p in probe["stdlib"] if os.path.isdir(p)]
    dirs += [os.path.realpath(p) for _, _, shown in pkgs for p in shown if os.path.isdir(p)]
    masks = [os.path.realpath(s) for s in probe["sites"] if os.path.isdir(s)]
    under = lambda p, d: p.startswith(d + "/")  # noqa: E731
    masks = [m for m in dict.fromkeys(masks) if any(under(m, d) for d in dirs)]

    def shown_by(p: str) -> bool:  # already visible through a bound directory, and not hidden by a mask below it
        return any(under(p, d) and not any(under(m, d) and (p == m or under(p, m)) for m in masks) for d in dirs)

    entries: list[tuple[str, ...]] = [("dir", d) for d in dict.fromkeys(dirs) if not shown_by(d)]
    entries += [("mask", m) for m in masks]
    files: list[tuple[str, ...]] = []
    for p in [probe["executable"], python, *probe["stdlib"], *probe["loaded"], *probe["maps"], "/etc/ld.so.cache"]:
        if p and os.path.exists(p) and not os.path.isdir(p):
            _path_entries(os.path.abspath(p), files)
    for _, _, shown in pkgs:
        files += [("file", p) for p in shown if os.path.isfile(p)]
    entries += [e for e in dict.fromkeys(files) if not shown_by(e[1])]
    entries += [("dev", d) for d in _DEVICES if os.path.exists(d)]
    # Mount order: whatever lies inside a bound directory or a mask goes after it (nesting, then depth).
    nesting = lambda p: sum(under(p, e[1]) for e in entries if e[0] in ("dir", "mask"))  # noqa: E731
    entries.sort(key=lambda e: (nesting(e[1]), e[1].count("/")))
    return "".join("\t".join(e) + "\n" for e in entries), tuple(parent for parent, _, _ in pkgs)


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


def _user_task_count() -> int:
    """The threads the calling user runs now, all processes together: RLIMIT_NPROC counts threads of the real uid,
    not processes (a trainer's thread pools, a numpy program's BLAS threads), so a limit of processes + headroom
    would leave a sandbox no room to start a thread."""
    if not os.path.isdir("/proc"):
        return 0
    uid, total = os.getuid(), 0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status", "rb") as f:
                fields = dict(line.split(b":", 1) for line in f if line.startswith((b"Uid:", b"Threads:")))
            if int(fields[b"Uid"].split()[0]) == uid:
                total += int(fields[b"Threads"])
        except (OSError, KeyError, ValueError, IndexError):
            continue
    return total


def _read_capped(path: str, cap: int) -> bytes:
    with open(path, "rb") as f:
        return f.read(cap)


def _fresh_uid() -> int:
    return (1 << 30) + secrets.randbelow((1 << 30) - 2)


def run_python(source: str, stdin: str = "", limits: SandboxLimits = SandboxLimits(), *, isolate: bool = True,
               python: str | None = None, packages: Sequence[str] = ()) -> SandboxResult:
    """Run `source` as a Python program in the sandbox with `stdin`; never raises for anything the program does.

    `packages`: top-level packages of the trainer's environment the program may import (read-only), besides the
    standard library. `isolate=False` skips namespaces and the uid drop (rlimits, session and scrubbed environment
    still apply)."""
    return _launch(source, None, stdin, limits, isolate, python, tuple(packages))


def judge_python(solution: str, tests: str, limits: SandboxLimits = SandboxLimits(), *, isolate: bool = True,
                 python: str | None = None, packages: Sequence[str] = ()) -> SandboxResult:
    """Run `solution`, then the assert-style `tests` against its top-level names in a separate harness process;
    `passed` is the harness's verdict (see the module docstring for why the program cannot forge it).

    Where the program defines a name the tests read that also names a standard-library function or constant the
    tests may rely on (`Counter`, `sqrt`, `pi`: judge.names.LIBRARY_NAMES), a passing verdict is checked by a second run
    with the tests reading the library's instead: the tests must pass both ways."""
    first = _launch(solution, tests, "", limits, isolate, python, tuple(packages))
    if not (first.passed and first.library):
        return first
    second = _launch(solution, tests, "", limits, isolate, python, tuple(packages), first.library)
    reason = "" if second.passed else (f"with the standard library's {', '.join(first.library)} (the program defines "
                                       f"its own) the tests fail: {second.reason}")
    return replace(second, wall_s=first.wall_s + second.wall_s, reason=reason, library=first.library)


def _write_run_folder(tmp: str, source: str, tests: str | None, stdin: str, binds: str, uid_a: int | None) -> int:
    """The run's folder: `work` (the program's working directory), `root` (its root's mount point), the program,
    the bind list and stdin; returns a read-only descriptor of the tests, whose file is already gone."""
    work = os.path.join(tmp, "work")
    os.mkdir(work, 0o700)
    os.mkdir(os.path.join(tmp, "root"), 0o755)
    if uid_a is not None:  # used only when the sandbox's own root could not be built
        os.chmod(tmp, 0o711)
        os.chown(work, uid_a, uid_a)
    for name, text in (("solution.py", source), ("binds", binds), ("tests.py", tests or "")):
        with open(os.path.join(tmp, name), "w", encoding="utf-8") as f:
            f.write(text)
    tests_path = os.path.join(tmp, "tests.py")
    tests_fd = os.open(tests_path, os.O_RDONLY)
    try:
        os.unlink(tests_path)  # reachable through the harness's descriptor only
        with open(os.path.join(tmp, "stdin"), "w", encoding="utf-8") as f:
            f.write(stdin)
    except BaseException:
        os.close(tests_fd)
        raise
    return tests_fd


def _read_report(report_r: int) -> bytes:
    fcntl.fcntl(report_r, fcntl.F_SETFL, os.O_NONBLOCK)  # a leftover process may hold the write end open
    data = b""
    while len(data) < 1 << 16:
        try:
            chunk = os.read(report_r, 1 << 16)
        except BlockingIOError:
            break
        if not chunk:
            break
        data += chunk
    return data


def _parse_report(report: bytes, judging: bool, returncode: int
                  ) -> tuple[dict[str, int], int, bool | None, str, tuple[str, ...]]:
    """The boot's report, framed records (boot.record): (isolation flags, the exit code to report, the harness's
    verdict, its reason, the library names it asks to judge again). A judged run keeps `returncode`, the boot's own.
    Only the first verdict counts; the records are written by the supervisor and the harness alone."""
    isolation: dict[str, int] = {}
    passed, reason, library = None, "", ()
    pos = 0
    while pos + 5 <= len(report):
        tag, size = report[pos:pos + 1], int.from_bytes(report[pos + 1:pos + 5], "little")
        payload = report[pos + 5:pos + 5 + size]
        pos += 5 + size
        if len(payload) < size:
            break
        if tag == b"S":
            for item in payload.decode("ascii", "replace").split():
                key, _, value = item.partition("=")
                isolation[key] = int(value == "1")
        elif tag == b"E" and payload.lstrip(b"-").isdigit():
            returncode = os.waitstatus_to_exitcode(int(payload)) if not judging else returncode
        elif tag == b"V" and passed is None:
            try:
                verdict = json.loads(payload)
                passed = verdict["passed"] is True
                reason = str(verdict["reason"])
                library = tuple(n for n in verdict["library"] if isinstance(n, str) and n.isidentifier())
            except (ValueError, KeyError, TypeError):
                passed, reason = False, "the harness's verdict could not be read"
    return isolation, returncode, passed, reason, library


def _run_boot(command: list[str], files: tuple[str, str, str], cwd: str, pass_fds: tuple[int, ...],
              wall_s: float) -> tuple[int, bool, float]:
    """Run the boot with the run folder's stdin, stdout and stderr files until it exits or `wall_s` pass, then kill
    its session (the program's children, even after it exited): (exit code, timed out, wall seconds)."""
    start, timed_out = time.monotonic(), False
    with open(files[0], "rb") as fin, open(files[1], "wb") as fout, open(files[2], "wb") as ferr:
        # No preexec_fn: this is safe to call from any thread of a process that has threads (the trainer).
        proc = subprocess.Popen(command, stdin=fin, stdout=fout, stderr=ferr, cwd=cwd, close_fds=True,
                                env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}, start_new_session=True,
                                pass_fds=pass_fds)
        try:
            proc.wait(timeout=wall_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
    return proc.returncode, timed_out, time.monotonic() - start


def _launch(source: str, tests: str | None, stdin: str, limits: SandboxLimits, isolate: bool, python: str | None,
            packages: tuple[str, ...], library: tuple[str, ...] = ()) -> SandboxResult:
    python = python or _interpreter()
    root = os.geteuid() == 0
    uid_a = _fresh_uid() if (root and isolate) else None
    uid_b = (uid_a + 1 if uid_a < (1 << 31) - 2 else uid_a - 1) if uid_a is not None else None
    binds, paths = _root_binds(python, packages) if isolate else ("", ())
    if not isolate and packages:
        paths = tuple(parent for parent, _, _ in package_paths(packages))
    tmp = tempfile.mkdtemp(prefix="tandem-sandbox-")
    report_r = report_w = tests_fd = -1
    try:
        tests_fd = _write_run_folder(tmp, source, tests, stdin, binds, uid_a)
        work, src, binds_path = (os.path.join(tmp, n) for n in ("work", "solution.py", "binds"))
        in_path, out_path, err_path = (os.path.join(tmp, n) for n in ("stdin", "stdout", "stderr"))
        report_r, report_w = os.pipe()
        nproc = limits.nproc if root else _user_task_count() + limits.nproc
        args = ["judge" if tests is not None else "run", src, str(tests_fd), str(report_w), tmp,
                "-" if uid_a is None else str(uid_a), "-" if uid_b is None else str(uid_b), str(int(limits.cpu_s)),
                str(limits.memory_mb << 20), str(limits.output_bytes), str(limits.nofile), str(nproc),
                str(limits.tmpfs_mb), "1" if isolate else "0", binds_path if binds else "-",
                "\0".join(paths) if paths else "-", json.dumps({"library": list(library), "packages": list(packages)})]
        exit_code, timed_out, wall = _run_boot([python, "-I", "-S", BOOT, *args], (in_path, out_path, err_path), work,
                                               (tests_fd, report_w), limits.wall_s)
        os.close(report_w)
        report_w = -1
        isolation, returncode, passed, reason, conflicts = _parse_report(_read_report(report_r), tests is not None,
                                                                         exit_code)
        if uid_a is not None and not isolation.get("pid"):  # a pid namespace's processes all died with its pid 1
            for uid in (uid_a, uid_b):
                _sweep(uid)
        if tests is not None and passed is None:
            passed = False
            reason = "the time limit ran out before the tests finished" if timed_out else \
                "the harness gave no verdict"
        if timed_out:
            returncode = -signal.SIGKILL
        out = _read_capped(out_path, limits.output_bytes)
        err = _read_capped(err_path, limits.output_bytes + 256)
        return SandboxResult(returncode, out.decode("utf-8", "replace"), err.decode("utf-8", "replace"), timed_out,
                             wall, uid_a if isolation.get("uid") else None, isolation,
                             passed if not timed_out else False if tests is not None else None, reason,
                             conflicts if passed and not timed_out else ())
    finally:
        for fd in (report_r, report_w, tests_fd):
            if fd >= 0:
                os.close(fd)
        shutil.rmtree(tmp, ignore_errors=True)


_ISOLATION: dict[str, int] | None = None


def isolation() -> dict[str, int]:
    """Which confinements hold on this machine (`net`, `fs`, `uid`, `pid`: 1 or 0), probed once by an empty program."""
    global _ISOLATION
    if _ISOLATION is None:
        _ISOLATION = dict(run_python("pass").isolation)
    return _ISOLATION


def weak_spots(iso: dict[str, int]) -> list[str]:
    """What a program could do here that the full sandbox prevents, given the `isolation` flags."""
    spots = []
    if not iso.get("fs"):
        spots.append("read the host's files readable by its user and write to the shared temporary directories "
                     "(/tmp, /var/tmp, /dev/shm)")
    if not (iso.get("uid") or iso.get("pid")):
        spots.append("read the trainer's environment and memory (/proc/<pid>/environ) and signal or kill the trainer")
    elif not iso.get("pid"):
        spots.append("see the trainer's processes")
    if not iso.get("net"):
        spots.append("open network connections (loopback included: the trainer's own ports)")
    return spots


_STDLIB_CHECK = ("import math, json, re, collections, itertools, functools, heapq, bisect, fractions, decimal, "
                 "datetime, random, string, statistics, typing, dataclasses, hashlib, array, struct, copy, "
                 "operator, textwrap, unicodedata\nprint(math.isqrt(49), json.dumps([1]), "
                 "str(fractions.Fraction(1, 3)), decimal.Decimal('0.5') * 2)")


@functools.lru_cache(maxsize=8)
def self_test(packages: tuple[str, ...] = (), python: str | None = None) -> dict[str, int]:
    """Check that the sandbox runs programs right on this machine, or raise SandboxBroken saying what failed: the
    standard library (and each allowed package) imports, a known-correct program passes an input/output test and an
    assert test, known-wrong ones fail both. Returns the isolation flags."""
    limits = SandboxLimits(cpu_s=5, wall_s=20.0)
    kw = dict(limits=limits, packages=packages, python=python)
    checks = [("the standard library imports",
               run_python(_STDLIB_CHECK + "".join(f"\nimport {p}" for p in packages), **kw),
               lambda r: r.ok and r.stdout.split() == ["7", "[1]", "1/3", "1.0"]),
              ("a correct program passes an input/output test",
               run_python("a, b = map(int, input().split())\nprint(a + b)", "2 3\n", **kw),
               lambda r: r.ok and r.stdout.strip() == "5"),
              ("a correct function passes an assert test",
               judge_python("import math\ndef add(a, b):\n    return math.floor(a) + b", "assert add(2, 3) == 5", **kw),
               lambda r: r.passed is True),
              ("a wrong function fails an assert test",
               judge_python("def add(a, b):\n    return a - b", "assert add(2, 3) == 5", **kw),
               lambda r: r.passed is False)]
    for what, result, good in checks:
        if not good(result):
            raise SandboxBroken(
                f"the code sandbox fails its self-test on this machine: expected {what}, got exit code "
                f"{result.returncode}, verdict {result.passed} {result.reason!r}, stdout {result.stdout[-200:]!r}, "
                f"stderr {result.stderr[-600:]!r} (isolation {result.isolation}; "
                f"interpreter {python or _interpreter()})."
                " The interpreter and its standard library must be importable by the sandbox: see "
                "tandem/sandbox/runner.py")
    return dict(checks[0][1].isolation)
