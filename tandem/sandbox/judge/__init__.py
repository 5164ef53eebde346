"""The code sandbox's judging protocol: the program answers calls on its objects, the harness runs the tests on mirrors.

Standard library only; boot.py loads it before it confines itself, then runs `serve_program` in the program's process
and `run_harness` in the harness's (see boot.py for the two processes and their confinement). Both ends speak over one
socket, in strictly nested requests either way (a call of the tests' may call back into a function the tests passed).

What crosses is data, never code or live objects of the other side:
- plain values (None, bool, numbers, str, bytes, lists, tuples, sets, dicts, and exact standard-library value types:
  Fraction, Decimal, date/time/datetime/timedelta, Counter, OrderedDict, defaultdict, deque, range, dict views) by
  value, rebuilt by the receiver from checked parts: the harness's unpickler names no class, and it decodes nothing
  but builtin atoms and tagged tuples and lists;
- every other object of the program's as a reference: the harness holds a *mirror*, an instance of a mirror class
  built from the program's class (its name, its program bases, and the builtin it extends), so `isinstance`,
  `type(x) is P`, `except MyError` and the program's class hierarchy work in the tests. A mirror of a class that
  extends an immutable builtin (a namedtuple, an IntEnum) *is* that builtin with the value it held; its other
  attributes, and everything about a mirror of a plain object, are asked of the program;
- a function of the tests' passed to the program (`key=...`, a lambda) as a callback the program can only call;
  a builtin (`len`, `str.lower`) by name, so the program calls its own;
- a mutable argument (a list the candidate sorts in place) goes over as a copy and comes back: after each call the
  receiver sends the arguments' final contents, and the caller updates its own objects in place.

The rule that keeps the verdict the harness's: **a program object never judges its relation to a value of the
tests.** `==`, `!=`, `<`, `<=`, `>`, `>=`, `in` and arithmetic between a mirror and a value of the tests use data only:
the builtin value the object extends, if any (read from the program as data); otherwise `==` is identity and the rest
is unsupported. Between two of the program's objects the program decides (`P(1, 2) + P(3, 4) == P(4, 6)`), as it
would in one process. Calls (`f(x)`, `obj.m(x)`, `obj[k]`, `len(obj)`, `str(obj)`, `next(it)`) are the program's.

Names: the tests' builtins are the harness's own; a name the tests use and do not define is looked up in the program
each time it is read (a global counter read after calls is current), except that modules and names the program
imported are the harness's own imports of the same thing. A name the program defines that also names a standard
library function or constant the tests may rely on (`Counter`, `sqrt`, `pi`: `LIBRARY_NAMES`) is a *conflict*: the
verdict reports it and the runner judges again with the library's binding; the tests must pass both ways.
"""
from .harness import run_harness, verdict_record  # noqa: F401
from .program import serve_program  # noqa: F401
from .wire import send  # noqa: F401
