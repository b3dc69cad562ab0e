"""Tool calls in Qwen/Hermes format: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks.

`parse_tool_calls` splits a finished output into content and calls; `ToolCallStreamParser` does
the same on a stream: content deltas, and per call a start event (id, name) and its `arguments`
JSON text. A block that is not a valid call (bad JSON, no name) stays in the content as written,
and nothing here raises on model output.

Only complete calls are calls: a block closed by `</tool_call>`, or one the model itself ended
right after its JSON. A block the length limit cut off (`truncated`) is content, so a response
that carries tool calls always has finish_reason "tool_calls" and one cut short keeps "length".
A stream therefore sends each call once it is complete, never arguments that may yet be cut off.

Whitespace that only separates a call from the content around it ("Sure.\\n\\n<tool_call>...",
the newline between two calls) is layout, so it is dropped on that side of each valid call.
Feed only content here: reasoning is split off first (`reasoning.py`), so a `<tool_call>` written
while thinking is not a call.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

__all__ = [
    "TOOL_CALL_END",
    "TOOL_CALL_START",
    "ContentDelta",
    "StreamEvent",
    "ToolCall",
    "ToolCallArgumentsDelta",
    "ToolCallStart",
    "ToolCallStreamParser",
    "new_tool_call_id",
    "parse_tool_calls",
]

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"

# The start of a call in the layout models write: name first, then an object of arguments, whose
# text is then passed on exactly as the model wrote it.
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(?=\{)')
# Whitespace, the call object's own closing brace, whitespace: what follows the arguments.
_CALL_TAIL = re.compile(r"\s*\}?\s*\Z")


def new_tool_call_id() -> str:
    """An OpenAI-style call id: `call_` and 24 hex digits."""
    return "call_" + secrets.token_hex(12)


@dataclass
class ToolCall:
    """One parsed call; `arguments_json` is the arguments object as JSON text (as OpenAI sends it)."""

    id: str
    name: str
    arguments_json: str


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    """A new call: `index` counts calls in this output from 0 (OpenAI's `tool_calls[i].index`)."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArgumentsDelta:
    """The next piece of call `index`'s arguments JSON text."""

    index: int
    arguments: str


StreamEvent = ContentDelta | ToolCallStart | ToolCallArgumentsDelta


def _partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def _arguments_text(body: str, start: int) -> str:
    """The arguments text of a call body whose arguments begin at `start`: up to the closing brace."""
    rest = body[start:]
    tail = _CALL_TAIL.search(rest)
    return rest[: tail.start()] if tail else rest


def _decode_call(body: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of a call body, or None if it is not a valid call.

    In the usual layout the arguments text is kept exactly as the model wrote it, so it equals
    what the stream parser sent in pieces; otherwise it is re-serialized.
    """
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return None
    arguments: Any = call.get("arguments", {})
    if isinstance(arguments, str):
        # Some models double-encode the arguments as a JSON string.
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    head = _CALL_HEAD.match(body)
    if head is not None and json.loads(head.group(1)) == call["name"]:
        raw = _arguments_text(body, head.end())
        try:
            if json.loads(raw) == arguments:
                return call["name"], raw
        except ValueError:
            pass
    return call["name"], json.dumps(arguments, ensure_ascii=False)


def parse_tool_calls(text: str, truncated: bool = False) -> tuple[str, list[ToolCall]]:
    """Split a whole output into (content, calls). Malformed blocks stay in the content.

    A final block missing its `</tool_call>` (the model stopped right after the JSON) still
    counts if its JSON is a complete call, unless the length limit ended the output
    (`truncated`): then it was cut off and stays content.
    """
    pieces: list[str] = []
    calls: list[ToolCall] = []
    strip_next = False  # the previous piece ended with a valid call
    pos = 0
    # Every pass consumes at least one block opening, so at most len(text) passes.
    for _ in range(len(text) + 1):
        at = text.find(TOOL_CALL_START, pos)
        if at < 0:
            break
        body_start = at + len(TOOL_CALL_START)
        end = text.find(TOOL_CALL_END, body_start)
        if end < 0:
            # Unterminated: it can only be the last block; a partial closing tag is not JSON.
            body = text[body_start:]
            body = body[: len(body) - _partial_tag_len(body, TOOL_CALL_END)]
        else:
            body = text[body_start:end]
        after = len(text) if end < 0 else end + len(TOOL_CALL_END)
        decoded = None if end < 0 and truncated else _decode_call(body)
        if decoded is None:
            if end < 0:
                break
            # Not a call: the block is content, and the search goes on after it.
            piece = text[pos:after]
            pieces.append(piece.lstrip() if strip_next else piece)
            strip_next = False
        else:
            before = text[pos:at]
            pieces.append(before.strip() if strip_next else before.rstrip())
            calls.append(ToolCall(new_tool_call_id(), decoded[0], decoded[1]))
            strip_next = True
        pos = after
    rest = text[pos:]
    pieces.append(rest.lstrip() if strip_next else rest)
    return "".join(pieces), calls


class ToolCallStreamParser:
    """Incremental `parse_tool_calls`: feed content deltas, get content and tool-call events.

    Text that may be the start of `<tool_call>` (and whitespace before it) is held back until it
    is decided; a block is held until it closes and then sent as one call (start and arguments)
    or, if it is not a valid call, as the content it was. So the stream carries exactly the calls
    and content `parse_tool_calls` finds in the whole output.
    """

    def __init__(self) -> None:
        self._held = ""  # content not yet released, or the body of the open block
        self._in_call = False
        self._ws_before = ""  # whitespace dropped before the open block (restored if it is not a call)
        self._strip_next = False  # drop leading whitespace: the previous thing was a call
        self._calls = 0
        self._finished = False

    @property
    def in_call(self) -> bool:
        """A call has begun: its block is open, or the text held back ends in part of ``<tool_call>``."""
        return self._in_call or _partial_tag_len(self._held, TOOL_CALL_START) > 0

    @property
    def num_calls(self) -> int:
        """Calls sent so far."""
        return self._calls

    def feed(self, delta: str) -> list[StreamEvent]:
        """Add content text; return the events it decides."""
        if self._finished:
            raise RuntimeError("feed() after finish()")
        events: list[StreamEvent] = []
        text = self._held + delta
        self._held = ""
        # Each pass closes or opens a block (or ends), so at most len(text) + 1 passes.
        for _ in range(len(text) + 2):
            if self._in_call:
                text = self._feed_call(text, events)
            else:
                text = self._feed_content(text, events)
            if text is None:
                break
        return events

    def finish(self, truncated: bool = False) -> list[StreamEvent]:
        """The output ended: settle an unterminated block and release held text. ``truncated``: the
        length limit ended it, so an unterminated block was cut off and is content."""
        if self._finished:
            return []
        self._finished = True
        events: list[StreamEvent] = []
        held, self._held = self._held, ""
        if not self._in_call:
            # Held content is a partial tag and/or whitespace; after a call, leading whitespace goes.
            tail = held.lstrip() if self._strip_next else held
            if tail:
                events.append(ContentDelta(tail))
            return events
        body = held[: len(held) - _partial_tag_len(held, TOOL_CALL_END)]
        decoded = None if truncated else _decode_call(body)
        if decoded is not None:
            self._send_call(decoded, events)
        else:
            events.append(ContentDelta(self._ws_before + TOOL_CALL_START + held))
        return events

    # -- states ---------------------------------------------------------------------------------

    def _feed_content(self, text: str, events: list[StreamEvent]) -> str | None:
        """Content mode: release text up to a block opening; return the rest, or None when done."""
        if self._strip_next:
            stripped = text.lstrip()
            if not stripped:
                return None  # only whitespace after a call so far
            text, self._strip_next = stripped, False
        at = text.find(TOOL_CALL_START)
        if at >= 0:
            before = text[:at]
            release = before.rstrip()
            if release:
                events.append(ContentDelta(release))
            self._ws_before = before[len(release) :]
            self._in_call = True
            return text[at + len(TOOL_CALL_START) :]
        # Hold a possible partial opening tag, and whitespace before it that a call would drop.
        keep = len(text) - _partial_tag_len(text, TOOL_CALL_START)
        keep = len(text[:keep].rstrip())
        if keep:
            events.append(ContentDelta(text[:keep]))
        self._held = text[keep:]
        return None

    def _feed_call(self, body: str, events: list[StreamEvent]) -> str | None:
        """Inside a block: hold the body; return the text after `</tool_call>`, or None."""
        end = body.find(TOOL_CALL_END)
        if end < 0:
            self._held = body
            return None
        call_body, rest = body[:end], body[end + len(TOOL_CALL_END) :]
        self._in_call = False
        decoded = _decode_call(call_body)
        if decoded is None:
            # Not a call after all: the whole block is content, whitespace before it included.
            events.append(ContentDelta(self._ws_before + TOOL_CALL_START + call_body + TOOL_CALL_END))
            self._strip_next = False
        else:
            self._send_call(decoded, events)
            self._strip_next = True
        return rest

    def _send_call(self, decoded: tuple[str, str], events: list[StreamEvent]) -> None:
        index = self._calls
        self._calls += 1
        events.append(ToolCallStart(index, new_tool_call_id(), decoded[0]))
        events.append(ToolCallArgumentsDelta(index, decoded[1]))
