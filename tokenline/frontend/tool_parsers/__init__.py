"""The tool-call formats a server can parse, by the names vLLM's ``--tool-call-parser`` uses.

Each format is a stream parser (feed content deltas, get content and call events; see
``tool_calls.py`` for the events) and a whole-output split that follows the same rules, so a
streamed answer carries the calls and content a non-streamed one reports. Forced calls
(``tool_choice`` required or named) are always written in the Hermes format, which the grammar
enforces (``tool_grammar.tool_call_grammar``), whatever format the model writes by itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from tokenline.frontend.tool_calls import StreamEvent, ToolCall, ToolCallStreamParser, parse_tool_calls
from tokenline.frontend.tool_parsers.llama3_json import Llama3JsonParser
from tokenline.frontend.tool_parsers.pythonic import PythonicParser

__all__ = ["HERMES", "TOOL_CALL_FORMATS", "ToolCallFormat", "ToolCallStream", "tool_call_format"]


class ToolCallStream(Protocol):
    num_calls: int

    def feed(self, delta: str) -> list[StreamEvent]: ...

    def finish(self, truncated: bool = False) -> list[StreamEvent]: ...


@dataclass(frozen=True)
class ToolCallFormat:
    """How a model family writes tool calls: ``stream()`` makes a parser for one answer, ``parse``
    splits a whole answer into (content, calls); ``truncated``: the length limit ended it."""

    name: str
    stream: Callable[[], ToolCallStream]
    parse: Callable[[str, bool], tuple[str, list[ToolCall]]]


# <tool_call>{"name": ..., "arguments": ...}</tool_call>: Hermes, Qwen 2.5/3, SmolLM's tool prompts.
HERMES = ToolCallFormat("hermes", ToolCallStreamParser, parse_tool_calls)

TOOL_CALL_FORMATS: dict[str, ToolCallFormat] = {
    "hermes": HERMES,
    "qwen3": HERMES,
    "llama3_json": ToolCallFormat("llama3_json", Llama3JsonParser, Llama3JsonParser.parse),
    "llama4_json": ToolCallFormat("llama3_json", Llama3JsonParser, Llama3JsonParser.parse),  # vLLM's alias
    "pythonic": ToolCallFormat("pythonic", PythonicParser, PythonicParser.parse),
}


def tool_call_format(name: str) -> ToolCallFormat:
    """The format a ``--tool-call-parser`` name stands for (``KeyError`` names the choices)."""
    try:
        return TOOL_CALL_FORMATS[name]
    except KeyError:
        raise KeyError(f"unknown tool-call parser {name!r}; choose one of {', '.join(TOOL_CALL_FORMATS)}") from None
