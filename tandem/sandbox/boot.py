"""The sandbox's boot, run as `python -I -S boot.py ...` by tandem.sandbox.runner: it confines itself, then
runs the program (and, to judge assert-style tests, a harness in a second process). Standard library only; never
imported by tandem.

Process tree, inside new mount, network and pid namespaces (and a user namespace when not root):

    boot (outside the pid namespace: waits, passes on the exit status)
    └── supervisor (pid 1: builds the root file system, reports, waits, then kills whatever is left)
        ├── program  (uid A, no capabilities: runs the solution; when judging, answers the harness's calls)
        └── harness  (uid B, not dumpable: runs the tests, compares, writes the verdict)

Only the supervisor and the harness hold the report pipe and only the harness the tests' file: nothing the program
can read, print or patch reaches the verdict, and values cross from the program to the harness only as plain data
(see `_PlainUnpickler`), so an object whose `__eq__` is always true stays on the program's side.
"""
import os
import sys

(MODE, SRC, TESTS_FD, REPORT_FD, STAGE, UID_A, UID_B, CPU, AS, FSIZE, NOFILE, NPROC, TMPFS_MB, ISOLATE, BINDS,
 PATHS) = sys.argv[1:]
report = int(REPORT_FD)
tests_fd = int(TESTS_FD)
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
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 32, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 4, 24, 38


def unshare(flags):
    return libc is not None and libc.unshare(flags) == 0


def mount(src, target, fstype, flags, data=None):
    enc = (lambda s: None if s is None else s.encode())
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
os.write(report, ("status net=%(net)d fs=%(fs)d uid=%(uid)d pid=%(pid)d\n" % done).encode())
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


MAX_MESSAGE = 64 << 20


def send(sock, obj):
    import pickle

    data = pickle.dumps(obj, 4)
    sock.sendall(len(data).to_bytes(8, "little") + data)


def recv(sock, loads):
    def exact(n):
        buf = bytearray()
        while len(buf) < n:
            chunk = sock.recv(min(n - len(buf), 1 << 20))
            if not chunk:
                raise EOFError
            buf += chunk
        return bytes(buf)

    n = int.from_bytes(exact(8), "little")
    if n > MAX_MESSAGE:
        raise ValueError(f"message of {n} bytes")
    return loads(exact(n))


# ---- 4. the program ---------------------------------------------------------------------------------------------
PLAIN_ATOMS = (type(None), bool, int, float, complex, str, bytes)


def plain(v, depth=0):
    """`v` as plain data (subclasses of builtin containers and scalars become the builtin), or raise TypeError."""
    if depth > 100:
        raise TypeError("nested too deep")
    t = type(v)
    if t in PLAIN_ATOMS or t is bytearray:
        return v
    for base in (bool, int, float, complex, str, bytes):
        if isinstance(v, base):
            return base(v) if base is not str else str.__str__(v)
    if isinstance(v, (list, tuple, set, frozenset)):
        base = next(b for b in (list, tuple, set, frozenset) if isinstance(v, b))
        return base(plain(x, depth + 1) for x in v)
    if isinstance(v, dict):
        return {plain(k, depth + 1): plain(x, depth + 1) for k, x in v.items()}
    raise TypeError(type(v).__name__)


