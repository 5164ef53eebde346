"""The tools' contract: what a tool and an environment are, their registries, and building one by name."""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol

from tandem.plugins import Registry

ERRORS = ("bad_call", "timeout", "crashed", "too_long")  # the values ToolResult.error / StepResult.error may take


@dataclass(frozen=True)
class ToolResult:
    text: str  # the tool's output (already capped to the tool's own limit)
    error: str | None = None  # None, or one of ERRORS


class Tool(Protocol):
    """A tool: `call` is the text between its tags. Optional attributes: `tag` (the tag it is called by) and
    `bounded` (True: it bounds its own time, so it is called without a watchdog thread)."""

    def __call__(self, call: str) -> ToolResult: ...


@dataclass
class StepResult:
    observation: str  # text the loop appends before the next turn ("" = nothing)
    reward: float | None  # the environment's own reward, if it has one (built-ins: None)
    done: bool  # the conversation is over
    tool: str | None = None  # the tool called at this step, if any
    error: str | None = None  # the ToolResult's error, if any


class Environment(Protocol):
    stop: tuple[str, ...]  # stop strings the engine must stop at (the closing tags), so a turn ends at a call

    def reset(self, prompt: str) -> str: ...  # called once per conversation; returns text to append ("" usual)

    def step(self, turn_text: str) -> StepResult: ...


TOOLS: Registry[Callable[..., Tool]] = Registry("tool", what="factory function")  # name -> factory(**kwargs)
ENVIRONMENTS: Registry[Callable[..., Environment]] = Registry("environment", what="factory function")
register_tool = TOOLS.register  # decorator: a tool factory `(**kwargs) -> Tool` under a name; one taken is refused
register_environment = ENVIRONMENTS.register  # the same for an environment factory `(**kwargs) -> Environment`


def _build(factory: Callable, kind: str, name: str, kwargs: Mapping[str, Any]) -> Any:
    """`factory(**kwargs)`, a kwarg it does not take named with the ones it does."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a builtin or C callable: let it decide
        params = None
    if params is not None and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        unknown = sorted(set(kwargs) - set(params))
        if unknown:
            raise TypeError(f"{kind} {name!r} takes no kwarg {', '.join(map(repr, unknown))}; it takes: "
                            f"{', '.join(params) or 'none'}")
    return factory(**kwargs)


def make_tool(name: str, **kwargs) -> Tool:
    """The tool `name` (registered, or a plugin factory "module:function") built with `kwargs`."""
    tool = _build(TOOLS.resolve(name), "tool", name, kwargs)
    if not callable(tool):
        raise TypeError(f"tool {name!r}: its factory returned a {type(tool).__name__}, not a callable Tool")
    return tool


def make_environment(name: str, **kwargs) -> Environment:
    """The environment `name` (registered, or a plugin factory "module:function") built with `kwargs`."""
    env = _build(ENVIRONMENTS.resolve(name), "environment", name, kwargs)
    for attr in ("stop", "reset", "step"):
        if not hasattr(env, attr):
            raise TypeError(f"environment {name!r}: its factory returned a {type(env).__name__} without {attr!r} "
                            "(an Environment has stop, reset(prompt) and step(turn_text))")
    return env
