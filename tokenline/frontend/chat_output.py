"""A chat choice's text, shaped the way the OpenAI API reports it: reasoning, content, tool calls.

Chains the reasoning parser (``<think>…</think>``) and the tool-call parser of the model's format
(``tool_parsers``: ``<tool_call>{…}</tool_call>``, Llama's JSON, Python calls) for one choice,
streaming or not. ``tool_choice`` "required" or a
named function is enforced upstream, by a grammar on the generated tokens (``tool_call_grammar``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenline.frontend.reasoning import ReasoningParser, split_reasoning
from tokenline.frontend.tool_calls import (
    ContentDelta,
    StreamEvent,
    ToolCall,
    ToolCallArgumentsDelta,
    ToolCallStart,
)
from tokenline.frontend.tool_parsers import HERMES, ToolCallFormat


@dataclass
class ToolCallPiece:
    index: int
    id: str | None = None  # set on a call's first piece, with its name
    name: str | None = None
    arguments: str | None = None


@dataclass
class ChatPiece:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallPiece] = field(default_factory=list)

    def merged(self, other: ChatPiece) -> ChatPiece:
        return ChatPiece(self.reasoning + other.reasoning, self.content + other.content, self.tool_calls + other.tool_calls)


@dataclass
class ParsedChat:
    reasoning: str | None
    content: str
    tool_calls: list[ToolCall]


class ChatOutputParser:
    """``tools``: parse tool calls, in this format (True: Hermes', the forced-call grammar's)."""

    def __init__(self, *, reasoning: bool, starts_in_reasoning: bool, tools: bool | ToolCallFormat) -> None:
        self._reasoning = ReasoningParser(starts_in_reasoning) if reasoning else None
        self._starts_in_reasoning = starts_in_reasoning
        self._format = HERMES if tools is True else tools or None
        self._tools = self._format.stream() if self._format is not None else None
        self.made_tool_calls = False

    def feed(self, delta: str) -> ChatPiece:
        return self._shape(*self._split(delta))

    def finish(self, truncated: bool = False) -> ChatPiece:
        """The output ended; ``truncated``: by the length limit, so a call still open is content."""
        reasoning, content = self._reasoning.finish() if self._reasoning is not None else ("", "")
        piece = self._shape(reasoning, content)
        if self._tools is not None:
            piece = piece.merged(self._events(self._tools.finish(truncated)))
        return piece

    def parse_all(self, text: str, truncated: bool = False) -> ParsedChat:
        """The whole output at once (non-streaming responses); ``truncated`` as in ``finish``."""
        reasoning = None
        if self._reasoning is not None:
            reasoning, text = split_reasoning(text, starts_in_reasoning=self._starts_in_reasoning)
        calls: list[ToolCall] = []
        if self._format is not None:
            text, calls = self._format.parse(text, truncated)
        self.made_tool_calls = bool(calls)
        return ParsedChat(reasoning, text, calls)

    def finish_reason(self, reason: str | None) -> str | None:
        """The choice's finish_reason as reported: "tool_calls" whenever it carries calls (all of
        them complete: a call the length limit cut off was left as content)."""
        if self.made_tool_calls and reason in ("stop", "length"):
            return "tool_calls"
        return reason

    def _split(self, text: str) -> tuple[str, str]:
        if self._reasoning is None:
            return "", text
        return self._reasoning.feed(text)

    def _shape(self, reasoning: str, content: str) -> ChatPiece:
        if self._tools is None or not content:
            return ChatPiece(reasoning, content)
        piece = self._events(self._tools.feed(content))
        piece.reasoning = reasoning
        return piece

    def _events(self, events: list[StreamEvent]) -> ChatPiece:
        piece = ChatPiece()
        for event in events:
            if isinstance(event, ContentDelta):
                piece.content += event.text
            elif isinstance(event, ToolCallStart):
                self.made_tool_calls = True
                piece.tool_calls.append(ToolCallPiece(event.index, event.id, event.name, ""))
            elif isinstance(event, ToolCallArgumentsDelta):
                last = piece.tool_calls[-1] if piece.tool_calls else None
                if last is not None and last.index == event.index:
                    last.arguments = (last.arguments or "") + event.arguments  # one delta per call
                else:
                    piece.tool_calls.append(ToolCallPiece(event.index, arguments=event.arguments))
        return piece
