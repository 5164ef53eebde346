"""The code sandbox: correct scoring, and per attack an assertion that the damage did not happen, in bounded time."""
from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import threading
import time

import pytest

from tandem.rewards import REWARDS, SandboxLimits, extract_code, run_python
from tandem.sandbox.runner import _uid_processes, isolation

code = REWARDS["code"].fn
# Scoring is what these tests check; the refusal of a weak sandbox has its own tests (test_sandbox_hosts.py), and
# this file runs without namespaces too (test_sandbox_hosts.py::test_the_sandbox_suites_pass_as_a_user_...).
FAST = dict(cpu_s=1, wall_s=2.0, allow_weak_sandbox=True)


def score(program: str, tests: list, **kw) -> float:
    return code([f"```python\n{program}\n```"], [""], [{"tests": tests}], **{**FAST, **kw})[0]


def test_correct_and_partial_and_wrong_solutions():
    prog = "a, b = map(int, input().split())\nprint(a + b)"
    io = [{"stdin": "1 2\n", "stdout": "3\n"}, {"stdin": "10 5", "stdout": "15"}, {"stdin": "2 2", "stdout": "5"}]
    assert score(prog, io[:2]) == 1.0
    assert score(prog, io) == pytest.approx(2 / 3)
    assert score("print('3')", io[:2]) == 0.5
    assert score("def add(a, b):\n    return a + b", ["assert add(2, 3) == 5", "assert add(-1, 1) == 0"]) == 1.0
    assert score("def add(a, b):\n    return a - b", ["assert add(2, 3) == 5", "assert add(0, 0) == 0"]) == 0.5


def test_early_exit_or_printed_verdict_does_not_pass_assert_tests():
    assert score("import sys\ndef add(a, b): return 0\nsys.exit(0)", ["assert add(2, 3) == 5"]) == 0.0
    assert score("import os\ndef add(a, b): return 0\nprint('tandem-pass'); os._exit(0)",
                 ["assert add(1, 1) == 2"]) == 0.0


def test_row_schema_test_code_and_missing_tests():
    out = code(["def f(): return 1", "x"], ["", ""], [{"test_code": "assert f() == 1"}, {}], **FAST)
    assert out[0] == 1.0
    assert out[1] != out[1]  # NaN: a row without tests is reported as an error by the scorer


def test_extract_code_prefers_last_python_fence():
    text = "```\nold\n```\nthen\n```python\nnew = 1\n```\n```text\nnot code\n```"
    assert extract_code(text) == "new = 1\n"
    assert extract_code("print(1)") == "print(1)"


def test_fresh_empty_workdir_and_scrubbed_environment():
    a = run_python("import os; print(os.getcwd()); print(os.listdir('.')); print(sorted(os.environ))")
    assert a.ok, a.stderr
    cwd, listing, env = a.stdout.splitlines()
    assert listing == "[]"
    assert env == "['LANG', 'PATH']"
    b = run_python("open('left-behind', 'w').write('x'); import os; print(os.listdir('.'))")
    assert b.ok and b.stdout.strip() == "['left-behind']"
    assert run_python("import os; print(os.listdir('.'))").stdout.strip() == "[]"  # the next run starts empty


def test_infinite_loop_is_stopped_by_cpu_limit():
    t = time.monotonic()
    r = run_python("while True: pass", limits=SandboxLimits(cpu_s=1, wall_s=5))
    assert not r.ok and time.monotonic() - t < 4.5
    assert score("while True: pass", [{"stdin": "", "stdout": ""}]) == 0.0


def test_sleeping_forever_is_stopped_by_wall_limit():
    t = time.monotonic()
    r = run_python("import time; time.sleep(1000)", limits=SandboxLimits(cpu_s=1, wall_s=1.0))
    assert r.timed_out and not r.ok and time.monotonic() - t < 3


def _all_pids() -> set[int]:
    """Live processes (zombies are dead, waiting for init to reap them)."""
    live = set()
    for p in os.listdir("/proc"):
        try:
            if p.isdigit() and open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[0] not in "ZX":
                live.add(int(p))
        except OSError:
            pass
    return live


