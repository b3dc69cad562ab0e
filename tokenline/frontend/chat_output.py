"""A chat choice's text, shaped the way the OpenAI API reports it: reasoning, content, tool calls.

Chains the reasoning parser (``<think>…</think>``) and the tool-call parser of the model's format
(``tool_parsers``: ``<tool_call>{…}</tool_call>``, Llama's JSON, Python calls) for one choice,
streaming or not. ``tool_choice`` "required" or a named function is enforced upstream, by a grammar
on the generated tokens (``tool_grammar.py``).
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
    """``tools``: parse tool calls, in this format (True: Hermes', the forced-call grammar's).
    ``max_calls``: report at most this many tool calls, the first ones (``parallel_tool_calls:
    false`` asks for one); later calls are dropped whole, as vLLM drops them."""

    def __init__(
        self, *, reasoning: bool, starts_in_reasoning: bool, tools: bool | ToolCallFormat,
        max_calls: int | None = None,
    ) -> None:
        self._reasoning = ReasoningParser(starts_in_reasoning) if reasoning else None
        self._starts_in_reasoning = starts_in_reasoning
        self._format = HERMES if tools is True else tools or None
        self._tools = self._format.stream() if self._format is not None else None
        self._max_calls = max_calls
        self.made_tool_calls = False

    def feed(self, delta: str) -> ChatPiece:
        return _merged(self.feed_in_order(delta))

    def finish(self, truncated: bool = False) -> ChatPiece:
        """The output ended; ``truncated``: by the length limit, so a call still open is content."""
        return _merged(self.finish_in_order(truncated))

    def feed_in_order(self, delta: str) -> list[ChatPiece]:
        """``feed`` as pieces in the order the model wrote them, each one kind of text or one call's
        pieces (the Responses API makes an output item of each, in that order)."""
        return self._shape(*self._split(delta))

    def finish_in_order(self, truncated: bool = False, drop_cut_call: bool = False) -> list[ChatPiece]:
        """``finish`` in order; ``drop_cut_call``: a call the length limit cut off is dropped instead
        of becoming content (its markup is not text of the answer; the cut shows in the status)."""
        reasoning, content = self._reasoning.finish() if self._reasoning is not None else ("", "")
        pieces = self._shape(reasoning, content)
        if self._tools is not None:
            cut = truncated and self._tools.in_call
            events = self._tools.finish(truncated)
            pieces += [] if cut and drop_cut_call else self._events(events)
        return pieces

    def parse_all(self, text: str, truncated: bool = False) -> ParsedChat:
        """The whole output at once (non-streaming responses); ``truncated`` as in ``finish``."""
        reasoning = None
        if self._reasoning is not None:
            reasoning, text = split_reasoning(text, starts_in_reasoning=self._starts_in_reasoning)
        calls: list[ToolCall] = []
        if self._format is not None:
            text, calls = self._format.parse(text, truncated)
            calls = calls[: self._max_calls]
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

    def _shape(self, reasoning: str, content: str) -> list[ChatPiece]:
        pieces = [ChatPiece(reasoning=reasoning)] if reasoning else []
        if self._tools is None:
            return pieces + ([ChatPiece(content=content)] if content else [])
        return pieces + (self._events(self._tools.feed(content)) if content else [])

    def _events(self, events: list[StreamEvent]) -> list[ChatPiece]:
        pieces: list[ChatPiece] = []
        for event in events:
            last = pieces[-1] if pieces else None
            if isinstance(event, ContentDelta):
                if last is not None and not last.tool_calls:
                    last.content += event.text
                else:
                    pieces.append(ChatPiece(content=event.text))
            elif self._max_calls is not None and event.index >= self._max_calls:
                continue  # a call beyond those asked for
            elif isinstance(event, ToolCallStart):
                self.made_tool_calls = True
                pieces.append(ChatPiece(tool_calls=[ToolCallPiece(event.index, event.id, event.name, "")]))
            elif isinstance(event, ToolCallArgumentsDelta):
                call = last.tool_calls[-1] if last is not None and last.tool_calls else None
                if call is not None and call.index == event.index:
                    call.arguments = (call.arguments or "") + event.arguments  # one delta per call
                else:
                    pieces.append(ChatPiece(tool_calls=[ToolCallPiece(event.index, arguments=event.arguments)]))
        return pieces


def _merged(pieces: list[ChatPiece]) -> ChatPiece:
    whole = ChatPiece()
    for piece in pieces:
        whole = whole.merged(piece)
    return whole