def serve(sock, g):
    """Answer the harness: its calls reach the solution's objects; results go back as plain data or as handles."""
    import pickle

    handles = {}

    def obj(ref):
        return g[ref[1]] if ref[0] == "g" else handles[ref[1]]

    def encode(v):
        try:
            return ("v", plain(v))
        except TypeError:
            handles[len(handles)] = v
            return ("h", len(handles) - 1)

    def arg(a):
        return obj(a[1]) if a[0] == "r" else a[1]

    while True:
        try:
            req = recv(sock, pickle.loads)
        except (EOFError, OSError):
            return
        op, ref = req[0], req[1]
        try:
            target = obj(ref)
            if op == "call":
                out = target(*[arg(a) for a in req[2]], **{k: arg(a) for k, a in req[3].items()})
            elif op == "attr":
                out = getattr(target, req[2])
            elif op == "list":
                out = list(target)
            elif op == "len":
                out = len(target)
            elif op == "item":
                out = target[arg(req[2])]
            elif op == "bool":
                out = bool(target)
            else:
                raise ValueError(op)
            reply = encode(out)
        except BaseException as exc:  # noqa: BLE001 - the harness decides what an exception means
            reply = ("raise", type(exc).__name__, str(exc)[:300])
        send(sock, reply)


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
        send(sock, ("load_error", f"{type(exc).__name__}: {exc}"[:300]))
        os._exit(1)
    import types

    names = []  # what the harness may bind of the program (it decides; see tests_namespace)
    for name, value in list(g.items()):
        if name.startswith("__"):
            continue
        if isinstance(value, types.ModuleType):  # the harness imports its own: only the module's name crosses
            module_name = getattr(value, "__name__", None)
            names.append((name, "module", module_name if type(module_name) is str else ""))
            continue
        try:
            names.append((name, "value", plain(value)))
        except TypeError:
            names.append((name, "object", None))
    flush()
    send(sock, ("ready", names))
    serve(sock, g)
    flush()
    os._exit(0)


def flush():
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


# ---- 5. the harness ---------------------------------------------------------------------------------------------
def plain_loads_function():
    """The harness's `loads`: what the program sends is unpickled into builtin plain data only."""
    import builtins
    import io
    import pickle

    class _PlainUnpickler(pickle.Unpickler):
        """Builds only builtin plain data: no class of the program's (or anything else) can be named."""

        ALLOWED = {("builtins", "complex"), ("builtins", "bytearray"), ("builtins", "set"), ("builtins", "frozenset")}

        def find_class(self, module, name):
            if (module, name) in self.ALLOWED:
                return getattr(builtins, name)
            raise pickle.UnpicklingError(f"the program sent a {module}.{name}, which is not plain data")

    def loads(data):
        return _PlainUnpickler(io.BytesIO(data)).load()

    return loads


class ProgramGone(Exception):
    """The program exited, or closed its end of the socket, before answering the harness."""


def rpc_function(sock, loads, handle):
    """The harness's one way to the program: a request over `sock`; back comes plain data, a stand-in for one of
    the program's objects (`handle(ref)`), or the candidate's exception raised again as a builtin one."""
    import builtins

    def rpc(*req):
        try:
            send(sock, req)
            reply = recv(sock, loads)
        except (EOFError, OSError) as exc:
            raise ProgramGone("the program exited or closed its end before answering") from exc
        if reply[0] == "v":
            return reply[1]
        if reply[0] == "h":
            return handle(("h", int(reply[1])))
        if reply[0] == "raise":
            kind = getattr(builtins, str(reply[1]), None)
            # Not StopIteration: raised inside map() or filter() it would end the test's iteration early, and
            # all(map(candidate, cases)) would pass on an empty sequence.
            if (isinstance(kind, type) and issubclass(kind, Exception)
                    and not issubclass(kind, (StopIteration, StopAsyncIteration))):
                raise kind(str(reply[2]))
            raise RuntimeError(f"the candidate raised {reply[1]}: {reply[2]}")
        raise ValueError(f"malformed reply {reply!r:.80}")

    return rpc


def remote_class(sock, loads):
    """The class of the harness's stand-ins for the program's objects: each use of one is a call over `sock`
    (`rpc_function`)."""

    def enc(a):
        if isinstance(a, Remote):
            return ("r", a._ref)
        return ("v", plain(a))

    class Remote:
        """One of the program's objects: callable, its attributes and items reachable; never equal to a value."""

        __slots__ = ("_ref",)

        def __init__(self, ref):
            self._ref = ref

        def __call__(self, *args, **kwargs):
            return rpc("call", self._ref, [enc(a) for a in args], {k: enc(v) for k, v in kwargs.items()})

        def __getattr__(self, name):
            if name.startswith("__") and name.endswith("__"):
                raise AttributeError(name)
            return rpc("attr", self._ref, name)

        def __iter__(self):
            return iter(rpc("list", self._ref))

        def __len__(self):
            return rpc("len", self._ref)

        def __getitem__(self, key):
            return rpc("item", self._ref, enc(key))

        def __bool__(self):
            return bool(rpc("bool", self._ref))

        def __repr__(self):
            return "<an object of the program's>"

    rpc = rpc_function(sock, loads, Remote)
    return Remote


