"""The judging protocol's mirrors: the harness's stand-ins for the program's objects and classes."""
import operator

from .wire import COMPARISONS, BINARY, OPERATORS

INSTANCE_DUNDERS = {"__name__", "__qualname__", "__wrapped__", "__self__", "__func__", "__annotations__",
                    "__defaults__", "__kwdefaults__", "__dataclass_fields__"}
CLASS_DUNDERS = {"__members__", "__annotations__", "__dataclass_fields__"}
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


def set_local_attr(obj, name, value):
    """Set an attribute on the harness's side of a mirror, past its __setattr__ (which asks the program)."""
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
            return OPERATORS[op](a, b)
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
