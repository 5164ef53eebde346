"""The sandbox on the machines users have: root with a 0700 home, a non-root user whose Python lies under a private
home, and no user namespaces at all (as in many containers); what the program can see; the self-test's refusals."""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap

import pytest

from tandem.rewards import REWARDS, RewardScorer
from tandem import sandbox
from tandem.sandbox import runner
from tandem.rewards.base import RewardSetupError
from tandem.sandbox.runner import (SandboxBroken, _interpreter, isolation, judge_python, run_python, self_test,
                                    weak_spots)

SANDBOX_DIR = os.path.dirname(runner.__file__)
USER = 12345  # any uid without a passwd entry: nothing of it exists on the machine

# A seccomp filter that fails unshare(2) with EPERM, installed before the sandbox runs: user (and all other)
# namespaces are then unavailable, as under Docker's default profile. x86_64 syscall number.
NO_NAMESPACES = textwrap.dedent('''
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    class Filter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint)]
    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Filter))]
    rules = (Filter * 4)(Filter(0x20, 0, 0, 0), Filter(0x15, 0, 1, 272), Filter(0x06, 0, 0, 0x00050000 | 1),
                         Filter(0x06, 0, 0, 0x7fff0000))
    assert libc.prctl(38, 1, 0, 0, 0) == 0
    assert libc.prctl(22, 2, ctypes.byref(Prog(4, rules)), 0, 0) == 0, ctypes.get_errno()
    assert libc.unshare(0x10000000) != 0  # user namespaces are gone for this process and its children
''')

PROBE = textwrap.dedent('''
    import importlib.util, json, sys
    spec = importlib.util.spec_from_file_location("sandbox_copy", sys.argv[1] + "/runner.py")
    sb = importlib.util.module_from_spec(spec)
    sys.modules["sandbox_copy"] = sb
    spec.loader.exec_module(sb)
    out = {"uid": __import__("os").getuid()}
    try:
        out["self_test"] = sb.self_test()
    except sb.SandboxBroken as exc:
        out["broken"] = str(exc)
    r = sb.run_python("import math, os\\nprint(math.sqrt(16))\\nprint(sorted(os.listdir('/')))\\n"
                      "print(os.path.exists('/root/.bashrc'), os.path.exists('/etc/passwd'))")
    out["run"] = [r.returncode, r.stdout, r.stderr[-300:], r.isolation]
    j = sb.judge_python("def add(a, b):\\n    return a + b\\n", "assert add(2, 3) == 5")
    out["judge"] = [j.passed, j.reason]
    out["weak"] = sb.weak_spots(r.isolation)
    print("RESULT " + json.dumps(out))
''')


def _python_under_root() -> str:
    python = _interpreter()
    if (os.geteuid() != 0 or not python.startswith("/root/") or not shutil.which("unshare")
            or not shutil.which("setpriv")):
        pytest.skip("needs root, util-linux and an interpreter under /root (to give it to another user's home)")
    return python


def _as_user(top: str, where: str, cwd: str, command: str) -> str:
    """A shell script for `unshare -m`: /root becomes uid USER's own 0700 home holding `top` (the interpreter's
    tree, bound back in), then `command` runs as USER in `cwd` with an empty environment."""
    stash = os.path.join(where, "stash")
    os.mkdir(stash)
    return (f"mount --bind {top} {stash} && mount -t tmpfs -o mode=0700,uid={USER},gid={USER} home /root"
            f" && mkdir {top} && mount --bind {stash} {top} && cd {cwd} &&"
            f" exec setpriv --reuid={USER} --regid={USER} --clear-groups"
            f" env -i PATH=/usr/bin:/bin HOME=/root {command}")


