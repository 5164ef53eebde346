"""The sandbox's boot, run as `python -I -S boot.py ...` by tandem.sandbox.runner: it confines itself, then
runs the program (and, to judge assert-style tests, a harness in a second process). Standard library only; never
imported by tandem.

Process tree, inside new mount, network and pid namespaces (and a user namespace when not root):

    boot (outside the pid namespace: waits, passes on the exit status)
    └── supervisor (pid 1: builds the root file system, reports, waits, then kills whatever is left)
        ├── program  (uid A, no capabilities: runs the solution; when judging, answers the harness's calls)
        └── harness  (uid B, not dumpable: runs the tests, compares, writes the verdict)

Only the supervisor and the harness hold the report pipe and only the harness the tests' file: nothing the program
can read, print or patch reaches the verdict. The report is a sequence of framed records (a tag byte, a length, the
payload), the verdict one JSON record: no text of the program's can shape another record or field. How the tests
meet the program's objects (only data crosses, through mirrors): the judge package, loaded here before confinement.
"""
import os
import sys

(MODE, SRC, TESTS_FD, REPORT_FD, STAGE, UID_A, UID_B, CPU, AS, FSIZE, NOFILE, NPROC, TMPFS_MB, ISOLATE, BINDS,
 PATHS, JUDGE) = sys.argv[1:]
report = int(REPORT_FD)
tests_fd = int(TESTS_FD)
if MODE == "judge":
    import importlib.util
    import json

    _where = os.path.join(os.path.dirname(os.path.abspath(__file__)), "judge")
    _spec = importlib.util.spec_from_file_location("tandem_sandbox_judge", os.path.join(_where, "__init__.py"),
                                                   submodule_search_locations=[_where])
    judge = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(judge)  # all of it, before the file system goes
    library, packages = (json.loads(JUDGE)[k] for k in ("library", "packages"))


def record(tag, payload):
    """One record on the report pipe: under PIPE_BUF bytes, so the write is atomic."""
    os.write(report, tag + len(payload[:3000]).to_bytes(4, "little") + payload[:3000])


with open(SRC, encoding="utf-8") as f:
    solution_src = f.read()
binds = []
if BINDS != "-":
    with open(BINDS, encoding="utf-8") as f:
        binds = [line.rstrip("\n").split("\t") for line in f if line.strip()]
extra_paths = [p for p in PATHS.split("\0") if p] if PATHS != "-" else []
done = {"net": 0, "fs": 0, "uid": 0, "pid": 0}

try:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
except Exception:
    libc = None

NEWNS, NEWNET, NEWUSER, NEWPID = 0x00020000, 0x40000000, 0x10000000, 0x20000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 4, 24, 38


def unshare(flags):
    return libc is not None and libc.unshare(flags) == 0


def mount(src, target, fstype, flags, data=None):
    def enc(s):
        return None if s is None else s.encode()

    if libc.mount(enc(src), enc(target), enc(fstype), flags, enc(data)) != 0:
        raise OSError(ctypes.get_errno(), f"mount {target}: {os.strerror(ctypes.get_errno())}")


def wait_status(pid):
    while True:
        try:
            return os.waitpid(pid, 0)[1]
        except InterruptedError:
            continue


# ---- 1. namespaces ------------------------------------------------------------------------------------------------
root = os.geteuid() == 0
ns = False
if ISOLATE == "1":
    if root:
        ns = unshare(NEWNS | NEWNET | NEWPID)
    else:
        # A user namespace that maps only our own ids makes the rest possible without privileges.
        uid0, gid0 = os.geteuid(), os.getegid()
        ns = unshare(NEWUSER | NEWNS | NEWNET | NEWPID)
        if ns:
            try:
                for path, text in (("/proc/self/setgroups", "deny"), ("/proc/self/uid_map", f"{uid0} {uid0} 1"),
                                   ("/proc/self/gid_map", f"{gid0} {gid0} 1")):
                    with open(path, "w") as f:
                        f.write(text)
            except OSError:
                ns = False
    if ns:
        child = os.fork()  # the child is pid 1 of the new pid namespace: when it dies, everything in it dies
        if child:
            os.close(report)
            os.close(tests_fd)
            status = wait_status(child)
            os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))
        done["pid"] = 1
        libc.prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0)  # die with the waiting boot (killed on the wall-time limit)
