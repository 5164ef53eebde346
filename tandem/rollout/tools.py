"""Environments for multi-turn rollouts, and the tools they call: protocols, registries, calculator, python, "tools".

A multi-turn loop (tandem/rollout/multiturn.py) generates a turn until one of the environment's `stop` strings, hands
the turn's text to `Environment.step`, appends the observation it returns (tokenized once, loss mask 0) and goes on
until `done`. The built-in environment "tools" runs a tool when a turn ends with `<TAG>call</TAG>` and answers
`<result>OUTPUT</result>`:

    env = make_environment("tools", tools=["calculator"])   # env.stop == ("</calc>",)
    env.step("123*456=<calc>123*456</calc>")                 # StepResult("<result>56088</result>", None, False, ...)
    env.step("56088")                                        # no call: done

Every call is bounded in time, and a tool never stops the run: the calculator by its bounds on exponents and digits,
python by its sandbox's limits, and any other tool (plugins) by a worker thread with `tool_timeout_s`, after which
the call reports "timeout" (the thread cannot be killed: it is left to finish as a daemon, and a tool with too many
calls still hung is not called again until one returns). A tool that declares itself bounded (`tool.bounded = True`,
as the built-ins do) is called directly. Exceptions from any tool are reported as error "crashed".

Plugins are given as "module:function" where a name is expected: a tool factory for `make_tool` (and in the tools
environment's `tools` list), an environment factory for `make_environment`. A tool's tag is its `tag` attribute, else
its registered name (or the plugin's function name).
"""
from __future__ import annotations

import ast
import decimal
import difflib
import inspect
import math
import operator
import re
import threading
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol, Sequence

from tandem.plugins import import_plugin

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


TOOLS: dict[str, Callable[..., Tool]] = {}  # name -> factory(**kwargs) -> Tool
ENVIRONMENTS: dict[str, Callable[..., Environment]] = {}  # name -> factory(**kwargs) -> Environment


def _register(registry: dict, kind: str, name: str):
    def deco(factory):
        if name in registry:
            raise ValueError(f"{kind} {name!r} is registered twice; pick another name (registered: "
                             f"{', '.join(sorted(registry))})")
        registry[name] = factory
        return factory

    return deco


def register_tool(name: str):
    """Decorator: register a tool factory `(**kwargs) -> Tool` under `name`; a name already taken is refused."""
    return _register(TOOLS, "tool", name)


def register_environment(name: str):
    """Decorator: register an environment factory `(**kwargs) -> Environment` under `name`; duplicates refused."""
    return _register(ENVIRONMENTS, "environment", name)


def _resolve(registry: Mapping[str, Callable], kind: str, name: str) -> Callable:
    """A registered factory, or a plugin "module:function" (`tandem.plugins.import_plugin`, as for rewards)."""
    if name in registry:
        return registry[name]
    if ":" in name:
        return import_plugin(kind, name, "factory function")
    near = difflib.get_close_matches(name, list(registry), n=1)
    hint = f"; did you mean {near[0]!r}?" if near else ""
    raise KeyError(f"unknown {kind} {name!r}{hint} (registered: {', '.join(sorted(registry)) or 'none'}; or give a "
                   f"plugin as 'module:function')")


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
    tool = _build(_resolve(TOOLS, "tool", name), "tool", name, kwargs)
    if not callable(tool):
        raise TypeError(f"tool {name!r}: its factory returned a {type(tool).__name__}, not a callable Tool")
    return tool


def make_environment(name: str, **kwargs) -> Environment:
    """The environment `name` (registered, or a plugin factory "module:function") built with `kwargs`."""
    env = _build(_resolve(ENVIRONMENTS, "environment", name), "environment", name, kwargs)
    for attr in ("stop", "reset", "step"):
        if not hasattr(env, attr):
            raise TypeError(f"environment {name!r}: its factory returned a {type(env).__name__} without {attr!r} "
                            "(an Environment has stop, reset(prompt) and step(turn_text))")
    return env


# ---------------------------------------------------------------------------------------------------------- calculator

_MAX_EXPONENT = 64
_MAX_DIGITS = 10_000
_TOO_BIG = 10 ** _MAX_DIGITS  # results at or above this in magnitude have more than _MAX_DIGITS digits
_MAX_BITS = math.ceil(_MAX_DIGITS / math.log10(2)) + 1
_MAX_CALL_CHARS = 2000  # longer expressions nest deeply enough to exhaust the parser's recursion
_BINOPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}