def run_elsewhere(as_user: bool, namespaces: bool) -> dict:
    """Run PROBE against a copy of the sandbox module: as uid USER whose 0700 home (/root, in a private mount
    namespace) holds the interpreter, or as root; with or without namespaces."""
    python = _python_under_root()
    where = tempfile.mkdtemp(prefix="tandem-sandbox-copy-")
    try:
        os.chmod(where, 0o755)
        for f in ("runner.py", "boot.py"):
            shutil.copy(os.path.join(SANDBOX_DIR, f), where)
        shutil.copytree(os.path.join(SANDBOX_DIR, "judge"), os.path.join(where, "judge"),
                        ignore=shutil.ignore_patterns("__pycache__"))
        with open(os.path.join(where, "probe.py"), "w") as f:
            f.write(("" if namespaces else NO_NAMESPACES) + PROBE)
        top = "/root/" + python[len("/root/"):].split("/")[0]  # e.g. /root/.pyenv
        run = f"{python} {where}/probe.py {where}"
        if as_user:
            script = _as_user(top, where, "/", run)
        else:
            script = f"cd / && exec env -i PATH=/usr/bin:/bin {run}"
        proc = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script],
                              capture_output=True, text=True, timeout=120)
        lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
        assert lines, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
        return json.loads(lines[0][len("RESULT "):])
    finally:
        shutil.rmtree(where, ignore_errors=True)


def test_as_root_the_standard_library_imports_though_it_lies_under_a_0700_home():
    # The defect: as root the program dropped to a fresh uid that could not traverse /root, so `import math`
    # failed and every correct solution scored 0. Here the interpreter is under /root whenever tests run as root.
    r = run_python("import math, json, collections\nprint(math.sqrt(4))")
    assert r.ok and r.stdout.strip() == "2.0", r.stderr
    assert REWARDS["code"].fn(["import math\ndef f(x):\n    return math.sqrt(x)"], [""],
                              [{"tests": ["assert f(9) == 3.0"]}])[0] == 1.0
    assert self_test()["fs"] == isolation()["fs"]


def test_a_user_whose_python_lies_under_its_private_home():
    out = run_elsewhere(as_user=True, namespaces=True)
    assert out["uid"] == USER
    assert "broken" not in out, out["broken"]
    assert out["self_test"] == {"net": 1, "fs": 1, "uid": 0, "pid": 1}  # its own uid, in a user namespace
    code, stdout, stderr, iso = out["run"]
    assert code == 0, stderr
    lines = stdout.splitlines()
    assert lines[0] == "4.0"
    assert "root" in lines[1] and "work" not in lines[1] and "home" not in lines[1]
    assert lines[2] == "False False"  # not its home's other files, not /etc
    assert out["judge"] == [True, ""]
    assert out["weak"] == []


def test_without_user_namespaces_it_runs_weak_and_says_what_is_not_contained():
    out = run_elsewhere(as_user=True, namespaces=False)
    assert "broken" not in out, out["broken"]
    assert out["self_test"] == {"net": 0, "fs": 0, "uid": 0, "pid": 0}
    assert out["run"][0] == 0 and out["run"][1].startswith("4.0"), out["run"]
    assert out["judge"] == [True, ""]
    weak = " ".join(out["weak"])
    for what in ("temporary directories", "environment", "kill the trainer", "loopback"):
        assert what in weak, weak


def test_as_root_without_namespaces_the_self_test_refuses_and_says_why():
    # The uid drop still happens, so the program cannot read the interpreter under /root: refuse, naming it.
    out = run_elsewhere(as_user=False, namespaces=False)
    assert "broken" in out, out
    assert "standard library imports" in out["broken"] and "No module named" in out["broken"]
    assert _interpreter() in out["broken"]


def test_it_sees_the_interpreter_and_nothing_else_of_the_host(tmp_path):
    if not isolation().get("fs"):
        pytest.skip("no mount namespace here: the sandbox degrades (see tandem.sandbox)")
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cret")
    os.chmod(tmp_path, 0o755)
    os.chmod(secret, 0o644)  # world-readable on the host, and still not there in the sandbox
    venv_pkg = os.path.dirname(os.path.dirname(json.__file__))  # the stdlib's parent
    prog = (f"import os, sys\nfor p in [{str(secret)!r}, '/etc/passwd', '/etc/hostname', os.getcwd() + '/..', "
            f"{os.path.dirname(pytest.__file__)!r}, {sys.prefix!r}, '/usr/bin', '/home', '/var', '/work', "
            f"'/proc/1/root/etc']:\n"
            f"    print(p, os.path.exists(p))\n"
            f"for name in ('pytest', 'torch', 'yaml', 'tandem'):\n"
            f"    try:\n        __import__(name)\n        print(name, 'imported')\n"
            f"    except ImportError:\n        print(name, 'absent')\n"
            f"print(sorted(os.listdir({venv_pkg!r})) == sorted(os.listdir({venv_pkg!r})))")
    r = run_python(prog)
    assert r.ok, r.stderr
    for line in r.stdout.splitlines()[:11]:
        path, seen = line.rsplit(" ", 1)
        assert seen == "False" or path.endswith("/.."), line
    assert "imported" not in r.stdout
    allowed = run_python("import yaml\nprint(yaml.safe_dump({'a': 1}).strip())\nimport torch", packages=["yaml"])
    assert allowed.stdout.strip() == "a: 1" and "No module named 'torch'" in allowed.stderr, allowed.stderr
    with pytest.raises(ValueError, match="no_such_pkg"):
        run_python("pass", packages=["no_such_pkg"])


