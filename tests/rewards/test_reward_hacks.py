"""The classic reward hacks against assert-style code tests, each scoring 0, beside a correct solution scoring 1."""
from __future__ import annotations

import secrets

import pytest

from tandem.rewards import REWARDS

code = REWARDS["code"].fn
FAST = dict(cpu_s=2, wall_s=4.0, allow_weak_sandbox=True)  # refusing a weak sandbox: test_sandbox_hosts.py
TESTS = ["assert add(2, 3) == 5", "assert add(-1, 2) == 1"]
WRONG = "def add(a, b):\n    return 0\n"


def score(program: str, tests=TESTS, **kw) -> float:
    return code([f"```python\n{program}\n```"], [""], [{"tests": tests}], **{**FAST, **kw})[0]


def test_a_correct_solution_passes_and_a_wrong_one_fails():
    assert score("import math\ndef add(a, b):\n    return math.floor(a) + b\n") == 1.0
    assert score(WRONG) == 0.0
    assert score("def add(a, b):\n    return a + b\n", ["assert add(2, 3) == 5", "assert add(2, 2) == 5"]) == 0.5


def test_early_sys_exit_zero():
    assert score(WRONG + "import sys\nsys.exit(0)\n") == 0.0
    assert score(WRONG + "raise SystemExit(0)\n") == 0.0


def test_printing_a_verdict_or_a_success_line():
    fakes = ["OK", "PASSED", "verdict 1", "tandem-pass", "status net=1 fs=1 uid=1 pid=1", "exit 0", "All tests passed"]
    prog = WRONG + f"for line in {fakes!r}:\n    print(line)\n"
    # ... and on every descriptor it might have inherited: the verdict's channel must not be one of them
    prog += ("import os\nfor fd in range(3, 256):\n    try:\n        os.write(fd, b'verdict 1\\n')\n"
             "    except OSError:\n        pass\n")
    assert score(prog) == 0.0


def test_reading_the_pass_marker_from_the_programs_own_code():
    # Old sandbox: the pass marker was a constant of the program's own code object, so this passed any assert test.
    marker = ("import os, sys\nfor c in sys._getframe().f_code.co_consts:\n    if str(c).startswith('tandem-pass-') and len(str(c)) > 12:\n"
              "        print(c)\n        sys.stdout.flush()\n        os._exit(0)\n")
    assert score(WRONG + marker) == 0.0


def test_finding_the_tests_in_objects_memory_descriptors_or_files():
    from tandem.sandbox import isolation

    iso = isolation()
    if not (iso.get("fs") and (iso.get("uid") or iso.get("pid"))):
        pytest.skip("a weak sandbox: the program may read the trainer's memory and files (weak_spots says so)")
    # Look for the test's text anywhere the program can reach: every live object, its own memory, every open file,
    # the file system. The test carries a random token; the program looks for anything shaped like it.
    token = "tok-" + secrets.token_hex(8)
    hunt = WRONG + r'''
import ctypes, gc, os, re
shape = re.compile(rb"tok-[0-9a-f]{16}")
found = set()
def look(data, where):
    for m in shape.findall(data):
        found.add((where, m.decode()))
for o in gc.get_objects():
    for v in list(o.values() if isinstance(o, dict) else o if isinstance(o, (list, tuple)) else ()):
        if isinstance(v, (str, bytes)):
            look(v if isinstance(v, bytes) else v.encode(errors="ignore"), "object")
class IOVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
libc = ctypes.CDLL(None, use_errno=True)
with open("/proc/self/maps") as maps:
    regions = [line.split() for line in maps]
for r in regions:
    lo, hi = (int(x, 16) for x in r[0].split("-"))
    if r[1][0] == "r" and hi - lo < (256 << 20):
        buf = ctypes.create_string_buffer(hi - lo)
        local, remote = IOVec(ctypes.addressof(buf), hi - lo), IOVec(lo, hi - lo)
        n = libc.process_vm_readv(os.getpid(), ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if n > 0:
            look(buf.raw[:n], "memory")
for fd in range(0, 256):
    try:
        os.lseek(fd, 0, 0)
        look(os.read(fd, 1 << 20), f"fd {fd}")
    except OSError:
        pass
for top in ("/tmp", "/proc", "/"):
    for dirpath, dirs, files in os.walk(top):
        if dirpath.startswith(("/proc/sys", "/proc/self/task")) or dirpath.count("/") > 4:
            dirs[:] = []
        for f in files:
            try:
                with open(os.path.join(dirpath, f), "rb") as fh:
                    look(fh.read(1 << 20), os.path.join(dirpath, f))
            except OSError:
                pass
print("FOUND", sorted(found))
'''
    from tandem.sandbox import SandboxLimits, judge_python

    r = judge_python(hunt, f"assert add(2, 3) == 5, {token!r}", SandboxLimits(cpu_s=5, wall_s=10))
    assert "FOUND" in r.stdout and token not in r.stdout, (r.stdout[-500:], r.stderr[-500:])
    assert r.passed is False
    assert score(hunt, [f"assert add(2, 3) == 5, {token!r}"]) == 0.0


