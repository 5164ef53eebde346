"""The judging protocol's wire: framing, the request loop of either end, and values to nodes and back."""
import builtins
import collections
import importlib
import inspect
import io
import operator
import pickle
import sys

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
class ProtocolError(Exception):
    """A message that does not follow the protocol (from the program: hostile or broken)."""


class TooBig(Exception):
    """A result over the program's encoding budget: it crosses as a reference instead."""


class ProgramGone(BaseException):
    """The program exited or closed its end before answering. A BaseException: a test's `except Exception` must not
    swallow it (the verdict fails anyway: see Harness.failed)."""
BINARY = ("add", "sub", "mul", "matmul", "truediv", "floordiv", "mod", "lshift", "rshift", "and", "xor", "or")
COMPARISONS = ("eq", "ne", "lt", "le", "gt", "ge")
# the operator functions of both, by name (the program applies them to its objects; a mirror to builtin values)
OPERATORS = {**{name: getattr(operator, name if name not in ("and", "or") else name + "_") for name in BINARY},
             **{"i" + name: getattr(operator, "i" + name) for name in BINARY}, "ipow": operator.ipow,
             **{name: getattr(operator, name) for name in COMPARISONS}, "divmod": divmod, "pow": pow}


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


def checked_ints(*xs):
    """`xs`, each checked to be an int (a received field the sender may have forged)."""
    if not all(type(x) is int for x in xs):
        raise ProtocolError("expected integers")
    return xs


def checked_list(x):
    """`x`, checked to be a list (a received field the sender may have forged)."""
    if type(x) is not list:
        raise ProtocolError("expected a list")
    return x


UNKNOWN = object()  # a tag the base decoder does not know: a subclass's `decode_other` decodes it


def decode_scalar(tag, node):
    """A value of a tag whose content holds no other node (numbers, dates, ranges, the two singletons); UNKNOWN
    for any other tag."""
    if tag == "x":
        if not (type(node[1]) is float and type(node[2]) is float):
            raise ProtocolError("complex")
        return complex(node[1], node[2])
    if tag == "Fr":
        return importlib.import_module("fractions").Fraction(*checked_ints(node[1], node[2]))
    if tag == "De":
        if type(node[1]) is not str or len(node[1]) > 10000:
            raise ProtocolError("decimal")
        return importlib.import_module("decimal").Decimal(node[1])
    if tag in ("td", "date", "dt", "tm"):
        return decode_time(tag, node)
    if tag == "rg":
        return range(*checked_ints(*node[1:4]))
    if tag == "NI":
        return NotImplemented
    if tag == "El":
        return Ellipsis
    return UNKNOWN


def decode_time(tag, node):
    """A timedelta, date, datetime or time, each field checked an int and a timezone's name a str."""
    datetime = importlib.import_module("datetime")
    if tag == "td":
        return datetime.timedelta(*checked_ints(*node[1:4]))
    if tag == "date":
        return datetime.date(*checked_ints(*node[1:4]))
    date = checked_ints(*node[1:4]) if tag == "dt" else ()
    clock = node[4:] if tag == "dt" else node[1:]
    h, mi, s, us, tz, fold = clock
    checked_ints(h, mi, s, us, fold)
    tzinfo = None
    if tz is not None:
        offset, name = tz
        checked_ints(offset)
        if type(name) is not str:
            raise ProtocolError("tzname")
        tzinfo = datetime.timezone(datetime.timedelta(microseconds=offset), name)
    if tag == "dt":
        return datetime.datetime(*date, h, mi, s, us, tzinfo, fold=fold)
    return datetime.time(h, mi, s, us, tzinfo, fold=fold)


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
        if t is collections.defaultdict and (
                v.default_factory is None
                or FACTORIES.get(getattr(v.default_factory, "__name__", "")) is v.default_factory):
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
        try:
            out = self.decode_container(tag, node, refs, record, depth)
            if out is UNKNOWN:
                out = decode_scalar(tag, node)
        except ProtocolError:
            raise
        except (IndexError, KeyError, TypeError, ValueError, OverflowError, ArithmeticError) as exc:
            raise ProtocolError(f"malformed {tag!r}: {type(exc).__name__}") from None
        return self.decode_other(node, refs, record, depth) if out is UNKNOWN else out

    def decode_container(self, tag, node, refs, record, depth):
        """A reference, or a container whose items are decoded in turn (`record` collects a call's argument
        containers); UNKNOWN for any other tag."""
        dec = lambda x: self.decode(x, refs, record, depth + 1)  # noqa: E731

        def fill(out, items):
            if record is not None:
                record.append(out)
            return out, items

        def pairs(flat):
            flat = checked_list(flat)
            if len(flat) % 2:
                raise ProtocolError("odd pairs")
            return [(dec(flat[i]), dec(flat[i + 1])) for i in range(0, len(flat), 2)]

        if tag == "a":
            (index,) = checked_ints(node[1])
            return refs[index]
        if tag == "l":
            out, items = fill([], checked_list(node[1]))
            out.extend(dec(x) for x in items)
            return out
        if tag == "t":
            return tuple(dec(x) for x in checked_list(node[1]))
        if tag == "s":
            out, items = fill(set(), checked_list(node[1]))
            out.update(dec(x) for x in items)
            return out
        if tag == "f":
            return frozenset(dec(x) for x in checked_list(node[1]))
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
                checked_ints(maxlen)
            out, items = fill(collections.deque(maxlen=maxlen), checked_list(node[1]))
            out.extend(dec(x) for x in items)
            return out
        if tag == "ba":
            if type(node[1]) is not bytes:
                raise ProtocolError("bytearray")
            return fill(bytearray(node[1]), None)[0]
        if tag == "dk":
            return dict.fromkeys(dec(x) for x in checked_list(node[1])).keys()
        if tag == "dv":
            return {i: dec(x) for i, x in enumerate(checked_list(node[1]))}.values()
        if tag == "di":
            return dict(pairs(node[1])).items()
        return UNKNOWN

    def apply_copyback(self, register, contents):
        """Update the call's argument containers (and objects of the tests') in place from the contents the other
        side sent back."""
        contents = checked_list(contents)
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
        flat = checked_list(node[2])
        if len(flat) % 2 or not all(type(k) is str for k in flat[::2]):
            raise ProtocolError("attributes")
        return {k: self.decode(x, refs, record, depth + 1) for k, x in zip(flat[::2], flat[1::2])}
