"""Tool calls written at the start of an answer, in a bracketed literal: Llama 3's JSON objects
(``{"name": ..., "parameters": ...}``, several separated by ``;``) and the Python list of calls
(``[get_weather(city='SF'), f(x=1)]``). One streaming machine serves both; a format says where
its blocks open and how a closed block decodes into calls.

The answer is calls if it opens (after whitespace, and a format's own tag) with a block that
decodes into calls; text after the last call is content. A first block that is not a call (a
JSON answer, a list of numbers) makes the whole answer content, as written. A block closes with
its bracket, so a call is never sent before it is complete, and the stream carries exactly what
``parse`` finds in the whole output. Nothing here raises on model output.
"""

from __future__ import annotations

from tokenline.frontend.tool_calls import (
    ContentDelta,
    StreamEvent,
    ToolCall,
    ToolCallArgumentsDelta,
    ToolCallStart,
    new_tool_call_id,
)

__all__ = ["NEED_MORE", "BracketScanner", "LeadingCallsParser"]

NEED_MORE = -1  # a block position that the text so far cannot decide yet

_START, _BLOCK, _BETWEEN, _TEXT = "start", "block", "between", "text"
_OPEN, _CLOSE = "([{", ")]}"


class BracketScanner:
    """Finds where a literal that opens with a bracket at position 0 closes, in text that grows:
    each call resumes where the last one stopped, so a whole stream is scanned once. Brackets
    inside strings do not count; ``python``: strings may also use ``'`` and triple quotes."""

    def __init__(self, python: bool) -> None:
        self._quotes = "'\"" if python else '"'
        self._python = python
        self._pos = 0
        self._depth = 0
        self._quote = ""  # the open string's delimiter, "" outside strings

    def scan(self, text: str) -> int | None:
        """The index just past the closing bracket in ``text``, or None while it is still open."""
        i = self._pos
        while i < len(text):
            char = text[i]
            if self._quote:
                if char == "\\":
                    if i + 1 >= len(text):
                        break  # what it escapes has not arrived
                    i += 2
                    continue
                if text.startswith(self._quote, i):
                    i += len(self._quote)
                    self._quote = ""
                    continue
                if len(self._quote) == 3 and self._quote.startswith(text[i:]):
                    break  # a closing triple quote may be arriving
            elif char in self._quotes:
                triple = char * 3
                if self._python and triple.startswith(text[i : i + 3]) and i + 3 > len(text):
                    break  # '' or ''' : the next piece decides
                self._quote = triple if self._python and text.startswith(triple, i) else char
                i += len(self._quote)
                continue
            elif char in _OPEN:
                self._depth += 1
            elif char in _CLOSE:
                self._depth -= 1
                if self._depth == 0:
                    self._pos = i + 1
                    return i + 1
            i += 1
        self._pos = i
        return None


class LeadingCallsParser:
    """Feed content deltas, get content and tool-call events (the events of ``tool_calls.py``).

    A format subclass sets ``python_strings`` and implements ``_first_block_at`` (where the first
    block opens in the text held so far: an index, ``NEED_MORE``, or None when the answer is not
    calls), ``_next_block_at`` (the same after a call) and ``_decode`` (a closed block's calls as
    (name, arguments JSON) pairs, or None when it is not calls)."""

    python_strings = False

    def __init__(self) -> None:
        self._mode = _START
        self._held = ""  # text not yet decided (the open block included)
        self._lead = ""  # what came before the open block: content if the block is not a call
        self._scanner = BracketScanner(self.python_strings)
        self._calls = 0
        self._finished = False

    @classmethod
    def parse(cls, text: str, truncated: bool = False) -> tuple[str, list[ToolCall]]:
        """Split a whole output into (content, calls), by the stream's own rules."""
        parser = cls()
        content: list[str] = []
        calls: list[ToolCall] = []
        for event in parser.feed(text) + parser.finish(truncated):
            if isinstance(event, ContentDelta):
                content.append(event.text)
            elif isinstance(event, ToolCallStart):
                calls.append(ToolCall(event.id, event.name, ""))
            else:
                calls[event.index].arguments_json += event.arguments
        return "".join(content), calls

    @property
    def num_calls(self) -> int:
        """Calls sent so far."""
        return self._calls

    @property
    def in_call(self) -> bool:
        """Whether a block is open (a call that is not complete yet)."""
        return self._mode == _BLOCK

    def feed(self, delta: str) -> list[StreamEvent]:
        """Add content text; return the events it decides."""
        if self._finished:
            raise RuntimeError("feed() after finish()")
        events: list[StreamEvent] = []
        text, self._held = self._held + delta, ""
        # Each pass moves to another mode and consumes what it decides; a block pass ends one block.
        for _ in range(len(text) + 4):
            if self._mode == _TEXT:
                if text:
                    events.append(ContentDelta(text))
                break
            if self._mode == _BLOCK:
                end = self._scanner.scan(text)
                if end is None:
                    self._held = text
                    break
                text = self._close_block(text[:end], events) + text[end:]
                continue
            at = self._first_block_at(text) if self._mode == _START else self._next_block_at(text)
            if at == NEED_MORE:
                self._held = text
                break
            if at is None:
                # Not calls (from here on): after a call, the whitespace before the text is layout.
                text = text.lstrip() if self._mode == _BETWEEN else text
                self._mode = _TEXT
                continue
            self._lead, text = text[:at], text[at:]
            self._mode = _BLOCK
            self._scanner = BracketScanner(self.python_strings)
        return events

    def finish(self, truncated: bool = False) -> list[StreamEvent]:
        """The output ended: what is held is content (an open block is a cut-off call), except the
        whitespace after a call. ``truncated`` changes nothing: a closed block is a whole call."""
        if self._finished:
            return []
        self._finished = True
        held, self._held = self._held, ""
        if self._mode == _BLOCK:
            held = self._lead_text() + held
        elif self._mode == _BETWEEN:
            held = held.lstrip()
        return [ContentDelta(held)] if held else []

    def _lead_text(self) -> str:
        """The text before the open block, as content: as written before the first call, without
        the layout whitespace after a call."""
        return self._lead.lstrip() if self._calls else self._lead

    def _close_block(self, block: str, events: list[StreamEvent]) -> str:
        """Send a closed block's calls; return the text it turns out to be if it is not calls."""
        calls = self._decode(block)
        if calls is None:
            self._mode = _TEXT
            return self._lead_text() + block
        for name, arguments in calls:
            events.append(ToolCallStart(self._calls, new_tool_call_id(), name))
            events.append(ToolCallArgumentsDelta(self._calls, arguments))
            self._calls += 1
        self._mode = _BETWEEN
        return ""

    # -- the format -----------------------------------------------------------------------------

    def _first_block_at(self, text: str) -> int | None:
        raise NotImplementedError

    def _next_block_at(self, text: str) -> int | None:
        raise NotImplementedError

    def _decode(self, block: str) -> list[tuple[str, str]] | None:
        raise NotImplementedError