def test_an_object_whose_eq_is_always_true():
    always = "class Yes:\n    def __eq__(self, other):\n        return True\n    __hash__ = object.__hash__\n"
    assert score(always + "def add(a, b):\n    return Yes()\n") == 0.0
    # a subclass of int, str or tuple with a lying __eq__ crosses as the plain value it holds
    assert score("class I(int):\n    def __eq__(self, o):\n        return True\n"
                 "def add(a, b):\n    return I(0)\n") == 0.0
    assert score("class T(tuple):\n    def __eq__(self, o):\n        return True\n"
                 "def add(a, b):\n    return T()\n", ["assert add(1, 2) == (3,)"]) == 0.0
    # a legit subclass still compares by its value
    assert score("class I(int):\n    pass\ndef add(a, b):\n    return I(a + b)\n") == 1.0


def test_patching_builtins_and_assertion_error():
    patches = WRONG + (
        "import builtins, sys\n"
        "class Never(BaseException):\n    pass\n"
        "builtins.AssertionError = Never\n"
        "builtins.abs = builtins.all = builtins.any = lambda *a, **k: True\n"
        "builtins.__import__ = lambda *a, **k: sys\n"
        "sys.modules['builtins'] = None\n"
        "sys.excepthook = lambda *a: None\n"
        "sys.settrace(lambda *a: None)\n")
    assert score(patches) == 0.0
    assert score(patches, ["assert all([add(2, 3) == 5])"]) == 0.0


def test_atexit_hooks():
    # On exit, whatever failed: print what looks like a pass marker among the module's constants, exit 0.
    prog = WRONG + ("import atexit, os, sys\n"
                    "seen = [c for c in sys._getframe().f_code.co_consts if str(c).startswith('tandem-pass')]\n"
                    "atexit.register(lambda: (print(*seen[-1:]), sys.stdout.flush(), os._exit(0)))\n")
    assert score(prog) == 0.0


def test_os_exit_after_a_fake_success_line():
    assert score(WRONG + "import os\nprint('all tests passed')\nos._exit(0)\n") == 0.0
    assert score(WRONG + "import os, sys\nsys.stdout.write('verdict 1\\n'); sys.stdout.flush()\nos._exit(0)\n") == 0.0


def test_stopping_the_tests_iteration_early():
    # StopIteration from the candidate inside map() would end the iteration: all() of nothing is True.
    prog = "def add(a, b):\n    raise StopIteration\n"
    assert score(prog, ["assert all(map(lambda c: add(*c) == c[0] + c[1], [(1, 2), (3, 4)]))"]) == 0.0


def test_killing_or_stopping_the_harness():
    prog = WRONG + ("import os, signal\nfor pid in range(1, 64):\n"
                    "    for sig in (signal.SIGSTOP, signal.SIGKILL):\n        try:\n"
                    "            os.kill(pid, sig)\n        except OSError:\n            pass\n")
    assert score(prog) == 0.0


def test_reading_the_harness_memory():
    prog = WRONG + r'''
import os
got = []
for pid in os.listdir("/proc"):
    if pid.isdigit() and int(pid) != os.getpid():
        for what in ("mem", "environ", "cmdline", "fd"):
            try:
                p = f"/proc/{pid}/{what}"
                got.append((pid, what, os.listdir(p) if what == "fd" else open(p, "rb").read(64)))
            except OSError:
                pass
print(got)
'''
    from tandem.sandbox import run_python

    r = run_python(prog)
    assert r.ok, r.stderr
    if r.isolation.get("pid"):  # without a pid namespace it sees the trainer's processes: the weak sandbox says so
        assert "mem" not in r.stdout and "'fd'" not in r.stdout, r.stdout
    assert score(prog) == 0.0


