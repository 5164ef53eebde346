"""The "calculator" tool: integer and float arithmetic through `ast`, bounded so that every call is cheap."""
from __future__ import annotations

import ast
import decimal
import math
import operator
from typing import Any, Callable

from tandem.rollout.tools.base import Tool, ToolResult, register_tool

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
