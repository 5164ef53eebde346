"""Registries of named functions (advantages, losses, rewards, tools, environments) and user plugins named
`package.module:function`, imported the one way for all. Imports nothing of tandem: every layer may use it."""
from __future__ import annotations

import difflib
import importlib
import os
import sys
from typing import Any, Callable, Generic, Iterator, Mapping, TypeVar

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])


class Registry(Mapping[str, T], Generic[T]):
    """The entries of one kind by name. `register(name, **declared)` is a decorator that stores
    `entry(name, fn, **declared)` (the function itself unless `entry` says otherwise) and refuses a name that is
    taken; `resolve(name)` also takes a user plugin by import path, whose entry gets nothing declared (an `entry`
    may read the function's own attributes there)."""

    def __init__(self, kind: str, entry: Callable[..., T] | None = None, what: str = "function"):
        self.kind, self.what = kind, what  # "reward", "tool", ...; what a plugin's attribute must be
        self._entry = entry or (lambda name, fn: fn)
        self._entries: dict[str, T] = {}

    def register(self, name: str, **declared: Any) -> Callable[[F], F]:
        def deco(fn: F) -> F:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is registered twice; pick another name (registered: "
                                 f"{', '.join(sorted(self._entries))})")
            self._entries[name] = self._entry(name, fn, **declared)
            return fn

        return deco

    def __getitem__(self, name: str) -> T:
        return self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def resolve(self, name: str) -> T:
        """A registered entry, or a plugin "module:function" (`import_plugin`); KeyError naming the nearest."""
        if name in self._entries:
            return self._entries[name]
        if ":" in name:
            return self._entry(name, import_plugin(self.kind, name, self.what))
        raise KeyError(self.unknown(name))

    def unknown(self, name: str) -> str:
        """The message for a name that is neither registered nor a plugin."""
        near = difflib.get_close_matches(name, list(self._entries), n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        return (f"unknown {self.kind} {name!r}{hint} (registered: {', '.join(sorted(self._entries)) or 'none'}; or "
                "give a plugin as 'module:function')")


def import_plugin(kind: str, name: str, what: str = "function") -> Callable:
    """The callable `name` ("package.module:function") names, looked for on sys.path and in the current directory
    (where `python -m tandem.cli` finds it, and the `tandem` script, whose sys.path[0] is its bin folder, would not).
    `kind` and `what` name it in the errors: "reward plugin 'm:f': module 'm' has no function 'f'"."""
    module, _, attr = name.partition(":")
    if os.getcwd() not in sys.path:  # appended, so an installed module of the same name still wins
        sys.path.append(os.getcwd())
    try:
        fn = getattr(importlib.import_module(module), attr)
    except ImportError as exc:
        raise ValueError(f"{kind} plugin {name!r}: cannot import {module!r} ({type(exc).__name__}: {exc}); a "
                         f"plugin module must be in the current directory ({os.getcwd()}) or on PYTHONPATH") from exc
    except AttributeError:
        raise ValueError(f"{kind} plugin {name!r}: module {module!r} has no {what} {attr!r}") from None
    if not callable(fn):
        raise ValueError(f"{kind} plugin {name!r}: {attr!r} is a {type(fn).__name__}, not a {what}")
    return fn
