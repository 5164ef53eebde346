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
import builtins
import collections
import importlib
import importlib.util
import inspect
import io
import itertools
import json
import math
import operator
import pickle
import sys
import types

MAX_MESSAGE = 64 << 20
DEPTH = 200  # nesting beyond this crosses as a reference (program) or is refused (harness)
CHUNK = 4096  # items of a builtin container's iterator sent per message
RESULT_BUDGET = 1 << 20  # values in one result beyond which it crosses as a reference

ATOMS = (type(None), bool, int, float, str, bytes)
DictKeys, DictValues, DictItems = type({}.keys()), type({}.values()), type({}.items())
DICTS = {dict: "d", collections.Counter: "Co", collections.OrderedDict: "OD"}
DICT_TAGS = {tag: cls for cls, tag in DICTS.items()}
MUTABLE = (list, dict, set, bytearray, collections.deque, collections.Counter, collections.OrderedDict,
           collections.defaultdict)
FACTORIES = {t.__name__: t for t in (int, float, complex, str, bytes, list, tuple, dict, set, frozenset, bool)}
VALUE_ANCHORS = {t.__name__: t for t in (int, float, complex, str, bytes, tuple, frozenset)}
LIVE_ANCHORS = {t.__name__: t for t in (list, dict, set, bytearray)}
BUILTIN_EXCEPTIONS = {name: t for name, t in vars(builtins).items()
                      if isinstance(t, type) and issubclass(t, BaseException)}
SAFE_ITERATORS = {type(iter(x)) for x in ([], (), set(), {}, {}.values(), {}.items(), "", "\u20ac", b"", bytearray(),
                                          range(0), range(1 << 70))} | {type(reversed([])), type(reversed(range(0)))}
# Library names a test may use relying on the solution's import (MBPP writes `assert ... == pi * r * r` after a
# solution's `from math import pi`): a program's own definition of one is judged both ways.
LIBRARY_NAMES = {**{n: ("math", n) for n in dir(math) if not n.startswith("_")},
                 **{n: ("collections", n) for n in ("Counter", "OrderedDict", "defaultdict", "deque", "namedtuple")},
                 "Fraction": ("fractions", "Fraction"), "Decimal": ("decimal", "Decimal")}
TESTS_MODULE = "__tandem_tests__"  # the tests' module name (`__module__` of the classes they define)
MODULE_ALIASES = {"np": "numpy", "pd": "pandas", "plt": "matplotlib.pyplot", "sp": "scipy", "nx": "networkx"}
INSTANCE_DUNDERS = {"__name__", "__qualname__", "__wrapped__", "__self__", "__func__", "__annotations__",
                    "__defaults__", "__kwdefaults__", "__dataclass_fields__"}
CLASS_DUNDERS = {"__members__", "__annotations__", "__dataclass_fields__"}


class ProtocolError(Exception):
    """A message that does not follow the protocol (from the program: hostile or broken)."""


class TooBig(Exception):
    """A result over the program's encoding budget: it crosses as a reference instead."""


class ProgramGone(BaseException):
    """The program exited or closed its end before answering. A BaseException: a test's `except Exception` must not
    swallow it (the verdict fails anyway: see Harness.failed)."""


# ---- framing ------------------------------------------------------------------------------------------------------
def send(sock, obj):
    data = pickle.dumps(obj, 4)
    if len(data) > MAX_MESSAGE:
        raise OverflowError(f"message of {len(data)} bytes")
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
        raise ProtocolError(f"message of {n} bytes")
    return loads(exact(n))


