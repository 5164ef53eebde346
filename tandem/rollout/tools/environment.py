"""The "tools" environment: a turn ending in `<TAG>call</TAG>` calls that tool, and `<result>...</result>` answers."""
from __future__ import annotations

import inspect
import re
from typing import Any, Callable, Mapping, Sequence

from tandem.rollout.tools.base import TOOLS, Environment, StepResult, Tool, make_tool, register_environment
from tandem.rollout.tools.guard import GuardedTool

_TAG_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")


class ToolsEnvironment:
    """Calls a tool when a turn ends with `<TAG>call</TAG>` (trailing whitespace allowed); see the module docstring.
    The observation is `<result>OUTPUT</result>` with OUTPUT cut to `max_output_chars` (error "too_long" unless the
    tool reported an error of its own). A turn without a call ends the conversation."""

    def __init__(self, tools: Mapping[str, Tool], max_output_chars: int = 1000, tool_timeout_s: float = 10.0,
                 tags: Mapping[str, str] | None = None):
        if max_output_chars < 1:
            raise ValueError(f"max_output_chars must be at least 1, got {max_output_chars}")
        self.max_output_chars = max_output_chars
        self.by_tag: dict[str, tuple[str, GuardedTool]] = {}
        for name, tool in tools.items():
            tag = (tags or {}).get(name) or getattr(tool, "tag", None) or name.rpartition(":")[2]
            if not isinstance(tag, str) or not _TAG_RE.fullmatch(tag) or tag == "result":
                raise ValueError(f"tool {name!r}: tag {tag!r} is not usable (letters, digits, _ . -, not 'result', "
                                 "which the observations use)")
            if tag in self.by_tag:
                raise ValueError(f"tools {self.by_tag[tag][0]!r} and {name!r} both use the tag <{tag}>")
            self.by_tag[tag] = (name, GuardedTool(tool, name, tool_timeout_s))
        self.stop = tuple(f"</{tag}>" for tag in self.by_tag)

    def reset(self, prompt: str) -> str:
        return ""

    def step(self, turn_text: str) -> StepResult:
        found = self.parse(turn_text)
        if found is None:
            return StepResult("", None, True)
        tag, call = found
        name, tool = self.by_tag[tag]
        result = tool(call)
        text, error = result.text, result.error
        if len(text) > self.max_output_chars:
            marker = "...(truncated)"
            keep = self.max_output_chars - len(marker)
            text = text[:keep] + marker if keep > 0 else text[:self.max_output_chars]
            error = error or "too_long"
        return StepResult(f"<result>{text}</result>", None, False, tool=name, error=error)

    def parse(self, turn_text: str) -> tuple[str, str] | None:
        """(tag, call) when the turn ends with a known closing tag whose opening tag comes before it; else None."""
        body = turn_text.rstrip()
        for tag in self.by_tag:
            close, open_ = f"</{tag}>", f"<{tag}>"
            if body.endswith(close):
                end = len(body) - len(close)
                start = body.rfind(open_, 0, end)
                if start >= 0:
                    return tag, body[start + len(open_):end]
        return None


def _tool_kwargs(name: str, factory: Callable, shared: Mapping[str, Any], own: Mapping[str, Any]) -> dict:
    """The kwargs of the shared ones `factory` takes, then its own (`python={...}`) over them."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        params = {}
    takes_all = any(p.kind is p.VAR_KEYWORD for p in params.values())
    return {**{k: v for k, v in shared.items() if takes_all or k in params}, **own}


@register_environment("tools")
def tools_environment(tools: Sequence[str] = ("calculator",), max_output_chars: int = 1000,
                      tool_timeout_s: float = 10.0, tags: Mapping[str, str] | None = None,
                      **tool_kwargs) -> Environment:
    """The "tools" environment over `tools` (registered names or plugin factories "module:function").

    `tags` renames a tool's tag (`{"calculator": "tool"}`: called as `<tool>...</tool>`), e.g. to match the format a
    model was fine-tuned with. `tool_kwargs` reach the tools: a kwarg named after a tool with a dict value is that
    tool's own (`python={"wall_s": 2}`); any other goes to each tool whose factory takes it (`wall_s=2`), and one
    that no tool takes is refused. `tool_timeout_s` bounds each call of a tool that does not bound itself (plugins)."""
    if isinstance(tools, str):
        tools = [tools]
    if not tools:
        raise ValueError("the tools environment needs at least one tool, e.g. tools=['calculator']")
    own = {k: v for k, v in tool_kwargs.items() if k in tools and isinstance(v, Mapping)}
    shared = {k: v for k, v in tool_kwargs.items() if k not in own}
    factories = {name: TOOLS.resolve(name) for name in tools}
    used: set[str] = set()
    built: dict[str, Tool] = {}
    for name, factory in factories.items():
        kwargs = _tool_kwargs(name, factory, shared, own.get(name, {}))
        used.update(kwargs)
        built[name] = make_tool(name, **kwargs)
    unused = sorted(set(shared) - used)
    if unused:
        raise TypeError(f"the tools environment: no tool of {list(tools)} takes {', '.join(map(repr, unused))}")
    unknown = sorted(set(tags or {}) - set(built))
    if unknown:
        raise ValueError(f"the tools environment: tags {unknown} name no tool of {list(built)}")
    return ToolsEnvironment(built, max_output_chars, tool_timeout_s, tags)
