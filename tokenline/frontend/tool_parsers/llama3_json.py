"""Llama 3.x JSON tool calls (vLLM's ``--tool-call-parser llama3_json``): the answer is
``{"name": "get_weather", "parameters": {"city": "SF"}}``, maybe after ``<|python_tag|>``, several
separated by ``;``. ``arguments`` is accepted for ``parameters`` (the prompt decides which the
model writes); arguments double-encoded as a JSON string are decoded. See ``leading_calls.py``
for what is a call and what is content."""

from __future__ import annotations

import json
from typing import Any

from tokenline.frontend.tool_parsers.leading_calls import NEED_MORE, LeadingCallsParser

__all__ = ["PYTHON_TAG", "Llama3JsonParser"]

# Llama 3's "code/tool call follows" token; a special token, so often already gone from the text.
PYTHON_TAG = "<|python_tag|>"


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # NaN and Infinity: Python's json accepts them, clients do not


def _block_at(text: str, tag: bool) -> int | None:
    """Where a ``{`` opens after whitespace (and, with ``tag``, an optional python tag)."""
    rest = text.lstrip()
    if tag and rest.startswith(PYTHON_TAG):
        rest = rest[len(PYTHON_TAG) :].lstrip()
    elif tag and PYTHON_TAG.startswith(rest):
        return NEED_MORE  # empty, or a tag in the making
    if not rest:
        return NEED_MORE
    return len(text) - len(rest) if rest[0] == "{" else None


class Llama3JsonParser(LeadingCallsParser):
    def _first_block_at(self, text: str) -> int | None:
        return _block_at(text, tag=True)

    def _next_block_at(self, text: str) -> int | None:
        rest = text.lstrip()
        if rest.startswith(";"):
            at = _block_at(rest[1:], tag=False)
            return at if at is None or at == NEED_MORE else len(text) - len(rest) + 1 + at
        return _block_at(text, tag=False) if rest else NEED_MORE

    def _decode(self, block: str) -> list[tuple[str, str]] | None:
        try:
            call = json.loads(block, parse_constant=_no_constant)
        except (ValueError, RecursionError):
            return None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
            return None
        if ("parameters" in call) == ("arguments" in call):
            return None  # neither (any JSON object with a name) or both (ambiguous)
        arguments = call.get("parameters", call.get("arguments"))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments, parse_constant=_no_constant)
            except (ValueError, RecursionError):
                return None
        if not isinstance(arguments, dict):
            return None
        return [(call["name"], json.dumps(arguments, ensure_ascii=False))]