AREA_TESTS = ["assert abs(area(2) - 12.566) < 1e-3", "assert len(squares(3)) == 3",
              "assert set(uniq([1, 1, 2])) == set([1, 2])", "assert math.isclose(area(1), 3.14159, rel_tol=1e-3)"]
AREA_WRONG = "def area(r):\n    return 0\ndef squares(n):\n    return []\ndef uniq(xs):\n    return xs[:1]\n"
# (using no builtin or module that a shadow below replaces in the program itself)
AREA_RIGHT = ("import math\ndef area(r):\n    return 3.141592653589793 * r * r\n"
              "def squares(n):\n    return [i * i for i in range(n)]\ndef uniq(xs):\n    return list(dict.fromkeys(xs))\n")


@pytest.mark.parametrize("shadow", [
    "def abs(x):\n    return 0\n",
    "def len(x):\n    return 3\n",
    "def set(x=()):\n    return 0\n",
    "abs = len = set = lambda *a, **k: 0\n",
    "class math:\n    @staticmethod\n    def isclose(*a, **k):\n        return True\n",
    "import types\nmath = types.SimpleNamespace(isclose=lambda *a, **k: True)\n",
    "import types\nmath = types.ModuleType('math')\nmath.isclose = lambda *a, **k: True\n",
    "import sys, math\nmath.isclose = lambda *a, **k: True\nsys.modules['math'] = math\n",
], ids=["def-abs", "def-len", "def-set", "assigned-builtins", "class-math", "namespace-math", "module-math",
        "patched-math"])
def test_shadowing_the_builtins_and_modules_the_tests_use(shadow):
    # The program's names that shadow a builtin or a module the tests use never reach the tests: they call the
    # harness's own. The shadow alone decides nothing; the solution's functions do.
    for i, test in enumerate(AREA_TESTS):
        assert score(AREA_WRONG + shadow, [test]) == 0.0, (i, test)
    assert score(AREA_RIGHT + shadow, AREA_TESTS) == 1.0


def test_a_test_uses_a_module_the_solution_imported():
    # MBPP writes its tests this way: `math` is the solution's import, never imported by the test itself.
    tests = ["assert math.isclose(vol(10), 4188.79, rel_tol=0.001)"]
    assert score("import math\ndef vol(r):\n    return 4/3*math.pi*r**3\n", tests) == 1.0
    assert score("import math\ndef vol(r):\n    return 4/3*math.pi*r**2\n", tests) == 0.0
    # under another name, and a module the solution did not import as such: the harness imports its own
    assert score("import statistics as st\ndef middle(xs):\n    return st.median(xs)\n",
                 ["assert st.median([middle([1, 5, 3])]) == 3"]) == 1.0
    assert score("from math import pi\ndef vol(r):\n    return 4/3*pi*r**3\n", tests) == 1.0
    # an allowed package's alias: the harness's own import, from the packages the program may import
    assert score("import yaml as y\ndef dump(d):\n    return y.safe_dump(d)\n",
                 ["assert y.safe_load(dump({'a': 1})) == {'a': 1}"], packages=["yaml"]) == 1.0
    # a function named like a module is still the solution's where the tests call it
    assert score("def copy(xs):\n    return list(xs)\n", ["assert copy((1, 2)) == [1, 2]"]) == 1.0


@pytest.mark.parametrize("tests,program", [
    (["assert Solution().two_sum([2, 7, 11], 9) == [0, 1]"],
     "class Solution:\n    def two_sum(self, nums, target):\n        seen = {}\n        for i, x in enumerate(nums):\n"
     "            if target - x in seen:\n                return [seen[target - x], i]\n            seen[x] = i\n"),
    (["def check(candidate):\n    assert candidate([3, 1, 2]) == [1, 2, 3]\n    assert list(gen(3)) == [0, 1, 2]\n"
      "check(sort_list)"],
     "def sort_list(xs):\n    return sorted(xs)\ndef gen(n):\n    yield from range(n)\n"),
    (["try:\n    div(1, 0)\nexcept ZeroDivisionError:\n    pass\nelse:\n    raise AssertionError('no error')"],
     "def div(a, b):\n    return a / b\n"),
    (["import math\nassert math.isclose(area(2.0), 12.566370614359172)", "assert LIMIT == 10"],
     "import math\nLIMIT = 10\ndef area(r):\n    return math.pi * r * r\n"),
])
def test_legit_solutions_of_common_test_styles_pass(tests, program):
    assert score(program, tests) == 1.0
