"""Tool calls as a Python list of calls (vLLM's ``--tool-call-parser pythonic``: Llama 3.2/4,
ToolACE): ``[get_weather(city='SF'), add(x=1, y=-2.5)]``. The list is read with ``ast`` as data,
never evaluated: each element must be a call of a plain name with keyword arguments whose values
are literals (strings, numbers, True/False/None, lists, tuples, dicts). See ``leading_calls.py``
for what is a call and what is content."""

from __future__ import annotations

import ast
import json
import math
from typing import Any

from tokenline.frontend.tool_parsers.leading_calls import NEED_MORE, LeadingCallsParser

__all__ = ["PythonicParser"]


class _NotLiteral(ValueError):
    pass


def _literal(node: ast.expr) -> Any:
    """The JSON value a literal expression stands for; ``_NotLiteral`` for anything else."""
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (str, bool, int, float))):
        value = node.value
    elif (isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd))
          and isinstance(node.operand, ast.Constant) and type(node.operand.value) in (int, float)):
        value = -node.operand.value if isinstance(node.op, ast.USub) else node.operand.value
    elif isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    elif isinstance(node, ast.Dict):
        if any(k is None or not isinstance(k, ast.Constant) or not isinstance(k.value, str) for k in node.keys):
            raise _NotLiteral("dict keys must be strings")  # `**d` has a None key
        return {k.value: _literal(v) for k, v in zip(node.keys, node.values)}  # type: ignore[union-attr]
    else:
        raise _NotLiteral(type(node).__name__)
    if isinstance(value, float) and not math.isfinite(value):
        raise _NotLiteral("not a JSON number")  # 1e999
    return value


class PythonicParser(LeadingCallsParser):
    python_strings = True

    def _first_block_at(self, text: str) -> int | None:
        rest = text.lstrip()
        if not rest:
            return NEED_MORE
        return len(text) - len(rest) if rest[0] == "[" else None

    def _next_block_at(self, text: str) -> int | None:
        # One list holds all the calls; what follows it is text, after the layout whitespace.
        return None if text.strip() else NEED_MORE

    def _decode(self, block: str) -> list[tuple[str, str]] | None:
        try:
            tree = ast.parse(block, mode="eval")
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return None
        if not isinstance(tree.body, ast.List) or not tree.body.elts:
            return None
        calls = []
        for element in tree.body.elts:
            if not isinstance(element, ast.Call) or not isinstance(element.func, ast.Name) or element.args:
                return None  # positional arguments have no name to give them
            try:
                arguments = {k.arg: _literal(k.value) for k in element.keywords if k.arg is not None}
            except (_NotLiteral, RecursionError):
                return None
            if len(arguments) != len(element.keywords):
                return None  # **kwargs
            calls.append((element.func.id, json.dumps(arguments, ensure_ascii=False)))
        return calls