def test_fork_bomb_is_bounded_and_fully_killed():
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    before = _all_pids()
    t = time.monotonic()
    r = run_python(bomb, limits=SandboxLimits(cpu_s=1, wall_s=1.5, nproc=16))
    assert not r.ok and time.monotonic() - t < 6
    time.sleep(0.2)
    if r.uid is not None:  # the bomb ran as its own uid: not one process of that uid survives
        assert _uid_processes(r.uid) == []
    else:  # no uid of its own here: count what is new on the machine (noisy if the machine is busy)
        assert len(_all_pids() - before) < 5
    assert score(bomb + "print('x')", [{"stdin": "", "stdout": "x"}]) == 0.0



def test_a_program_may_start_threads_however_many_the_caller_runs():
    # RLIMIT_NPROC counts the real uid's threads: a limit set to the caller's *processes* plus the headroom left a
    # program no thread to start (numpy's BLAS pool failed, then numpy's import) beside a trainer with thread pools.
    # As root the program runs as a fresh uid; this is the test for a non-root caller (test_sandbox_hosts.py).
    stop = threading.Event()
    pool = [threading.Thread(target=stop.wait, daemon=True) for _ in range(40)]
    for t in pool:
        t.start()
    try:
        prog = ("import threading\nts = [threading.Thread(target=lambda: None) for _ in range(4)]\n"
                "[t.start() for t in ts]\n[t.join() for t in ts]\nprint('started')\n")
        r = run_python(prog, limits=SandboxLimits(cpu_s=2, wall_s=10, nproc=16))
        assert r.ok and r.stdout.strip() == "started", (r.returncode, r.stderr[-500:])
    finally:
        stop.set()

def test_allocating_10_gb_fails_inside_the_sandbox():
    t = time.monotonic()
    r = run_python("b = bytearray(10 * 1024**3)\nprint('allocated')")
    assert not r.ok and "MemoryError" in r.stderr and "allocated" not in r.stdout
    assert time.monotonic() - t < 5
    assert score("b = bytearray(10 * 1024**3)\nprint('ok')", [{"stdin": "", "stdout": "ok"}]) == 0.0


def _needs(*any_of: str) -> None:
    if not any(isolation().get(k) for k in any_of):
        pytest.skip(f"this machine allows none of {any_of} (see tandem.sandbox): the sandbox degrades here")


def test_cannot_write_outside_its_directory(tmp_path):
    _needs("fs")
    os.chmod(tmp_path, 0o777)  # even a world-writable directory of the trainer's is out of reach
    sentinel = tmp_path / "sentinel.txt"
    sentinel.write_text("intact")
    os.chmod(sentinel, 0o666)
    token = secrets.token_hex(6)
    targets = [str(tmp_path / "escaped.txt"), f"/tmp/tandem-escape-{token}", f"/var/tmp/tandem-escape-{token}",
               f"/dev/shm/tandem-escape-{token}", os.path.join(os.getcwd(), f"tandem-escape-{token}")]
    prog = (f"import os\nn = 0\nfor p in {targets!r}:\n    try:\n        open(p, 'w').write('x'); n += 1\n"
            f"    except OSError:\n        pass\n"
            f"for f in (lambda: open({str(sentinel)!r}, 'w').write('pwned'), lambda: os.remove({str(sentinel)!r})):\n"
            f"    try:\n        f(); n += 1\n    except OSError:\n        pass\n"
            f"print('wrote', n)")
    r = run_python(prog)
    assert r.ok, r.stderr
    for p in targets:
        assert not os.path.exists(p), p
    assert sentinel.read_text() == "intact"
    assert score(prog, [{"stdin": "", "stdout": "wrote 7"}]) == 0.0