done["net"] = int(ns)


# ---- 2. a root file system that holds the interpreter, its libraries and the allowed packages, nothing else -------
def source_flags(path):
    """The mount flags of `path`'s mount that a read-only bind remount must keep (a user namespace locks them)."""
    f = os.statvfs(path).f_flag
    return (f & (MS_NOSUID | MS_NODEV | MS_NOEXEC | 1024 | 2048)) | ((1 << 21) if f & 4096 else 0)


pivoted = False


def build_root(new, uid):
    global pivoted
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    mount("tandem-root", new, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=4096,mode=0755")
    # The private /tmp first: what is bound below it (a checkout or venv under /tmp) goes on top of it, not under.
    # 0711: the harness, another uid as root, passes through to what is bound below (an allowed package); it
    # cannot list what the program keeps there.
    os.makedirs(new + "/tmp", 0o755, exist_ok=True)
    mount("tandem-sandbox", new + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV,
          f"size={TMPFS_MB}m,nr_inodes=4096,mode=0711,uid={uid},gid={uid}")
    masks = []
    for entry in binds:
        kind, path = entry[0], entry[1]
        target = new + path
        if kind == "link":
            os.makedirs(os.path.dirname(target), 0o755, exist_ok=True)
            if not os.path.lexists(target):
                os.symlink(entry[2], target)
            continue
        if kind in ("dir", "mask"):
            os.makedirs(target, 0o755, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(target), 0o755, exist_ok=True)
            if not os.path.lexists(target):
                open(target, "a").close()
        if kind == "mask":  # an empty directory over a host one (site-packages: only allowed packages show)
            mount("tandem-mask", target, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,nr_inodes=256,mode=0755")
            masks.append(path)
            continue
        mount(path, target, None, MS_BIND | (MS_REC if kind == "dir" else 0))
        keep = source_flags(path)
        if kind == "dev":  # /dev/null and friends: writable device nodes, nothing executable
            mount(None, target, None, MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NOEXEC | (keep & ~MS_NODEV))
        else:
            mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | keep)
    if done["pid"]:  # a /proc of the new pid namespace only: the trainer's processes are not in it
        os.makedirs(new + "/proc", 0o755, exist_ok=True)
        try:
            mount("proc", new + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        except OSError:
            pass
    os.makedirs(new + "/.old", 0o700, exist_ok=True)
    sys_pivot_root = {"x86_64": 155, "aarch64": 41, "ppc64le": 203, "s390x": 217}[os.uname().machine]
    if libc.syscall(sys_pivot_root, new.encode(), (new + "/.old").encode()) != 0:
        raise OSError(ctypes.get_errno(), "pivot_root")
    pivoted = True
    os.chdir("/")
    if libc.umount2(b"/.old", 2) != 0:  # MNT_DETACH: the host's tree is gone from this namespace
        raise OSError(ctypes.get_errno(), "umount /.old")
    os.rmdir("/.old")
    for path in masks:
        mount(None, path, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


uid_a = None if UID_A == "-" else int(UID_A)
uid_b = None if UID_B == "-" else int(UID_B)
workdir = STAGE + "/work"
if ns and binds:
    try:
        build_root(STAGE + "/root", uid_a if (root and uid_a is not None) else os.geteuid())
        workdir, done["fs"] = "/tmp", 1
    except Exception as exc:
        os.write(2, f"tandem sandbox: could not build its file system ({exc}); running without it\n".encode())
        if pivoted:  # failed after pivot_root: nothing safe to go on with
            os._exit(70)
done["uid"] = int(root and uid_a is not None)
record(b"S", ("net=%(net)d fs=%(fs)d uid=%(uid)d pid=%(pid)d" % done).encode())
if libc is not None:
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # the supervisor's memory and fds are not the program's to read


# ---- 3. each child drops everything before running anything it did not write --------------------------------------
def confine(uid, cwd):
    """Become `uid` (when root) or lose every capability (in our user namespace), then apply the rlimits."""
    import resource as R

    if root and uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)  # all three ids leave 0: every capability is dropped with them
    elif ns and libc is not None:
        for cap in range(64):
            if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
                break
        header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
        libc.capset(header, (ctypes.c_uint32 * 6)())
    if libc is not None:
        libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
        libc.prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0)
    os.chdir(cwd)
    for what, soft, hard in [(R.RLIMIT_CPU, int(CPU), int(CPU) + 1), (R.RLIMIT_AS, int(AS), int(AS)),
                             (R.RLIMIT_FSIZE, int(FSIZE), int(FSIZE)), (R.RLIMIT_NOFILE, int(NOFILE), int(NOFILE)),
                             (R.RLIMIT_CORE, 0, 0), (R.RLIMIT_NPROC, int(NPROC), int(NPROC))]:
        try:
            R.setrlimit(what, (soft, hard))
        except (ValueError, OSError):
            pass


def close_fds_except(*keep):
    for fd in range(3, 1024):
        if fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass


# ---- 4. the program ---------------------------------------------------------------------------------------------
def run_program(sock):
    import builtins

    if sock is not None:
        os.dup2(sock.fileno(), 3)
    close_fds_except(3 if sock is not None else -1)
    confine(uid_a, workdir)
    sys.path[:] = [p for p in sys.path if p] + extra_paths
    sys.argv = ["solution.py"]
    g = {"__name__": "__main__", "__builtins__": builtins}
    if sock is None:
        exec(compile(solution_src, "solution.py", "exec"), g)
        return
    import socket

    sock = socket.socket(fileno=3)
    try:
        exec(compile(solution_src, "solution.py", "exec"), g)
    except BaseException as exc:  # noqa: BLE001 - SystemExit too: the module did not load
        import traceback

        traceback.print_exc()
        flush()
        judge.send(sock, ("load_error", f"{type(exc).__name__}: {exc}"[:300]))
        os._exit(1)
    flush()
    judge.serve_program(sock, g)
    flush()
    os._exit(0)


def flush():
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


# ---- 5. the harness ---------------------------------------------------------------------------------------------
def run_harness(sock):
    close_fds_except(sock.fileno(), report, tests_fd)
    confine(uid_b, "/")
    sys.path[:] = [p for p in sys.path if p] + extra_paths  # the allowed packages, for the tests' own imports
    if libc is not None:
        libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    with os.fdopen(tests_fd, encoding="utf-8") as f:
        tests_src = f.read()
    judge.run_harness(sock, solution_src, tests_src, library, packages,
                      lambda passed, reason, conflicts: record(b"V", judge.verdict_record(passed, reason, conflicts)))


# ---- 6. the supervisor ------------------------------------------------------------------------------------------
if MODE == "judge":
    import socket

    prog_end, harness_end = socket.socketpair()
    harness = os.fork()
    if harness == 0:
        prog_end.close()
        try:
            run_harness(harness_end)
        finally:
            os._exit(0)
    harness_end.close()
    os.close(tests_fd)
    program = os.fork()
    if program == 0:
        os.close(report)
        run_program(prog_end)
        os._exit(0)
    prog_end.close()
    wait_status(harness)
    status = 0
else:
    os.close(tests_fd)
    program = os.fork()
    if program == 0:
        os.close(report)
        run_program(None)
        sys.exit(0)  # normal interpreter exit: flush output, run the program's atexit hooks
    status = wait_status(program)
record(b"E", b"%d" % status)
if done["pid"]:
    try:
        os.kill(-1, 9)  # pid 1 of its namespace: every process left in it
    except OSError:
        pass
else:
    try:
        os.kill(program, 9)
    except OSError:
        pass
os._exit(0)