def test_a_weak_sandbox_is_refused_unless_allowed_then_loudly_warned(monkeypatch, caplog):
    weak = {"net": 0, "fs": 0, "uid": 0, "pid": 0}
    monkeypatch.setattr(sandbox, "self_test", lambda packages=(): weak)
    monkeypatch.setattr(sandbox, "_WARNED", set())
    with pytest.raises(RewardSetupError, match="sandbox is weak.*allow_weak_sandbox"):
        RewardScorer([("code", 1.0, {})], workers=0)
    with caplog.at_level(logging.WARNING, logger="tandem.sandbox"):
        RewardScorer([("code", 1.0, {"allow_weak_sandbox": True})], workers=0).close()
    assert "CODE SANDBOX IS WEAK" in caplog.text and "kill the trainer" in caplog.text
    with pytest.raises(RewardSetupError, match="unexpected keyword argument 'cpu'"):
        RewardScorer([("code", 1.0, {"cpu": 1})], workers=0)


def test_a_broken_sandbox_stops_the_scorer_before_training(monkeypatch):
    def broken(packages=()):
        raise SandboxBroken("the code sandbox fails its self-test on this machine: expected the standard library "
                            "imports")

    monkeypatch.setattr(sandbox, "self_test", broken)
    with pytest.raises(RewardSetupError, match="reward 'code' cannot run: the code sandbox fails its self-test"):
        RewardScorer([("code", 1.0, {})], workers=0)
    assert weak_spots({"net": 1, "fs": 1, "uid": 1, "pid": 1}) == []
    assert judge_python("def f():\n    return 1\n", "assert f() == 1").passed is True


def _readable_by_others(path: str) -> bool:
    """Whether another uid can reach `path` (every directory above it searchable, the path itself readable)."""
    parts = os.path.abspath(path).split("/")
    dirs = ["/".join(parts[:i]) or "/" for i in range(1, len(parts))]
    return all(os.stat(d).st_mode & 0o001 for d in dirs) and bool(os.stat(path).st_mode & 0o004)


@pytest.mark.parametrize("namespaces", [True, False], ids=["user-namespaces", "no-namespaces"])
def test_the_sandbox_suites_pass_as_a_user_whose_python_is_under_its_private_home(namespaces):
    """test_sandbox.py and test_reward_hacks.py, whole, as uid USER (its Python under its 0700 home), with user
    namespaces and without them: every attack is stopped or, where only namespaces could stop it, skipped by name."""
    python = _python_under_root()
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    site = os.path.dirname(os.path.dirname(pytest.__file__))
    if not (_readable_by_others(repo) and _readable_by_others(site)):
        pytest.skip(f"the checkout ({repo}) or its packages ({site}) are not readable by another user")
    top = "/root/" + python[len("/root/"):].split("/")[0]
    where = tempfile.mkdtemp(prefix="tandem-sandbox-suite-")
    try:
        os.chmod(where, 0o755)
        runner = os.path.join(where, "run.py")
        with open(runner, "w") as f:
            f.write(("" if namespaces else NO_NAMESPACES) +
                    "import sys, pytest\nsys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '-rs', "
                    "'tests/sandbox/test_sandbox.py', 'tests/rewards/test_reward_hacks.py']))\n")
        script = _as_user(top, where, repo, f"{sys.executable} {runner}")
        proc = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script],
                              capture_output=True, text=True, timeout=600)
    finally:
        shutil.rmtree(where, ignore_errors=True)
    tail = proc.stdout[-3000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    assert " passed" in proc.stdout, tail
    if namespaces:
        assert "skipped" not in proc.stdout, tail  # a user namespace gives it every confinement