def tests_namespace(program_names, tests_src, Remote):
    """The globals the tests run in. Of the program they see its functions, classes and other objects as handles
    (`Remote`) and its plain data as values, never a name of a builtin: `abs`, `len`, `set` in the tests are the
    harness's own. Every module is the harness's own import: an alias the program imported (`import numpy as np`)
    is the harness's import of the same module, a module name the tests use as one (`math.isclose(...)`) is the
    harness's `math` whatever the program bound to that name, and one the tests name without importing it (MBPP's
    tests use the solution's `import math`) is imported for them. Only the standard library and the allowed
    packages can be imported here, and a module the program names that cannot be is left out (a test using it
    fails)."""
    import ast
    import builtins
    import importlib
    import importlib.util

    def harness_import(module_name):
        top = module_name.partition(".")[0]
        try:
            if top.isidentifier() and (top in sys.stdlib_module_names or importlib.util.find_spec(top)):
                return importlib.import_module(module_name)
        except Exception:  # noqa: BLE001 - not importable here: the name stays unbound
            pass
        return None

    try:
        nodes = list(ast.walk(ast.parse(tests_src)))
    except (SyntaxError, ValueError):
        nodes = []  # the tests do not compile: exec reports it
    used = {n.id for n in nodes if isinstance(n, ast.Name)}
    used_as_module = {n.value.id for n in nodes if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)}
    builtin_names = set(vars(builtins))
    ns = {"__name__": "__tandem_tests__", "__builtins__": builtins}
    for name, kind, value in program_names:
        name = str(name)
        if not name.isidentifier() or name.startswith("__") or name in builtin_names:
            continue
        if kind == "value":
            ns[name] = value
        elif kind == "object":
            ns[name] = Remote(("g", name))
        elif kind == "module":
            module = harness_import(str(value))
            if module is not None:
                ns[name] = module
    for name in sorted(used - builtin_names):
        if name in used_as_module or name not in ns:
            module = harness_import(name)
            if module is not None:
                ns[name] = module
    return ns


def run_harness(sock):
    import pickle

    loads = plain_loads_function()
    Remote = remote_class(sock, loads)
    close_fds_except(sock.fileno(), report, tests_fd)
    confine(uid_b, "/")
    sys.path[:] = [p for p in sys.path if p] + extra_paths  # the allowed packages, for the tests' own imports
    if libc is not None:
        libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    with os.fdopen(tests_fd, encoding="utf-8") as f:
        tests_src = f.read()

    def verdict(passed, reason=""):
        line = ("verdict %d %s" % (passed, reason.replace("\n", " ")[:400])).strip() + "\n"
        os.write(report, line.encode("utf-8", "replace"))

    try:
        first = recv(sock, loads)
    except (EOFError, OSError, pickle.UnpicklingError, ValueError) as exc:
        verdict(0, f"the program exited before the tests ran ({type(exc).__name__})")
        return
    if first[0] != "ready":
        verdict(0, f"the solution did not load: {first[1] if len(first) > 1 else first!r}")
        return
    ns = tests_namespace(first[1], tests_src, Remote)
    try:
        exec(compile(tests_src, "tests.py", "exec"), ns)
    except BaseException as exc:  # noqa: BLE001 - any way out of the tests but their end is a failure
        verdict(0, f"{type(exc).__name__}: {exc}")
    else:
        verdict(1)


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
os.write(report, ("exit %d\n" % status).encode())
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