def test_cannot_read_the_parents_environment(monkeypatch):
    _needs("uid", "pid")
    secret = "s3cr3t-" + secrets.token_hex(8)
    monkeypatch.setenv("TANDEM_TEST_SECRET", secret)  # in our os.environ, which the sandbox must not inherit
    # /proc/<pid>/environ shows a process's environment as it was at exec, so a trainer-like process started with
    # the secret is what the sandbox would find there if it could read other processes' memory.
    canary = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=dict(os.environ))
    prog = ("import os, glob\nfound = [v for v in os.environ.values() if v.startswith('s3cr3t-')]\n"
            "for p in [f'/proc/{os.getppid()}/environ', '/proc/1/environ'] + glob.glob('/proc/*/environ'):\n"
            "    try:\n        found += [x.split('=', 1)[1] for x in open(p, 'rb').read().decode(errors='replace')"
            ".split('\\0') if '=s3cr3t-' in x]\n"
            "    except OSError:\n        pass\nprint(found[0] if found else 'nothing')")
    try:
        r = run_python(prog)
        assert secret not in r.stdout and secret not in r.stderr
        assert score(prog, [{"stdin": "", "stdout": secret}]) == 0.0
    finally:
        canary.kill()
        canary.wait()


def test_cannot_open_a_network_connection():
    _needs("net")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.3)
    port = listener.getsockname()[1]
    prog = (f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\ns.sendall(b'hi')\n"
            "print('connected')")
    try:
        r = run_python(prog)
        assert not r.ok and "connected" not in r.stdout
        assert score(prog, [{"stdin": "", "stdout": "connected"}]) == 0.0
        with pytest.raises(socket.timeout):
            listener.accept()  # nobody ever reached us
    finally:
        listener.close()


def test_huge_output_is_capped():
    t = time.monotonic()
    limits = SandboxLimits(cpu_s=2, wall_s=4, output_bytes=1 << 20)
    r = run_python("while True:\n    print('x' * 65536)", limits=limits)
    assert not r.ok and len(r.stdout) <= 1 << 20 and time.monotonic() - t < 6
    assert score("while True: print('y' * 65536)", [{"stdin": "", "stdout": "y"}]) == 0.0


def test_cannot_kill_its_parent_or_other_processes():
    _needs("uid", "pid")
    canary = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        prog = (f"import os, signal\nfor pid in (os.getppid(), {os.getpid()}, {canary.pid}):\n"
                f"    for f in (lambda: os.kill(pid, 9), lambda: os.killpg(os.getpgid(pid), 9)):\n"
                f"        try:\n            f()\n        except OSError:\n            pass\n")
        if isolation().get("uid") or isolation().get("pid"):  # then kill(-1) can reach only its own processes
            prog += "try:\n    os.kill(-1, 9)\nexcept OSError:\n    pass\n"
        prog += "print('done')"
        r = run_python(prog)
        assert score(prog + "\nprint('more')", [{"stdin": "", "stdout": "survived"}]) == 0.0
        time.sleep(0.1)
        assert canary.poll() is None, "the sandbox killed a process of the trainer's"
        os.kill(os.getpid(), 0)  # and we, its parent, are alive
        if r.uid is not None:
            assert r.stdout.strip() == ""  # kill(-1) took the program itself down, and only it
    finally:
        canary.kill()
        canary.wait()


def test_an_allowed_package_under_tmp_reaches_the_harness_too(tmp_path, monkeypatch):
    """The sandbox's own /tmp hides the host's; an allowed package (a venv) under the host's /tmp is bound back on
    top of it, and the harness, another uid than the program's when root, must reach it as the program does."""
    site = tmp_path / "site"
    (site / "tandemprobe").mkdir(parents=True)
    (site / "tandemprobe" / "__init__.py").write_text("VALUE = 42\n")
    for p in (site, site / "tandemprobe", site / "tandemprobe" / "__init__.py"):
        os.chmod(p, 0o755 if p.is_dir() else 0o644)
    monkeypatch.syspath_prepend(str(site))
    assert str(site).startswith("/tmp/")
    program = "import tandemprobe as probe\ndef value():\n    return probe.VALUE\n"
    assert score(program, ["assert probe.VALUE == value() == 42", "import tandemprobe\nassert tandemprobe.VALUE == 42"],
                 packages=["tandemprobe"]) == 1.0