class _AtomsOnly(pickle.Unpickler):
    """The harness's unpickler: no class of anyone's can be named (only builtin atoms and containers come out)."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"the program sent a {module}.{name}, which is not plain data")


def atoms_only_loads(data):
    try:
        return _AtomsOnly(io.BytesIO(data)).load()
    except Exception as exc:  # noqa: BLE001 - whatever a crafted pickle raises
        raise ProtocolError(f"unreadable message ({type(exc).__name__})") from None


class Channel:
    """One end of the socket: `request` sends a request and answers the other side's nested requests (with
    `handle`) until its reply arrives."""

    def __init__(self, sock, loads, handle):
        self.sock, self.loads, self.handle = sock, loads, handle

    def request(self, msg):
        send(self.sock, msg)
        while True:
            got = recv(self.sock, self.loads)
            if type(got) is not tuple or not got:
                raise ProtocolError("a message that is not a tuple")
            if got[0] in ("ok", "err"):
                return got
            send(self.sock, self.handle(got))

    def serve(self):
        while True:
            try:
                got = recv(self.sock, self.loads)
            except (EOFError, OSError):
                return
            send(self.sock, self.handle(got))


# ---- values both ways ---------------------------------------------------------------------------------------------
def _std(module, name):
    """A standard-library class, if its module is loaded (no value of it can exist otherwise)."""
    return getattr(sys.modules.get(module), name, None)


def _ints(*xs):
    if not all(type(x) is int for x in xs):
        raise ProtocolError("expected integers")
    return xs


def _list(x):
    if type(x) is not list:
        raise ProtocolError("expected a list")
    return x


class Codec:
    """Data to nodes and back (the module docstring's first two kinds), with the argument containers' copy-back;
    each side adds how its own objects and the other's references cross (`encode_other`, `decode_other`)."""

    # -- encoding: `memo` maps id() of the call's argument containers to their index; `register`, when encoding a
    # call's arguments, collects them (pre-order, as the decoder will meet them)
    budget = None  # values a reply may still encode (the program's side, for a result that may cross by reference)

    def encode(self, v, memo, register=None, depth=0):
        if self.budget is not None:
            self.budget -= 1
            if self.budget < 0:
                raise TooBig
        t = type(v)
        if t in ATOMS:
            return v
        index = memo.get(id(v))
        if index is not None:
            return ("a", index)
        if depth > DEPTH:
            return self.encode_other(v, memo, register, depth)
        if register is not None and (t in MUTABLE or self.is_record(v)):
            memo[id(v)] = len(register)
            register.append(v)
        return self.encode_value(v, memo, register, depth)

    def is_record(self, v):
        """Whether `v`, not a builtin container, is an object of the tests' passed by its attributes (Harness)."""
        return False

    def encode_value(self, v, memo, register=None, depth=0):
        t = type(v)
        enc = lambda x: self.encode(x, memo, register, depth + 1)  # noqa: E731
        if t is list:
            return ("l", [enc(x) for x in v])
        if t is tuple:
            return ("t", [enc(x) for x in v])
        if t is set or t is frozenset:
            return ("s" if t is set else "f", [enc(x) for x in v])
        if t in DICTS:
            return (DICTS[t], [y for k, x in v.items() for y in (enc(k), enc(x))])
        if t is collections.defaultdict and (v.default_factory is None or
                                             FACTORIES.get(getattr(v.default_factory, "__name__", "")) is v.default_factory):
            name = None if v.default_factory is None else v.default_factory.__name__
            return ("DD", name, [y for k, x in v.items() for y in (enc(k), enc(x))])
        if t is collections.deque:
            return ("dq", [enc(x) for x in v], v.maxlen)
        if t is bytearray:
            return ("ba", bytes(v))
        if t is complex:
            return ("x", v.real, v.imag)
        if t is _std("fractions", "Fraction"):
            return ("Fr", v.numerator, v.denominator)
        if t is _std("decimal", "Decimal"):
            return ("De", str(v))
        dt = sys.modules.get("datetime")  # (the modules are imported where a value of theirs can exist)
        if dt is not None and t is dt.timedelta:
            return ("td", v.days, v.seconds, v.microseconds)
        if dt is not None and t is dt.date:
            return ("date", v.year, v.month, v.day)
        if (dt is not None and (t is dt.datetime or t is dt.time)
                and (v.tzinfo is None or type(v.tzinfo) is dt.timezone)):
            tz = None if v.tzinfo is None else (v.tzinfo.utcoffset(None) // dt.timedelta(microseconds=1),
                                                v.tzinfo.tzname(None))
            clock = (v.hour, v.minute, v.second, v.microsecond, tz, v.fold)
            return ("dt", v.year, v.month, v.day, *clock) if t is dt.datetime else ("tm", *clock)
        if t is range:
            return ("rg", v.start, v.stop, v.step)
        if t is DictKeys or t is DictValues:
            return ("dk" if t is DictKeys else "dv", [enc(x) for x in v])
        if t is DictItems:
            return ("di", [y for k, x in v for y in (enc(k), enc(x))])
        if v is NotImplemented or v is Ellipsis:
            return ("NI",) if v is NotImplemented else ("El",)
        return self.encode_other(v, memo, register, depth)

    def encode_content(self, v, memo):
        """A container of the call's arguments as it is now, for the caller to update its own in place."""
        if type(v) not in MUTABLE:  # an object of the tests', by its attributes
            return ("ns", type(v).__name__, [y for k, x in vars(v).items() for y in (str(k), self.encode(x, memo))])
        return self.encode_value(v, memo)

    # -- decoding: `refs` resolves ("a", i); `record`, when decoding a call's arguments, collects its containers
    def decode(self, node, refs, record=None, depth=0):
        t = type(node)
        if t in ATOMS:
            return node
        if t is not tuple or not node or type(node[0]) is not str or depth > DEPTH:
            raise ProtocolError("malformed value")
        tag = node[0]
        dec = lambda x: self.decode(x, refs, record, depth + 1)  # noqa: E731

        def fill(out, items):
            if record is not None:
                record.append(out)
            return out, items

        def pairs(flat):
            flat = _list(flat)
            if len(flat) % 2:
                raise ProtocolError("odd pairs")
            return [(dec(flat[i]), dec(flat[i + 1])) for i in range(0, len(flat), 2)]

        try:
            if tag == "a":
                (index,) = _ints(node[1])
                return refs[index]
            if tag == "l":
                out, items = fill([], _list(node[1]))
                out.extend(dec(x) for x in items)
                return out
            if tag == "t":
                return tuple(dec(x) for x in _list(node[1]))
            if tag == "s":
                out, items = fill(set(), _list(node[1]))
                out.update(dec(x) for x in items)
                return out
            if tag == "f":
                return frozenset(dec(x) for x in _list(node[1]))
            if tag in DICT_TAGS:
                out, flat = fill(DICT_TAGS[tag](), node[1])
                for k, x in pairs(flat):
                    dict.__setitem__(out, k, x)
                return out
            if tag == "DD":
                factory = None if node[1] is None else FACTORIES[node[1]]
                out, flat = fill(collections.defaultdict(factory), node[2])
                for k, x in pairs(flat):
                    out[k] = x
                return out
            if tag == "dq":
                maxlen = node[2]
                if maxlen is not None:
                    _ints(maxlen)
                out, items = fill(collections.deque(maxlen=maxlen), _list(node[1]))
                out.extend(dec(x) for x in items)
                return out
            if tag == "ba":
                if type(node[1]) is not bytes:
                    raise ProtocolError("bytearray")
                return fill(bytearray(node[1]), None)[0]
            if tag == "x":
                if not (type(node[1]) is float and type(node[2]) is float):
                    raise ProtocolError("complex")
                return complex(node[1], node[2])
            if tag == "Fr":
                return importlib.import_module("fractions").Fraction(*_ints(node[1], node[2]))
            if tag == "De":
                if type(node[1]) is not str or len(node[1]) > 10000:
                    raise ProtocolError("decimal")
                return importlib.import_module("decimal").Decimal(node[1])
            datetime = importlib.import_module("datetime") if tag in ("td", "date", "dt", "tm") else None
            if tag == "td":
                return datetime.timedelta(*_ints(*node[1:4]))
            if tag == "date":
                return datetime.date(*_ints(*node[1:4]))
            if tag in ("dt", "tm"):
                date = _ints(*node[1:4]) if tag == "dt" else ()
                clock = node[4:] if tag == "dt" else node[1:]
                h, mi, s, us, tz, fold = clock
                _ints(h, mi, s, us, fold)
                tzinfo = None
                if tz is not None:
                    offset, name = tz
                    _ints(offset)
                    if type(name) is not str:
                        raise ProtocolError("tzname")
                    tzinfo = datetime.timezone(datetime.timedelta(microseconds=offset), name)
                if tag == "dt":
                    return datetime.datetime(*date, h, mi, s, us, tzinfo, fold=fold)
                return datetime.time(h, mi, s, us, tzinfo, fold=fold)
            if tag == "rg":
                return range(*_ints(*node[1:4]))
            if tag == "dk":
                return dict.fromkeys(dec(x) for x in _list(node[1])).keys()
            if tag == "dv":
                return {i: dec(x) for i, x in enumerate(_list(node[1]))}.values()
            if tag == "di":
                return dict(pairs(node[1])).items()
            if tag == "NI":
                return NotImplemented
            if tag == "El":
                return Ellipsis
        except ProtocolError:
            raise
        except (IndexError, KeyError, TypeError, ValueError, OverflowError, ArithmeticError) as exc:
            raise ProtocolError(f"malformed {tag!r}: {type(exc).__name__}") from None
        return self.decode_other(node, refs, record, depth)

    def apply_copyback(self, register, contents):
        """Update the call's argument containers (and objects of the tests') in place from the contents the other
        side sent back."""
        contents = _list(contents)
        if len(contents) != len(register):
            raise ProtocolError("copy-back of another number of arguments")
        new = [self.decode_attributes(node, register) if type(orig) not in MUTABLE else self.decode(node, register)
               for orig, node in zip(register, contents)]
        for orig, value in zip(register, new):
            if type(orig) not in MUTABLE:  # never an attribute that would hide a method of the tests' class
                methods = {k for k in value if hasattr(type(inspect.getattr_static(type(orig), k, None)), "__get__")}
                vars(orig).clear()
                vars(orig).update((k, x) for k, x in value.items() if k not in methods)
                continue
            if type(value) is not type(orig):
                raise ProtocolError("copy-back changed a container's type")
            if isinstance(orig, (list, bytearray)):
                orig[:] = value
            elif isinstance(orig, dict):
                dict.clear(orig)
                dict.update(orig, value)
            elif isinstance(orig, set):
                orig.clear()
                orig.update(value)
            else:  # deque
                orig.clear()
                orig.extend(value)

    def encode_other(self, v, memo, register, depth):
        raise TypeError(type(v).__name__)

    def decode_other(self, node, refs, record, depth):
        raise ProtocolError(f"unknown tag {node[0]!r}")

    def decode_attributes(self, node, refs, record=None, depth=0):
        """("ns", class name, [name, value, ...]): an object's attributes as a dict."""
        if type(node) is not tuple or len(node) != 3 or node[0] != "ns" or type(node[1]) is not str:
            raise ProtocolError("attributes")
        flat = _list(node[2])
        if len(flat) % 2 or not all(type(k) is str for k in flat[::2]):
            raise ProtocolError("attributes")
        return {k: self.decode(x, refs, record, depth + 1) for k, x in zip(flat[::2], flat[1::2])}


def _call(f, *args, **kwargs):
    return f(*args, **kwargs)


# ---- the program's side -------------------------------------------------------------------------------------------
def _base_value(v, anchor):
    """The builtin value a subclass instance holds, read with the builtin's own methods (the subclass's overrides are
    not asked)."""
    if anchor is int:
        return int.__int__(v)
    if anchor is float:
        return float.__float__(v)
    if anchor is complex:
        return complex(complex.real.__get__(v), complex.imag.__get__(v))
    if anchor is str:
        return str.__str__(v)
    if anchor is bytes or anchor is bytearray:
        return anchor(memoryview(v))  # the buffer itself
    if anchor is dict:
        return dict(dict.items(v))
    return anchor(anchor.__iter__(v))  # tuple, frozenset, list, set


class Callback:
    """A function of the tests', passed to the program: calling it asks the harness to call it."""

    __slots__ = ("_side", "_id")

    def __init__(self, side, ident):
        self._side, self._id = side, ident

    def __call__(self, *args, **kwargs):
        return self._side.call_back(self._id, args, kwargs)

    def __repr__(self):
        return "<a function of the tests>"


class ProgramSide(Codec):
    """Answers the harness: each request is an operation on the program's objects (`OPS`); results go back as data
    or as references with their classes described."""

    def __init__(self, sock, namespace):
        self.g = namespace
        self.objects = {}  # ref -> object the harness may name (kept alive for the run)
        self.ref_of = {}  # id(object) -> ref
        self.anchor_of = {}  # class ref -> the builtin its class extends, or None
        self.pending = []  # class descriptions not sent yet
        self.records = {}  # class name -> the class of the tests' objects passed by their attributes
        self.channel = Channel(sock, pickle.loads, self.handle)

    # -- references and classes
    def ref(self, v):
        r = self.ref_of.get(id(v))
        if r is None:
            r = self.ref_of[id(v)] = len(self.objects)
            self.objects[r] = v
        return r

    def class_ref(self, cls):
        known = self.ref_of.get(id(cls))
        if known is not None and known in self.anchor_of:
            return known
        r = self.ref(cls)
        anchor = next((k for k in cls.__mro__ if BUILTIN_EXCEPTIONS.get(k.__name__) is k
                       or VALUE_ANCHORS.get(k.__name__) is k or LIVE_ANCHORS.get(k.__name__) is k), None)
        self.anchor_of[r] = anchor
        bases = [self.class_ref(b) for b in cls.__bases__ if b is not object and b is not anchor
                 and getattr(builtins, b.__name__, None) is not b]
        identity = getattr(cls, "__hash__", None) is object.__hash__
        self.pending.append((r, str(cls.__name__), str(getattr(cls, "__qualname__", cls.__name__)),
                             str(getattr(cls, "__module__", "")), None if anchor is None else anchor.__name__,
                             bases, identity))
        return r

    def take_classes(self):
        out, self.pending = self.pending, []
        return out

    def reference(self, v):
        return ("o", self.ref(v), self.class_ref(type(v)), None)

    def encode_other(self, v, memo, register, depth):
        t = type(v)
        if t is Callback:
            return ("cb", v._id)
        if (t is type or t is types.BuiltinFunctionType) and getattr(builtins, v.__name__, None) is v:
            return ("b", v.__name__)
        if issubclass(t, type):
            return ("c", self.class_ref(v))
        if BUILTIN_EXCEPTIONS.get(t.__name__) is t:
            return ("exc", t.__name__, self.encode(tuple(BaseException.args.__get__(v)), memo, None, depth + 1))
        cref = self.class_ref(t)
        anchor = self.anchor_of[cref]
        if anchor is None or LIVE_ANCHORS.get(anchor.__name__) is anchor:
            return self.reference(v)
        if depth > DEPTH:
            raise TypeError("a value nested too deep to cross")
        if VALUE_ANCHORS.get(anchor.__name__) is anchor:
            return ("o", self.ref(v), cref, self.encode(_base_value(v, anchor), memo, None, depth + 1))
        return ("o", self.ref(v), cref, self.encode(tuple(BaseException.args.__get__(v)), memo, None, depth + 1))

    def encode_result(self, result, memo, name):
        """A reply's value; one over RESULT_BUDGET values (a table the tests index into) crosses as a reference where
        it is a builtin container, and "value" is asked for data whatever its size."""
        if name == "value":
            return self.encode(result, memo)
        self.budget = RESULT_BUDGET
        try:
            return self.encode(result, memo)
        except TooBig:
            self.budget = None
            if type(result) is tuple and name in ("global", "iterate"):  # the operation's own answer: part by part
                return ("t", [self.encode_result(x, memo, "") for x in result])
            if LIVE_ANCHORS.get(type(result).__name__) is type(result):
                return self.reference(result)
            return self.encode(result, memo)
        finally:
            self.budget = None

    def decode_other(self, node, refs, record, depth):
        tag = node[0]
        if tag == "r":
            return self.objects[node[1]]
        if tag == "cb":
            return Callback(self, node[1])
        if tag == "exc":
            return BUILTIN_EXCEPTIONS[node[1]](*self.decode(node[2], refs, None, depth + 1))
        if tag == "ns":  # an object of a class the tests define: a namespace of that class name with its attributes
            cls = self.records.get(node[1])
            if cls is None:
                cls = self.records[node[1]] = type(node[1], (), {"__module__": "tests"})
            obj = cls()
            if record is not None:
                record.append(obj)
            vars(obj).update(self.decode_attributes(node, refs, record, depth))
            return obj
        if tag == "b":
            return getattr(builtins, node[1])
        if tag == "bm":
            return getattr(getattr(builtins, node[1]), node[2])
        if tag == "m":
            obj = importlib.import_module(node[1])
            for part in node[2].split("."):
                obj = getattr(obj, part)
            return obj
        raise ProtocolError(f"unknown tag {tag!r}")

    # -- the operations the harness may ask for
    def op_global(self, name):
        if name not in self.g:
            return ("absent",)
        value = self.g[name]
        if isinstance(value, types.ModuleType):  # the harness imports its own: only the module's name crosses
            module_name = getattr(value, "__name__", None)
            return ("module", module_name if type(module_name) is str else "")
        return ("value", value)

    def op_iterate(self, obj):
        it = iter(obj)
        if type(it) in SAFE_ITERATORS:
            chunk = list(itertools.islice(it, CHUNK))
            return ("items", chunk, it if len(chunk) == CHUNK else None)
        return ("iter", None, it)

    def op_value(self, obj):
        anchor = self.anchor_of.get(self.ref_of.get(id(type(obj))))
        if anchor is None or LIVE_ANCHORS.get(anchor.__name__) is not anchor:
            raise TypeError("not a builtin container")
        return _base_value(obj, anchor)

    def handle(self, msg):
        record, name = [], None
        try:
            kind, _, name, args, kwargs = msg
            if kind != "op":
                raise ProtocolError(kind)
            args = [self.decode(a, record, record) for a in args]
            kwargs = {k: self.decode(x, record, record) for k, x in zip(kwargs[::2], kwargs[1::2])}
            special = {"global": self.op_global, "iterate": self.op_iterate, "value": self.op_value}.get(name)
            result, ok = (special or OPS[name])(*args, **kwargs), True
        except BaseException as exc:  # noqa: BLE001 - whatever the program's code raises goes to the harness
            result, ok = exc, False
        memo = {id(x): i for i, x in enumerate(record)}
        try:
            copyback = [self.encode_content(x, memo) for x in record]
            node = self.encode_result(result, memo, name)
            reply = ("ok" if ok else "err", self.take_classes(), node, copyback)
            if len(pickle.dumps(reply, 4)) > MAX_MESSAGE:
                raise OverflowError("over the message limit")
        except BaseException as exc:  # noqa: BLE001
            reply = ("err", self.take_classes(), ("exc", "TypeError", ("t", [f"the result could not be sent: "
                                                                             f"{type(exc).__name__}"])), [])
        return reply

    def call_back(self, ident, args, kwargs):
        register, memo = [], {}
        nodes = [self.encode(a, memo, register) for a in args]
        kw = [y for k, x in kwargs.items() for y in (k, self.encode(x, memo, register))]
        kind, _, node, copyback = self.channel.request(("op", self.take_classes(), "call", [("cb", ident)] + nodes,
                                                        kw))
        self.apply_copyback(register, copyback)
        value = self.decode(node, register)
        if kind == "ok":
            return value
        raise value


OPS = {"call": _call, "getattr": getattr, "setattr": setattr, "delattr": delattr, "len": len, "next": next,
       "reversed": reversed, "bool": bool, "str": str, "repr": repr, "format": format, "hash": hash, "int": int,
       "float": float, "complex": complex, "index": operator.index, "round": round, "trunc": math.trunc,
       "floor": math.floor, "ceil": math.ceil, "abs": abs, "neg": operator.neg, "pos": operator.pos,
       "invert": operator.invert, "getitem": operator.getitem, "setitem": operator.setitem,
       "delitem": operator.delitem, "contains": operator.contains, "divmod": divmod, "pow": pow,
       "enter": lambda o: type(o).__enter__(o), "exit": lambda o, *a: type(o).__exit__(o, *a),
       "take": lambda it, n: list(itertools.islice(it, n))}
BINARY = ("add", "sub", "mul", "matmul", "truediv", "floordiv", "mod", "lshift", "rshift", "and", "xor", "or")
OPS.update({name: getattr(operator, name if name not in ("and", "or") else name + "_") for name in BINARY})
OPS.update({"i" + name: getattr(operator, "i" + name) for name in BINARY})
OPS["ipow"] = operator.ipow
COMPARISONS = ("eq", "ne", "lt", "le", "gt", "ge")
OPS.update({name: getattr(operator, name) for name in COMPARISONS})


def serve_program(sock, namespace):
    """After the solution loaded into `namespace`: say so, then answer the harness until it closes the socket."""
    side = ProgramSide(sock, namespace)
    send(sock, ("ready",))
    side.channel.serve()


# ---- the harness's side -------------------------------------------------------------------------------------------
HARNESS = None  # the harness process's one Harness (mirrors reach it through this)


def _is_program(x):
    return isinstance(x, (ObjectMirror, ValueMirror, ExceptionMirror)) or isinstance(x, MirrorMeta)


class MirrorMeta(type):
    """The class of mirror classes: constructing, class attributes and iteration are asked of the program's class."""

    def __call__(cls, *args, **kwargs):
        return HARNESS.op("call", cls, *args, **kwargs)

    def __getattr__(cls, name):
        if name.startswith("__") and name not in CLASS_DUNDERS:
            raise AttributeError(name)
        return HARNESS.op("getattr", cls, name)

    def __iter__(cls):
        return HARNESS.iterate(cls)

    def __len__(cls):
        return HARNESS.op("len", cls)

    def __getitem__(cls, key):
        return HARNESS.op("getitem", cls, key)

    def __contains__(cls, item):
        return _contains(cls, item)

    def __bool__(cls):  # not __len__'s: a class is true
        return True

    def __repr__(cls):
        return f"<class {cls.__qualname__!r} of the program>"


def _local_attr(obj, name, value):
    object.__setattr__(obj, name, value)


class _Mirror:
    """What every mirror asks of the program: its attributes, `str`, `repr` and `format`."""

    __slots__ = ()

    def __getattr__(self, name):
        if name.startswith("__") and name not in INSTANCE_DUNDERS:
            raise AttributeError(name)
        return HARNESS.op("getattr", self, name)

    def __setattr__(self, name, value):
        if name.startswith("_tandem") or (name.startswith("__") and name.endswith("__")):
            super().__setattr__(name, value)
        else:
            HARNESS.op("setattr", self, name, value)

    def __delattr__(self, name):
        HARNESS.op("delattr", self, name)

    def __str__(self):
        return HARNESS.text("str", self)

    def __repr__(self):
        return HARNESS.text("repr", self)

    def __format__(self, spec):
        return HARNESS.text("format", self, spec)


class ValueMirror(_Mirror):
    """Mixed into the mirror of a class that extends an immutable builtin: the mirror is that builtin with the value
    the object held, so comparisons, hashing and arithmetic are the builtin's, on data."""

    __slots__ = ()


class ExceptionMirror(_Mirror):
    """Mixed into the mirror of an exception class: raised and caught like the program's (`except MyError`)."""

    __slots__ = ()


def _relation(op):
    def relate(self, other):
        if _is_program(other):
            return HARNESS.op(op, self, other)
        if type(self)._tandem_live is not None:
            return getattr(operator, op)(HARNESS.value(self), other)
        return NotImplemented

    relate.__name__ = f"__{op}__"
    return relate


def _arithmetic(op, reflected=False, in_place=False):
    def arith(self, other):
        a, b = (other, self) if reflected else (self, other)
        if _is_program(a) and _is_program(b):
            return HARNESS.op(("i" if in_place else "") + op, a, b)
        if type(self)._tandem_live is not None and not in_place:
            a, b = (HARNESS.value(x) if x is self else x for x in (a, b))
            return OPS[op](a, b)
        return NotImplemented

    arith.__name__ = f"__{'i' if in_place else 'r' if reflected else ''}{op}__"
    return arith


def _unary(op):
    def unary(self, *args):
        return HARNESS.op(op, self, *args)

    unary.__name__ = f"__{op}__"
    return unary


def _contains(container, item):
    if _is_program(item):
        return bool(HARNESS.op("contains", container, item))
    if getattr(type(container), "_tandem_live", None) is not None:
        return item in HARNESS.value(container)
    return any(x is item or x == item for x in container)  # what `in` does for an iterable, compared here


class ObjectMirror(_Mirror):
    """A mirror of an object that holds no immutable builtin value: operations are asked of the program, relations
    to the tests' values are decided on data (the module docstring's rule)."""

    def __call__(self, *args, **kwargs):
        return HARNESS.op("call", self, *args, **kwargs)

    def __iter__(self):
        return HARNESS.iterate(self)

    def __next__(self):
        return HARNESS.op("next", self)

    def __reversed__(self):
        return HARNESS.iterate(HARNESS.op("reversed", self))

    def __contains__(self, item):
        return _contains(self, item)

    def __bool__(self):
        return bool(HARNESS.op("bool", self))

    def __hash__(self):
        return object.__hash__(self) if type(self)._tandem_identity else HARNESS.op("hash", self)

    def __enter__(self):
        return HARNESS.op("enter", self)

    def __exit__(self, *exc):
        return HARNESS.op("exit", self, *exc)


for _op in ("len", "getitem", "setitem", "delitem", "int", "float", "complex", "index", "round", "trunc", "floor",
            "ceil", "abs", "neg", "pos", "invert"):
    setattr(ObjectMirror, f"__{_op}__", _unary(_op))
for _op in COMPARISONS:
    setattr(ObjectMirror, f"__{_op}__", _relation(_op))
for _op in BINARY + ("divmod", "pow"):
    setattr(ObjectMirror, f"__{_op}__", _arithmetic(_op))
    setattr(ObjectMirror, f"__r{_op}__", _arithmetic(_op, reflected=True))
    if _op != "divmod":
        setattr(ObjectMirror, f"__i{_op}__", _arithmetic(_op, in_place=True))


def _local_text(x, budget=200):
    """A short description of a value for the verdict's reason, without asking the program anything."""
    if type(x) in ATOMS:
        return repr(x)[:budget]
    if type(x) in (list, tuple, set, frozenset):
        return type(x).__name__ + "(" + ", ".join(_local_text(y, budget // 4) for y in list(x)[:8]) + ")"
    if isinstance(x, BaseException):
        return type(x).__name__ + "(" + ", ".join(_local_text(a, budget // 2) for a in x.args[:4]) + ")"
    return f"<{type(x).__name__}>"


class Harness(Codec):
    """The harness's end: mirrors of the program's objects, the tests' names, and the one verdict."""

    def __init__(self, sock, solution_src, tests_src, library, packages):
        self.channel = Channel(sock, atoms_only_loads, self.handle)
        self.mirrors = {}  # ref -> mirror (one per program object: `is` works)
        self.classes = {}  # class ref -> mirror class
        self.callbacks = []  # the tests' functions the program may call, by index
        self.callback_index = {}  # id(function) -> index
        self.failed = ""  # set when something makes the verdict a failure whatever the tests do next
        self.conflicts = set()  # program-defined LIBRARY_NAMES the tests read
        self.library = set(library)  # names judged with the library's binding in this run
        self.packages = set(packages)
        self.static = _static_bindings(solution_src)
        self.module_decisions = {}
        self.used_as_module = _used_as_module(tests_src)

    # -- classes and mirrors
    def define_classes(self, descriptions):
        for d in _list(descriptions):
            if type(d) is not tuple or len(d) != 7:
                raise ProtocolError("class description")
            ref, name, qualname, module, anchor_name, bases, identity = d
            _ints(ref)
            if not all(type(s) is str for s in (name, qualname, module)) or type(identity) is not bool:
                raise ProtocolError("class description")
            anchor = None
            if anchor_name is not None:
                anchor = (VALUE_ANCHORS.get(anchor_name) or LIVE_ANCHORS.get(anchor_name)
                          or BUILTIN_EXCEPTIONS.get(anchor_name))
                if anchor is None:
                    raise ProtocolError(f"anchor {anchor_name!r}")
            kind = ("value" if anchor_name in VALUE_ANCHORS else "exception" if anchor_name in BUILTIN_EXCEPTIONS
                    else "object")
            mixin = {"value": ValueMirror, "exception": ExceptionMirror, "object": ObjectMirror}[kind]
            parents = [self.classes[b] for b in _list(bases) if type(b) is int and b in self.classes]
            parents = [p for p in parents if p._tandem_kind == kind]
            tail = [mixin] + ([anchor] if kind != "object" else [])
            attrs = {"__module__": module[:200], "__qualname__": qualname[:200], "__doc__": None,
                     "_tandem_ref": ref, "_tandem_kind": kind, "_tandem_identity": identity,
                     "_tandem_live": anchor if kind == "object" else None, "_tandem_anchor": anchor}
            name = name[:200] if name.isidentifier() else "object"
            try:
                cls = MirrorMeta(name, tuple(parents + [b for b in tail if not any(issubclass(p, b) for p in parents)]),
                                 attrs)
            except TypeError:  # an MRO the mirrors cannot reproduce: the class alone, with what it extends
                cls = MirrorMeta(name, tuple(tail), attrs)
            self.classes[ref] = cls

    def mirror(self, ref, cref, payload, refs, depth):
        _ints(ref, cref)
        m = self.mirrors.get(ref)
        if m is not None:
            return m
        cls = self.classes.get(cref)
        if cls is None:
            raise ProtocolError("an object of an undescribed class")
        kind, anchor = cls._tandem_kind, cls._tandem_anchor
        if kind == "value":
            value = self.decode(payload, refs, None, depth + 1)
            if type(value) is not anchor:
                raise ProtocolError("a value mirror without its value")
            m = anchor.__new__(cls, value)
        elif kind == "exception":
            args = self.decode(payload, refs, None, depth + 1)
            if type(args) is not tuple:
                raise ProtocolError("an exception without its arguments")
            m = cls.__new__(cls, *args)
        else:
            m = object.__new__(cls)
        _local_attr(m, "_tandem_ref", ref)
        self.mirrors[ref] = m
        return m

    # -- values
    def is_record(self, v):
        t = type(v)
        return (getattr(t, "__module__", None) == TESTS_MODULE and not isinstance(v, type) and not callable(v)
                and isinstance(getattr(v, "__dict__", None), dict))

    def encode_other(self, v, memo, register, depth):
        if self.is_record(v):  # an object of a class the tests define: its attributes, copied back after the call
            return ("ns", type(v).__name__, [y for k, x in vars(v).items()
                                             for y in (str(k), self.encode(x, memo, register, depth + 1))])
        if isinstance(v, MirrorMeta):
            return ("r", v._tandem_ref)
        if isinstance(v, (ObjectMirror, ValueMirror, ExceptionMirror)):
            return ("r", object.__getattribute__(v, "_tandem_ref"))
        name = getattr(v, "__name__", None)
        if type(name) is str and getattr(builtins, name, None) is v:
            return ("b", name)
        owner = getattr(v, "__objclass__", None)
        if (type(name) is str and isinstance(owner, type) and getattr(builtins, owner.__name__, None) is owner
                and getattr(owner, name, None) is v):
            return ("bm", owner.__name__, name)
        module = getattr(v, "__module__", None)
        if (type(name) is str and type(module) is str and module.partition(".")[0] in sys.stdlib_module_names
                and getattr(sys.modules.get(module), name, None) is v):
            return ("m", module, name)
        if callable(v) and not isinstance(v, type):
            index = self.callback_index.get(id(v))
            if index is None:
                index = self.callback_index[id(v)] = len(self.callbacks)
                self.callbacks.append(v)
            return ("cb", index)
        raise TypeError(f"the program cannot receive a {type(v).__name__} from the tests: only data, objects of "
                        "classes the tests define (by their attributes), the tests' functions and the program's own "
                        "objects cross")

    def decode_other(self, node, refs, record, depth):
        tag = node[0]
        try:
            if tag == "o":
                return self.mirror(node[1], node[2], node[3], refs, depth)
            if tag == "c":
                (ref,) = _ints(node[1])
                return self.classes[ref]
            if tag == "exc":
                kind = BUILTIN_EXCEPTIONS[node[1]]
                args = self.decode(node[2], refs, None, depth + 1)
                if type(args) is not tuple:
                    raise ProtocolError("exception arguments")
                return kind(*args)
            if tag == "cb":
                (index,) = _ints(node[1])
                if index < 0:
                    raise ProtocolError("callback")
                return self.callbacks[index]
            if tag == "b":
                value = getattr(builtins, node[1])
                if not callable(value):
                    raise ProtocolError("builtin")
                return value
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
            raise ProtocolError(f"malformed {tag!r}: {type(exc).__name__}") from None
        raise ProtocolError(f"unknown tag {tag!r}")

    # -- asking the program
    def op(self, name, *args, **kwargs):
        if self.failed:
            raise ProgramGone(self.failed)
        register, memo = [], {}
        nodes = [self.encode(a, memo, register) for a in args]
        kw = [y for k, x in kwargs.items() for y in (k, self.encode(x, memo, register))]
        try:
            reply = self.channel.request(("op", [], name, nodes, kw))
            if len(reply) != 4 or reply[0] not in ("ok", "err"):
                raise ProtocolError("reply")
            kind, classes, node, copyback = reply
            self.define_classes(classes)
            self.apply_copyback(register, copyback)
            value = self.decode(node, register)
        except (EOFError, OSError) as exc:
            self.failed = "the program exited or closed its end before answering"
            raise ProgramGone(self.failed) from exc
        except ProtocolError as exc:
            self.failed = f"the program broke the protocol ({exc})"
            raise ProgramGone(self.failed) from None
        if kind == "ok":
            return value
        raise self.as_raised(value, name)

    def as_raised(self, exc, op):
        """What a call's exception becomes in the tests: itself, except that a StopIteration ends nothing but a
        `next()` (raised inside `map()` it would end the tests' iteration early: `all(map(...))` of nothing is True),
        and what is not an `Exception` (SystemExit, KeyboardInterrupt) cannot pass for the tests' own end."""
        if not isinstance(exc, BaseException):
            return RuntimeError(f"the candidate raised a non-exception {type(exc).__name__}")
        if op == "next" and isinstance(exc, StopIteration):
            return exc
        if isinstance(exc, (StopIteration, StopAsyncIteration)) or not isinstance(exc, Exception):
            return RuntimeError(f"the candidate raised {type(exc).__name__}")
        return exc

    def text(self, op, obj, *args):
        out = self.op(op, obj, *args)
        if type(out) is not str:
            raise TypeError(f"{op}() of a program object returned a {type(out).__name__}")
        return out

    def value(self, obj):
        return self.op("value", obj)

    def iterate(self, obj):
        """Iterate one of the program's objects: a builtin container's items come in chunks; anything else (a
        generator) in batches that double from one item, so a loop runs the program ahead of the tests by at most
        the items taken so far (`next(it)` on the program's iterator itself takes one)."""
        got = self.op("iterate", obj)
        if type(got) is not tuple or len(got) != 3 or got[0] not in ("items", "iter"):
            raise TypeError("malformed iteration")
        kind, chunk, rest = got
        if kind == "iter" and not isinstance(rest, ObjectMirror):
            raise TypeError("iter() of a program object returned no iterator")
        if kind == "items" and type(chunk) is not list:
            raise TypeError("malformed iteration")
        return self._items(chunk, rest) if kind == "items" else self._batches(rest)

    def _items(self, chunk, rest):
        yield from chunk
        if rest is not None:
            yield from self.iterate(rest)

    def _batches(self, it):
        size = 1
        while True:
            items = self.op("take", it, size)
            if type(items) is not list:
                raise TypeError("malformed iteration")
            yield from items
            if len(items) < size:
                return
            size = min(2 * size, CHUNK)

    # -- the program's requests: calls of the tests' functions it was given, nothing else
    def handle(self, msg):
        record = []
        try:
            if len(msg) != 5 or msg[0] != "op" or msg[2] != "call":
                raise ProtocolError("the program may only call the functions it was given")
            _, classes, _, args, kw = msg
            self.define_classes(classes)
            args = _list(args)
            if not args or type(args[0]) is not tuple or args[0][:1] != ("cb",):
                raise ProtocolError("the program may only call the functions it was given")
            fn, *args = [self.decode(a, record, record) for a in args]
            kw = _list(kw)
            kwargs = {str(k): self.decode(x, record, record) for k, x in zip(kw[::2], kw[1::2])}
        except ProtocolError as exc:
            self.failed = f"the program broke the protocol ({exc})"
            return ("err", [], ("exc", "RuntimeError", ("t", ["protocol"])), [])
        try:
            result, ok = fn(*args, **kwargs), True
        except AssertionError:
            # an assert of the tests' failed inside the candidate's call: the candidate may catch it, the verdict
            # does not forget it
            self.failed = "an assertion of the tests failed inside a function the tests passed to the candidate"
            result, ok = RuntimeError("assertion"), False
        except Exception as exc:  # noqa: BLE001 - the candidate sees the tests' exception as a builtin one
            kind = type(exc) if BUILTIN_EXCEPTIONS.get(type(exc).__name__) is type(exc) else RuntimeError
            result, ok = kind(_local_text(exc)), False
        memo = {id(x): i for i, x in enumerate(record)}
        try:
            node = self.encode(result, memo)
        except TypeError as exc:
            node, ok = ("exc", "TypeError", ("t", [str(exc)])), False
        return ("ok" if ok else "err", [], node, [self.encode_content(x, memo) for x in record])

    # -- the tests' names
    def module_for(self, name):
        """The harness's module for a name the tests use as one (`name.attr`): the module the program imported under
        that name, a conventional alias's (`np`), or the standard-library module or allowed package of that name,
        False where such a module cannot be imported here (the name is then unbound, never the program's), None
        where the name is no module's (it is the program's: `Solution.method`)."""
        if name not in self.module_decisions:
            target = self.static.get(name)
            wanted = (target[1] if target and target[0] == "module" else MODULE_ALIASES.get(name)
                      or (name if name in sys.stdlib_module_names or name in self.packages else None))
            self.module_decisions[name] = (_harness_import(wanted) or False) if wanted else _harness_import(name)
        return self.module_decisions[name]

    def resolve(self, name):
        """A name the tests read and did not bind, and that is no builtin (LiveBuiltins.__missing__)."""
        if name in self.library:
            module, attr = LIBRARY_NAMES[name]
            return getattr(importlib.import_module(module), attr)
        if name in self.used_as_module:
            module = self.module_for(name)
            if module is False:
                raise KeyError(name)
            if module is not None:
                return module
        target = self.static.get(name)
        if target is not None and target[0] == "attr":
            module = _harness_import(target[1])
            if module is not None and hasattr(module, target[2]):
                return getattr(module, target[2])
        got = self.op("global", name)
        if type(got) is not tuple or not got or got[0] not in ("absent", "module", "value"):
            raise KeyError(name)
        if got[0] == "absent":
            module = _harness_import(name)
            if module is None:
                raise KeyError(name)
            return module
        if got[0] == "module":
            module = _harness_import(got[1]) if type(got[1]) is str and got[1] else None
            if module is None:
                raise KeyError(name)
            return module
        if name in LIBRARY_NAMES:
            self.conflicts.add(name)
        return got[1]


class LiveBuiltins(dict):
    """The tests' builtins: the harness's own, then (`__missing__`) the program's names, read when the tests read
    them. A builtins mapping that is not exactly a dict makes every global lookup, class bodies included, come here."""

    def __missing__(self, name):
        return HARNESS.resolve(name)


def _harness_import(module_name):
    top = module_name.partition(".")[0]
    try:
        if top.isidentifier() and (top in sys.stdlib_module_names or importlib.util.find_spec(top)):
            return importlib.import_module(module_name)
    except Exception:  # noqa: BLE001 - not importable here
        pass
    return None


def _static_bindings(source):
    """Names the program binds only by imports, from its source: name -> ("module", module) or ("attr", module,
    name). A name bound any other way (a def, an assignment, a parameter of no function: module scope or `global`)
    is left out: it is the program's."""
    import ast

    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return {}
    imports, defined, stars = {}, set(), []
    declared_global = {n for node in ast.walk(tree) if isinstance(node, ast.Global) for n in node.names}

    def visit(node, top):
        if isinstance(node, ast.Import) and top:
            for a in node.names:
                bound = a.asname or a.name.partition(".")[0]
                imports.setdefault(bound, []).append(("module", a.name if a.asname else bound))
        elif isinstance(node, ast.ImportFrom) and top and node.level == 0 and node.module:
            for a in node.names:
                if a.name == "*":
                    stars.append(node.module)
                else:
                    imports.setdefault(a.asname or a.name, []).append(("attr", node.module, a.name))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if top or node.name in declared_global:
                defined.add(node.name)
            for child in ast.iter_child_nodes(node):
                visit(child, False)
            return
        elif isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            if top or node.id in declared_global:
                defined.add(node.id)
        elif isinstance(node, (ast.MatchAs, ast.MatchStar)) and node.name and top:
            defined.add(node.name)
        elif isinstance(node, ast.ExceptHandler) and node.name and top:
            defined.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)) and not top:
            for a in node.names:
                name = a.asname or a.name.partition(".")[0]
                if name in declared_global:
                    defined.add(name)
        for child in ast.iter_child_nodes(node):
            visit(child, top and not isinstance(node, (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp,
                                                       ast.GeneratorExp)))

    visit(tree, True)
    out = {name: origins[0] for name, origins in imports.items()
           if name not in defined and len(set(origins)) == 1}
    for module_name in stars:
        module = _harness_import(module_name)
        public = getattr(module, "__all__", None) or [n for n in dir(module) if not n.startswith("_")]
        for name in public if module is not None else ():
            if type(name) is str and name not in defined and name not in imports:
                out.setdefault(name, ("attr", module_name, name))
    return out


def _used_as_module(tests_src):
    import ast

    try:
        nodes = list(ast.walk(ast.parse(tests_src)))
    except (SyntaxError, ValueError):
        return set()
    return {n.value.id for n in nodes if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)}


def run_harness(sock, solution_src, tests_src, library, packages, verdict):
    """Wait for the program to load, run the tests, and give the verdict once: `verdict(passed, reason, conflicts)`."""
    global HARNESS
    HARNESS = Harness(sock, solution_src, tests_src, library, packages)
    try:
        first = recv(sock, atoms_only_loads)
    except (EOFError, OSError, pickle.UnpicklingError, ProtocolError) as exc:
        verdict(False, f"the program exited before the tests ran ({type(exc).__name__})", [])
        return
    if type(first) is not tuple or first[:1] != ("ready",):
        detail = first[1] if type(first) is tuple and len(first) > 1 and type(first[1]) is str else ""
        verdict(False, f"the solution did not load: {detail}"[:400], [])
        return
    namespace = {"__name__": TESTS_MODULE, "__builtins__": LiveBuiltins(vars(builtins))}
    try:
        exec(compile(tests_src, "tests.py", "exec"), namespace)
    except BaseException as exc:  # noqa: BLE001 - any way out of the tests but their end is a failure
        verdict(False, HARNESS.failed or _local_text(exc, 300), [])
        return
    if HARNESS.failed:
        verdict(False, HARNESS.failed, [])
        return
    verdict(True, "", sorted(HARNESS.conflicts))


def verdict_record(passed, reason, conflicts):
    """The verdict as the harness writes it: JSON, so nothing in `reason` can read as another field."""
    reason = "".join(c if c.isprintable() else " " for c in str(reason))[:300]
    return json.dumps({"passed": bool(passed), "reason": reason, "library": list(conflicts)[:50]}).encode()
