"""`calculator`: evaluates an arithmetic expression exactly (the tool of the built-in arithmetic task).

execute({"expression": "123*456"}) -> "56088". Integers, + - * // % ** and parentheses, with `/` as exact
integer division when it divides and a decimal otherwise. The expression is parsed with `ast` and only those
nodes are evaluated: nothing else runs, and exponents and operand sizes are bounded so a call stays instant.
A bad expression is answered "Error: ..." (a tool error, step reward 0), never raised.
"""
from __future__ import annotations

import ast
import operator
from typing import Any

from hybridrl.tools.base_tool import BaseTool
from hybridrl.tools.schemas import ToolResponse

MAX_DIGITS = 60
MAX_EXPONENT = 64
BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
          ast.Mod: operator.mod, ast.Pow: operator.pow, ast.Div: operator.truediv}


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression; ValueError naming what is not allowed."""
    tree = ast.parse(expression.strip(), mode="eval")
    return _value(tree.body)


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _value(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is larger than {MAX_EXPONENT}")
        if isinstance(node.op, ast.Div) and isinstance(left, int) and isinstance(right, int) and right \
                and left % right == 0:
            return left // right
        result = BINARY[type(node.op)](left, right)
        if isinstance(result, int) and len(str(abs(result))) > MAX_DIGITS:
            raise ValueError(f"the result has more than {MAX_DIGITS} digits")
        return result
    raise ValueError(f"only numbers, + - * / // % ** and parentheses are allowed, got {ast.dump(node)[:80]}")


class CalculatorTool(BaseTool):
    async def execute(self, instance_id: str, parameters: dict[str, Any],
                      **kwargs) -> tuple[ToolResponse, float, dict]:
        expression = parameters.get("expression") if isinstance(parameters, dict) else None
        if not isinstance(expression, str):
            return ToolResponse(text=f"Error: {self.name} expects {{\"expression\": \"<arithmetic>\"}}, got "
                                     f"{parameters!r}"), 0.0, {"calculator_error": 1}
        try:
            value = evaluate(expression)
        except (ValueError, SyntaxError, ZeroDivisionError, OverflowError) as err:
            return ToolResponse(text=f"Error: {type(err).__name__}: {err}"), 0.0, {"calculator_error": 1}
        return ToolResponse(text=str(value)), 0.0, {"calculator_error": 0}
