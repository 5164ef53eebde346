"""User plugins named `package.module:function` (rewards, tools, environments): imported the one way for all."""
from __future__ import annotations

import importlib
import os
import sys
from typing import Callable


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
                         f"plugin module must be in the current directory ({os.getcwd()}) or on PYTHONPATH")
    except AttributeError:
        raise ValueError(f"{kind} plugin {name!r}: module {module!r} has no {what} {attr!r}") from None
    if not callable(fn):
        raise ValueError(f"{kind} plugin {name!r}: {attr!r} is a {type(fn).__name__}, not a {what}")
    return fn