class _Refused(ValueError):
    """An expression the calculator does not evaluate; the message is what the model reads."""


def _number(x: Any) -> int | float:
    """`x` if it is a finite int or float of at most _MAX_DIGITS digits; refused otherwise."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise _Refused("unsupported expression" if not isinstance(x, complex) else "complex result")
    if isinstance(x, float) and not math.isfinite(x):
        raise _Refused("result is not finite")
    if isinstance(x, int) and abs(x) >= _TOO_BIG:
        raise _Refused(f"result has more than {_MAX_DIGITS} digits")
    return x


def _check_operands(op: type, a: int | float, b: int | float) -> None:
    """Refuse, before computing it, an operation whose result would be too large to be cheap."""
    if op is ast.Pow:
        if abs(b) > _MAX_EXPONENT:
            raise _Refused(f"exponent {b!r} is above {_MAX_EXPONENT}")
        if isinstance(a, int) and isinstance(b, int) and b > 0 and (abs(a).bit_length() - 1) * b > _MAX_BITS:
            raise _Refused(f"result has more than {_MAX_DIGITS} digits")
    elif op is ast.Mult and isinstance(a, int) and isinstance(b, int):
        if abs(a).bit_length() + abs(b).bit_length() > _MAX_BITS + 1:
            raise _Refused(f"result has more than {_MAX_DIGITS} digits")


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _number(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        x = _eval(node.operand)
        return -x if isinstance(node.op, ast.USub) else x
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        a, b = _eval(node.left), _eval(node.right)
        _check_operands(type(node.op), a, b)
        try:
            return _number(_BINOPS[type(node.op)](a, b))
        except ZeroDivisionError:
            raise _Refused("division by zero") from None
        except OverflowError:
            raise _Refused("result is too large for a float") from None
    raise _Refused("unsupported expression")


def _format(x: int | float) -> str:
    # Decimal, because str() of an int refuses more than 4300 digits (sys.int_info.default_max_str_digits).
    return str(decimal.Decimal(x)) if isinstance(x, int) else repr(x)


def calculate(expression: str) -> ToolResult:
    """Evaluate integers and floats with + - * / // % **, unary - and +, and parentheses, through `ast` (never eval).
    Exponents above 64, results of more than 10 000 digits, non-finite or complex results and any other syntax are
    refused with error "bad_call" and `error: <why>` as the text."""
    text = expression.strip()
    if len(text) > _MAX_CALL_CHARS:
        return ToolResult(f"error: expression longer than {_MAX_CALL_CHARS} characters", "bad_call")
    try:
        return ToolResult(_format(_eval(ast.parse(text, mode="eval"))))
    except _Refused as exc:
        return ToolResult(f"error: {exc}", "bad_call")
    except (SyntaxError, ValueError):
        return ToolResult("error: not an arithmetic expression", "bad_call")
    except (RecursionError, MemoryError):
        return ToolResult("error: expression nested too deeply", "bad_call")


class Calculator:
    """The "calculator" tool (tag `calc`): see `calculate`."""

    tag = "calc"
    bounded = True  # its bounds keep every call to milliseconds

    def __call__(self, call: str) -> ToolResult:
        return calculate(call)


@register_tool("calculator")
def calculator() -> Tool:
    return Calculator()


# -------------------------------------------------------------------------------------------------------------- python

class PythonTool:
    """The "python" tool (tag `python`): runs the call as a program in the code sandbox (tandem.rewards.sandbox) and
    returns its stdout; "timeout" when it ran out of wall or CPU time, "crashed" (text: the last lines of stderr)
    when it exited nonzero. The sandbox is checked when the tool is built, as the `code` reward's preflight does: a
    sandbox that fails its self-test, or a weak one (no namespaces) unless `allow_weak_sandbox`, is refused."""

    tag = "python"
    bounded = True  # the sandbox enforces wall time and kills everything the program started
    stderr_lines = 10
    stderr_chars = 1000

    def __init__(self, cpu_s: int = 2, wall_s: float = 5.0, memory_mb: int = 1024, output_bytes: int = 64 << 10,
                 packages: Sequence[str] = (), allow_weak_sandbox: bool = False):
        from tandem.rewards.coding import check_sandbox
        from tandem.rewards.sandbox import SandboxLimits

        check_sandbox(tuple(packages), allow_weak_sandbox)
        self.limits = SandboxLimits(cpu_s=cpu_s, wall_s=wall_s, memory_mb=memory_mb, output_bytes=output_bytes)
        self.packages = tuple(packages)

    def __call__(self, call: str) -> ToolResult:
        import signal

        from tandem.rewards.sandbox import run_python

        r = run_python(call, "", self.limits, packages=self.packages)
        # The CPU limit ends a busy loop before the wall limit does: SIGXCPU at the soft limit, SIGKILL at the hard.
        if r.timed_out or r.returncode in (-signal.SIGXCPU, -signal.SIGKILL):
            return ToolResult(f"error: timed out (limits: {self.limits.cpu_s} s CPU, {self.limits.wall_s:g} s wall)",
                              "timeout")
        # The file-size limit caps the output: a program that reaches it dies of SIGXFSZ or EFBIG (OSError).
        if r.returncode != 0 and len(r.stdout.encode()) >= self.limits.output_bytes:
            return ToolResult(r.stdout, "too_long")
        if r.returncode != 0:
            # The sandbox's own frames name host paths and mean nothing to the model: only the program's remain.
            lines = [ln for ln in r.stderr.rstrip().splitlines() if "sandbox_boot.py" not in ln]
            tail = "\n".join(lines[-self.stderr_lines:])[-self.stderr_chars:]
            return ToolResult(tail or f"error: exit code {r.returncode}", "crashed")
        return ToolResult(r.stdout)


@register_tool("python")
def python_tool(cpu_s: int = 2, wall_s: float = 5.0, memory_mb: int = 1024, output_bytes: int = 64 << 10,
           packages: Sequence[str] = (), allow_weak_sandbox: bool = False) -> Tool:
    return PythonTool(cpu_s, wall_s, memory_mb, output_bytes, packages, allow_weak_sandbox)


# ------------------------------------------------------------------------------------------------- calling any tool

class GuardedTool:
    """Calls a tool so that it cannot stop the run: an exception is error "crashed"; a tool that does not declare
    itself `bounded` runs in a daemon thread and reports "timeout" after `timeout_s`. A thread cannot be killed, so a
    hung call is left running; while `max_hung` calls of this tool are still hung, new calls are not started."""

    def __init__(self, tool: Tool, name: str, timeout_s: float = 10.0, max_hung: int = 4):
        self.tool, self.name, self.timeout_s, self.max_hung = tool, name, timeout_s, max_hung
        self.bounded = bool(getattr(tool, "bounded", False))
        self._hung: list[threading.Thread] = []
        self._lock = threading.Lock()

    def __call__(self, call: str) -> ToolResult:
        if self.bounded:
            return self._checked(call)
        with self._lock:
            self._hung = [t for t in self._hung if t.is_alive()]
            if len(self._hung) >= self.max_hung:
                return ToolResult(f"error: timed out ({len(self._hung)} earlier calls still running)", "timeout")
        box: list[ToolResult] = []
        thread = threading.Thread(target=lambda: box.append(self._checked(call)), daemon=True,
                                  name=f"tool-{self.name}")
        thread.start()
        thread.join(self.timeout_s)
        if box:
            return box[0]
        with self._lock:
            self._hung.append(thread)
        return ToolResult(f"error: timed out after {self.timeout_s:g} s", "timeout")

    def _checked(self, call: str) -> ToolResult:
        try:
            result = self.tool(call)
        except (Exception, SystemExit):  # the run never stops for a tool (a Ctrl-C still stops it)
            return ToolResult("error: crashed", "crashed")
        if isinstance(result, str):  # a plain function returning text is a tool too
            return ToolResult(result)
        well_formed = isinstance(result, ToolResult) and isinstance(result.text, str)
        if not well_formed or result.error not in (None, *ERRORS):
            return ToolResult("error: crashed", "crashed")  # a wrong answer type is the tool's bug, not the model's
        return result


# ------------------------------------------------------------------------------------------ "tools" environment

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
    model was fine-tuned with. `tool_kwargs` reach the tools: a kwarg named after a tool with a dict value is that tool's own
    (`python={"wall_s": 2}`); any other goes to each tool whose factory takes it (`wall_s=2`), and one that no tool
    takes is refused. `tool_timeout_s` bounds each call of a tool that does not bound itself (plugins)."""
    if isinstance(tools, str):
        tools = [tools]
    if not tools:
        raise ValueError("the tools environment needs at least one tool, e.g. tools=['calculator']")
    own = {k: v for k, v in tool_kwargs.items() if k in tools and isinstance(v, Mapping)}
    shared = {k: v for k, v in tool_kwargs.items() if k not in own}
    factories = {name: _resolve(TOOLS, "tool", name) for name in tools}
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
