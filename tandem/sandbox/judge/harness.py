"""The judging protocol's harness side: runs the tests on mirrors of the program's objects and gives the verdict."""
import builtins
import importlib
import json
import pickle
import sys

from . import mirrors
from .mirrors import ExceptionMirror, MirrorMeta, ObjectMirror, ValueMirror, set_local_attr
from .names import (LIBRARY_NAMES, MODULE_ALIASES, TESTS_MODULE, harness_import, static_bindings,
                    used_as_module)
from .wire import (ATOMS, BUILTIN_EXCEPTIONS, CHUNK, LIVE_ANCHORS, VALUE_ANCHORS, Channel, Codec, ProgramGone,
                   ProtocolError, checked_ints, checked_list, atoms_only_loads, recv)

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
        self.static = static_bindings(solution_src)
        self.module_decisions = {}
        self.used_as_module = used_as_module(tests_src)

    # -- classes and mirrors
    def define_classes(self, descriptions):
        for d in checked_list(descriptions):
            if type(d) is not tuple or len(d) != 7:
                raise ProtocolError("class description")
            ref, name, qualname, module, anchor_name, bases, identity = d
            checked_ints(ref)
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
            parents = [self.classes[b] for b in checked_list(bases) if type(b) is int and b in self.classes]
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
        checked_ints(ref, cref)
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
        set_local_attr(m, "_tandem_ref", ref)
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
                (ref,) = checked_ints(node[1])
                return self.classes[ref]
            if tag == "exc":
                kind = BUILTIN_EXCEPTIONS[node[1]]
                args = self.decode(node[2], refs, None, depth + 1)
                if type(args) is not tuple:
                    raise ProtocolError("exception arguments")
                return kind(*args)
            if tag == "cb":
                (index,) = checked_ints(node[1])
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
            args = checked_list(args)
            if not args or type(args[0]) is not tuple or args[0][:1] != ("cb",):
                raise ProtocolError("the program may only call the functions it was given")
            fn, *args = [self.decode(a, record, record) for a in args]
            kw = checked_list(kw)
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
            self.module_decisions[name] = (harness_import(wanted) or False) if wanted else harness_import(name)
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
            module = harness_import(target[1])
            if module is not None and hasattr(module, target[2]):
                return getattr(module, target[2])
        got = self.op("global", name)
        if type(got) is not tuple or not got or got[0] not in ("absent", "module", "value"):
            raise KeyError(name)
        if got[0] == "absent":
            module = harness_import(name)
            if module is None:
                raise KeyError(name)
            return module
        if got[0] == "module":
            module = harness_import(got[1]) if type(got[1]) is str and got[1] else None
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
        return mirrors.HARNESS.resolve(name)



def run_harness(sock, solution_src, tests_src, library, packages, verdict):
    """Wait for the program to load, run the tests, and give the verdict once: `verdict(passed, reason, conflicts)`."""
    harness = mirrors.HARNESS = Harness(sock, solution_src, tests_src, library, packages)
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
        verdict(False, harness.failed or _local_text(exc, 300), [])
        return
    if harness.failed:
        verdict(False, harness.failed, [])
        return
    verdict(True, "", sorted(harness.conflicts))


def verdict_record(passed, reason, conflicts):
    """The verdict as the harness writes it: JSON, so nothing in `reason` can read as another field."""
    reason = "".join(c if c.isprintable() else " " for c in str(reason))[:300]
    return json.dumps({"passed": bool(passed), "reason": reason, "library": list(conflicts)[:50]}).encode()
