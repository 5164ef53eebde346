"""The judging protocol's program side: answers the harness's calls on the program's objects."""
import builtins
import importlib
import itertools
import math
import operator
import pickle
import types

from .wire import (BUILTIN_EXCEPTIONS, CHUNK, DEPTH, LIVE_ANCHORS, MAX_MESSAGE, OPERATORS, RESULT_BUDGET,
                   SAFE_ITERATORS, VALUE_ANCHORS, Channel, Codec, ProtocolError, TooBig, send)

def _call(f, *args, **kwargs):
    return f(*args, **kwargs)


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
       "delitem": operator.delitem, "contains": operator.contains,
       "enter": lambda o: type(o).__enter__(o), "exit": lambda o, *a: type(o).__exit__(o, *a),
       "take": lambda it, n: list(itertools.islice(it, n)), **OPERATORS}


def serve_program(sock, namespace):
    """After the solution loaded into `namespace`: say so, then answer the harness until it closes the socket."""
    side = ProgramSide(sock, namespace)
    send(sock, ("ready",))
    side.channel.serve()
