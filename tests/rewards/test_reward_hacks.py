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
    marker = ("import os, sys\nfor c in sys._getframe().f_code.co_consts:\n"
              "    if str(c).startswith('tandem-pass-') and len(str(c)) > 12:\n"
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
              "def squares(n):\n    return [i * i for i in range(n)]\n"
              "def uniq(xs):\n    return list(dict.fromkeys(xs))\n")


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


# ---- the verdict's channel, the names the tests rely on, correct code the old handles failed ------------
LINE_BREAKS = ["\n", "\r", "\r\n", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029"]


@pytest.mark.parametrize("brk", LINE_BREAKS, ids=[f"U+{ord(b[-1]):04X}" for b in LINE_BREAKS])
def test_a_verdict_forged_through_the_exception_text(brk):
    # The harness copied the exception text into a `verdict 0 <reason>` line, escaping only \n; the runner split the
    # report with str.splitlines(), which breaks on all of these: the last verdict won.
    forged = f"verdict 1{brk}verdict 1{brk}" + '", "passed": true, "reason": "'
    prog = f"def add(a, b):\n    raise ValueError({brk + forged!r})\n"
    assert score(prog) == 0.0
    assert score(prog, ["def check(candidate):\n    assert candidate(2, 3) == 5\ncheck(add)"]) == 0.0  # HumanEval


@pytest.mark.parametrize("numpy", [False, True], ids=["no-packages", "numpy-allowed"])
def test_names_the_tests_rely_on_faked_by_the_program(numpy):
    kw = {"packages": ["numpy"], "wall_s": 15.0} if numpy else {}  # two numpy imports on a loaded machine
    fakes = [  # (a fake of the library name, a wrong solution, the tests)
        ("def Counter(x=None):\n    return 1\n", "def count(xs):\n    return None\n",
         ["assert Counter(count([1, 1, 2])) == Counter({1: 2, 2: 1})"]),
        ("def sqrt(x):\n    return 0\n", "def hyp(a, b):\n    return 0\n", ["assert hyp(3, 4) == sqrt(25)"]),
        ("pi = 0\n", "def area(r):\n    return 0\n", ["assert area(2) == pi * 2 * 2"]),
        ("class np:\n    @staticmethod\n    def allclose(*a, **k):\n        return True\n",
         "def scale(xs, k):\n    return None\n", ["assert np.allclose(scale([1.0, 2.0], 2), [2.0, 4.0])"]),
    ]
    for fake, wrong, tests in fakes:
        assert score(fake + wrong, tests, **kw) == 0.0, fake
        assert score(wrong + fake, tests, **kw) == 0.0, fake  # defined after the solution, as a module global
        assert score(f"exec({fake!r})\n" + wrong, tests, **kw) == 0.0, fake  # bound where no parser sees it
    # the same tests pass a correct solution that imports what the tests rely on
    right = [("from collections import Counter\ndef count(xs):\n    return dict(Counter(xs))\n", fakes[0][2]),
             ("from math import sqrt\ndef hyp(a, b):\n    return sqrt(a * a + b * b)\n", fakes[1][2]),
             ("from math import pi\ndef area(r):\n    return pi * r * r\n", fakes[2][2])]
    if numpy:
        right.append(("import numpy as np\ndef scale(xs, k):\n    return [x * k for x in xs]\n", fakes[3][2]))
    for program, tests in right:
        assert score(program, tests, **kw) == 1.0, program
    # a function of the solution's that is named like the library's is still the solution's where the tests call it
    assert score("def gcd(a, b):\n    while b:\n        a, b = b, a % b\n    return a\n",
                 ["assert gcd(12, 18) == 6", "assert gcd(7, 5) == 1"], **kw) == 1.0
    assert score("def gcd(a, b):\n    return 6\n", ["assert gcd(12, 18) == 6\nassert gcd(7, 5) == 1"], **kw) == 0.0


# Correct code of the styles MBPP and HumanEval tests use, each beside a wrong variant (so that a judge that passes
# everything is red too). The old judge saw the program's objects as handles and scored every RIGHT one 0.
CORRECT_CODE = {
    "generator driven by next()": (
        "def gen(n):\n    for i in range(n):\n        yield i * i\n",
        "def gen(n):\n    yield 0\n    yield 0\n",
        "g = gen(4)\nassert next(g) == 0\nassert next(g) == 1\nassert list(g) == [4, 9]"),
    "argument sorted in place": (
        "def sort_in_place(xs):\n    xs.sort()\n",
        "def sort_in_place(xs):\n    xs = sorted(xs)\n",
        "xs = [3, 1, 2]\nsort_in_place(xs)\nassert xs == [1, 2, 3]"),
    "operators between the program's objects": (
        "from dataclasses import dataclass\n@dataclass\nclass P:\n    x: int\n    y: int\n"
        "    def __add__(self, o):\n        return P(self.x + o.x, self.y + o.y)\n",
        "from dataclasses import dataclass\n@dataclass\nclass P:\n    x: int\n    y: int\n"
        "    def __add__(self, o):\n        return P(self.x + o.x, self.y)\n",
        "assert P(1, 2) + P(3, 4) == P(4, 6)"),
    "str() of an object with __str__": (
        "class Frac:\n    def __init__(self, n, d):\n        self.n, self.d = n, d\n"
        "    def __str__(self):\n        return f'{self.n}/{self.d}'\n",
        "class Frac:\n    def __init__(self, n, d):\n        self.n, self.d = n, d\n",
        "assert str(Frac(1, 2)) == '1/2'\nassert f'{Frac(3, 4)}' == '3/4'"),
    "isinstance of the program's class": (
        "class Shape:\n    pass\nclass Square(Shape):\n    pass\ndef make():\n    return Square()\n",
        "class Shape:\n    pass\nclass Square:\n    pass\ndef make():\n    return Square()\n",
        "assert isinstance(make(), Shape) and type(make()) is Square"),
    "item assignment on an object": (
        "class Grid:\n    def __init__(self):\n        self.cells = {}\n    def __setitem__(self, k, v):\n"
        "        self.cells[k] = v\n    def __getitem__(self, k):\n        return self.cells[k]\n",
        "class Grid:\n    def __init__(self):\n        self.cells = {}\n    def __setitem__(self, k, v):\n"
        "        pass\n    def __getitem__(self, k):\n        return self.cells.get(k)\n",
        "g = Grid()\ng[1, 2] = 5\nassert g[1, 2] == 5"),
    "a namedtuple's attribute": (
        "from collections import namedtuple\nPoint = namedtuple('Point', 'x y')\n"
        "def mid(a, b):\n    return Point((a.x + b.x) / 2, (a.y + b.y) / 2)\n",
        "from collections import namedtuple\nPoint = namedtuple('Point', 'x y')\n"
        "def mid(a, b):\n    return Point(a.y, a.x)\n",
        "m = mid(Point(0, 0), Point(2, 4))\nassert (m.x, m.y) == (1, 2) and m == (1, 2)"),
    "a Fraction or a date result": (
        "from fractions import Fraction\nimport datetime\ndef half(n):\n    return Fraction(n, 2)\n"
        "def next_day(d):\n    return d + datetime.timedelta(days=1)\n",
        "from fractions import Fraction\nimport datetime\ndef half(n):\n    return Fraction(n, 3)\n"
        "def next_day(d):\n    return d\n",
        "from fractions import Fraction\nimport datetime\nassert half(1) == Fraction(1, 2)\n"
        "assert next_day(datetime.date(2024, 2, 28)) == datetime.date(2024, 2, 29)"),
    "a list of the program's objects": (
        "class Item:\n    def __init__(self, w):\n        self.w = w\n"
        "def items(n):\n    return [Item(i) for i in range(n)]\n",
        "class Item:\n    def __init__(self, w):\n        self.w = w\ndef items(n):\n    return [Item(0)] * n\n",
        "assert [it.w for it in items(3)] == [0, 1, 2]"),
    "a module-level table over 64 MB": (  # about 100 MB pickled
        "TABLE = [i * 1_000_003 for i in range(10_000_000)]\ndef lookup(i):\n    return TABLE[i]\n",
        "TABLE = [i * 1_000_003 for i in range(10_000_000)]\ndef lookup(i):\n    return TABLE[i + 1]\n",
        "assert lookup(1234) == 1234 * 1_000_003\nassert TABLE[7] == 7_000_021"),
    "a global counter read after calls": (
        "calls = 0\ndef tick():\n    global calls\n    calls += 1\n",
        "calls = 0\ndef tick():\n    calls = 1\n",
        "tick()\ntick()\nassert calls == 2"),
    "a function passed in": (
        "def apply(f, xs):\n    return [f(x) for x in xs]\n",
        "def apply(f, xs):\n    return xs\n",
        "assert apply(lambda x: x * 2, [1, 2]) == [2, 4]"),
    "key=len": (
        "def longest(words, key):\n    return max(words, key=key)\n",
        "def longest(words, key):\n    return words[0]\n",
        "assert longest(['a', 'abc', 'ab'], key=len) == 'abc'\nassert longest(['B', 'a'], key=str.lower) == 'B'"),
    "the program's own exception class caught": (
        "class BadInput(ValueError):\n    pass\ndef check_age(n):\n    if n < 0:\n        raise BadInput('negative')\n"
        "    return n\n",
        "class BadInput(ValueError):\n    pass\ndef check_age(n):\n"
        "    if n < 0:\n        raise ValueError('negative')\n"
        "    return n\n",
        "try:\n    check_age(-1)\nexcept BadInput as e:\n    assert str(e) == 'negative'\nelse:\n"
        "    raise AssertionError('no BadInput')"),
    "an object of a class the tests define": (
        "def invert(t):\n    if t is not None:\n"
        "        t.left, t.right = invert(t.right), invert(t.left)\n    return t\n",
        "def invert(t):\n    return t\n",
        "class Node:\n    def __init__(self, v, left=None, right=None):\n"
        "        self.v, self.left, self.right = v, left, right\n"
        "t = Node(1, Node(2), Node(3))\nassert invert(t) is t and (t.left.v, t.right.v) == (3, 2)"),
}


@pytest.mark.parametrize("case", list(CORRECT_CODE))
def test_correct_code_passes_and_its_wrong_twin_fails(case):
    right, wrong, tests = CORRECT_CODE[case]
    # the 64 MB table takes about 1 s of CPU to build and pickle: FAST's 2 s ran out once on a loaded machine
    assert score(right, [tests], cpu_s=10, wall_s=20.0) == 1.0
    assert score(wrong, [tests], cpu_s=10, wall_s=20.0) == 0.0


# What the mirrors of the program's objects must not let through: relations with the tests' values decided by the
# program (the rule in sandbox/judge/mirrors.py), a swallowed assertion of the tests', a program gone inside
# `except Exception`, a method of the tests' object hidden by the copy-back, a crafted message on the program's socket.
ATTACKS = {
    "arithmetic that returns what the tests want": (
        "class Z:\n    def __sub__(self, o):\n        return 0.0\n    __rsub__ = __sub__\n"
        "    def __abs__(self):\n        return 0.0\ndef area(r):\n    return Z()\n",
        "assert abs(area(2) - 12.566) < 1e-3"),
    "a container that contains everything": (
        "class Every:\n    def __contains__(self, x):\n        return True\ndef divisors(n):\n    return Every()\n",
        "assert 3 in divisors(12) and 4 in divisors(12)"),
    "comparisons that are always true": (
        "class Z:\n    __lt__ = __le__ = __gt__ = __ge__ = __eq__ = lambda s, o: True\n    __hash__ = object.__hash__\n"
        "def add(a, b):\n    return Z()\n",
        "assert add(2, 3) >= 5 and add(2, 3) <= 5 and add(2, 3) == 5"),
    "a builtin subclass whose operators lie": (
        "class I(int):\n    __eq__ = __le__ = __ge__ = lambda s, o: True\n    __hash__ = int.__hash__\n"
        "    def __sub__(self, o):\n        return 0\ndef add(a, b):\n    return I(0)\n",
        "assert add(2, 3) == 5 and abs(add(2, 3) - 5) < 1"),
    "an assertion of the tests swallowed by the candidate": (
        "def run(check):\n    try:\n        check(1)\n    except BaseException:\n        pass\n    return True\n",
        "def check(x):\n    assert x == 2\nassert run(check)"),
    "the program gone inside the tests' except Exception": (
        "import os\ndef parse(s):\n    os._exit(0)\n",
        "try:\n    parse('x')\nexcept Exception:\n    pass"),
    "a method of the tests' object hidden by the candidate": (
        "def solve(board):\n    board.is_solved = lambda: True\n",
        "class Board:\n    def __init__(self):\n        self.cells = [0]\n    def is_solved(self):\n"
        "        return self.cells == [1]\nb = Board()\nsolve(b)\nassert b.is_solved()"),
    "a crafted pickle on the program's socket": (
        "import os, pickle, socket\nclass E:\n    def __reduce__(self):\n"
        "        return (os.system, ('touch /tmp/pwned',))\n"
        "s = socket.socket(fileno=3)\ndata = pickle.dumps(('ready',))\n"
        "s.sendall(len(data).to_bytes(8, 'little') + data)\n"
        "data = pickle.dumps(('ok', [], E(), []))\ns.sendall(len(data).to_bytes(8, 'little') + data)\n"
        "def add(a, b):\n    return 0\n",
        "assert add(2, 3) == 5"),
    "a forged reply on the program's socket": (
        "import pickle, socket\ns = socket.socket(fileno=3)\n"
        "def add(a, b):\n    data = pickle.dumps(('ok', [], 5, []))\n"
        "    s.sendall(len(data).to_bytes(8, 'little') + data)\n"
        "    return 0\n",
        "assert add(2, 3) == 5 and add(1, 1) == 2"),
}


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_the_mirrors_let_no_relation_to_the_tests_values_be_the_programs(attack):
    program, tests = ATTACKS[attack]
    assert score(program, [tests]) == 0.0
