"""Built-in `calculator`: arithmetic by walking the `ast`, never `eval`.

Only numbers, + - * / // % **, unary signs, parentheses and a short list of math functions are allowed.
Sizes are bounded so that `9**9**9` or `(10**999)**999` fails fast instead of hanging the worker.
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Any

from agentrl.tools.core import tool

MAX_EXPRESSION_CHARS = 500
MAX_INT_BITS = 4096  # about 1233 decimal digits: more than any task needs, cheap to multiply
MAX_DEPTH = 200  # binary ops nest left: a sum of 200 terms is this deep

_BINOPS: dict[type, Any] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Any] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCS: dict[str, Any] = {
    "abs": abs,
    "round": round,
    "min": min,
    "max": max,
    "sqrt": math.sqrt,
    "exp": math.exp,
    "log": math.log,
    "log10": math.log10,
    "log2": math.log2,
    "sin": math.sin,
    "cos": math.cos,
    "tan": math.tan,
    "floor": math.floor,
    "ceil": math.ceil,
}
_CONSTS = {"pi": math.pi, "e": math.e, "tau": math.tau}


class CalcError(ValueError):
    pass


def _check(value: Any) -> Any:
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise CalcError(f"result too large (over {MAX_INT_BITS} bits)")
    if isinstance(value, complex):
        raise CalcError("complex results are not supported")
    return value


def _pow(base: Any, exp: Any) -> Any:
    """Refuse a power whose result would be huge *before* computing it."""
    if isinstance(exp, (int, float)) and abs(base) > 1 and exp > 0 and math.log2(abs(base)) * exp > MAX_INT_BITS:
        raise CalcError(f"result too large (over {MAX_INT_BITS} bits)")
    return base**exp


def _eval(node: ast.AST, depth: int = 0) -> Any:
    if depth > MAX_DEPTH:
        raise CalcError("expression nested too deeply")
    if isinstance(node, ast.Expression):
        return _eval(node.body, depth + 1)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.Name) and node.id in _CONSTS:
        return _CONSTS[node.id]
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _eval(node.left, depth + 1), _eval(node.right, depth + 1)
        if isinstance(node.op, ast.Pow):
            return _check(_pow(left, right))
        return _check(_BINOPS[type(node.op)](left, right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _check(_UNARY[type(node.op)](_eval(node.operand, depth + 1)))
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in _FUNCS
        and not node.keywords
        and 0 < len(node.args) <= 4
    ):
        return _check(_FUNCS[node.func.id](*(_eval(a, depth + 1) for a in node.args)))
    what = type(node).__name__
    if isinstance(node, ast.Name):
        what = f"name {node.id!r}"
    raise CalcError(f"unsupported element: {what} (allowed: numbers, + - * / // % **, {', '.join(_FUNCS)})")


def evaluate(expression: str) -> int | float:
    """Evaluate safely; raises CalcError (a ValueError) with a message fit for the model."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalcError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as err:
        raise CalcError(f"not an arithmetic expression: {getattr(err, 'msg', err)}") from None
    try:
        value = _eval(tree)
    except (ZeroDivisionError, OverflowError, TypeError) as err:
        raise CalcError(f"{type(err).__name__}: {err}") from None
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    return value


@tool
async def calculator(expression: str) -> str:  # async: on the event loop (evaluation is bounded, ~1 ms at worst)
    """Evaluate an arithmetic expression exactly (integers) or as a float.

    Args:
        expression: e.g. "(3 + 4) * 12 / 5" or "sqrt(2) ** 2"; supports + - * / // % ** and abs, round,
            min, max, sqrt, exp, log, log10, log2, sin, cos, tan, floor, ceil, pi, e.
    """
    return str(evaluate(expression))
