"""Tool calls in Qwen/Hermes format: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks.

`parse_tool_calls` splits a finished output into content and calls; `ToolCallStreamParser` does
the same on a stream, the way OpenAI streams them: content deltas, then per call a start event
(id, name) and the `arguments` JSON text in pieces. A block that is not a valid call (bad JSON,
no name) stays in the content as written, and nothing here raises on model output.

Whitespace that only separates a call from the content around it ("Sure.\\n\\n<tool_call>...",
the newline between two calls) is layout, so it is dropped on that side of each valid call.
Feed only content here: reasoning is split off first (`reasoning.py`), so a `<tool_call>` written
while thinking is not a call.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping
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
    "tool_call_grammar",
]

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"

# The start of a call in the layout models write: name first, then an object of arguments. Once
# this much has arrived the call can be announced and its arguments streamed.
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(?=\{)')
# Whitespace, the call object's own closing brace, whitespace: what follows the arguments.
_CALL_TAIL = re.compile(r"\s*\}?\s*\Z")


def tool_call_grammar(
    tools: list[dict[str, Any]], tool_choice: str | dict[str, Any] | None, added_tokens: Mapping[str, int] | None = None
) -> str | None:
    """A Lark grammar (llguidance's dialect) that makes the model answer with tool calls in this
    format: ``"required"`` one or more calls to any of ``tools``, a named function exactly one call
    to it; ``auto``/``none`` no grammar. Each call's arguments follow its function's JSON schema
    (so a ``strict`` schema is honoured), with the name first as the stream parser expects.
    ``added_tokens``: ids of the markers where the vocabulary has them as single added tokens
    (Qwen's ``<tool_call>``), which a grammar must name by id, not spell out."""

    def call_schema(function: dict[str, Any]) -> dict[str, Any]:
        parameters = function.get("parameters") or {"type": "object"}
        return {
            "type": "object",
            "properties": {"name": {"const": function["name"]}, "arguments": parameters},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }

    functions = [t["function"] for t in tools]
    if isinstance(tool_choice, dict):
        wanted = tool_choice["function"]["name"]
        schema = call_schema(next(f for f in functions if f["name"] == wanted))
        repeat = ""
    elif tool_choice == "required":
        schema = {"anyOf": [call_schema(f) for f in functions]}
        repeat = ' ("\\n" call)*'
    else:
        return None
    # Compact JSON: free whitespace is where a weak model wanders off and never ends the call.
    schema["x-guidance"] = {"whitespace_flexible": False}

    def marker(text: str) -> str:
        token_id = (added_tokens or {}).get(text)
        return f"<[{token_id}]>" if token_id is not None else json.dumps(text)  # JSON strings are Lark strings

    start = f'{marker(TOOL_CALL_START)} "\\n"'
    end = f'"\\n" {marker(TOOL_CALL_END)}'
    return f"start: call{repeat}\ncall: {start} body {end}\nbody: %json {json.dumps(schema)}\n"


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


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """Split a whole output into (content, calls). Malformed blocks stay in the content.

    A final block missing its `</tool_call>` (the model stopped right after the JSON) still
    counts if its JSON is a complete call, as in streaming.
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
        decoded = _decode_call(body)
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
    is decided. A call in the usual layout is announced as soon as its name is known and its
    arguments then stream as they arrive; other layouts are buffered to `</tool_call>` and parsed
    whole. A call already announced cannot be taken back, so if its JSON later proves broken the
    client gets the broken arguments (`parse_tool_calls` would leave that block as content).
    """

    def __init__(self) -> None:
        self._held = ""  # content not yet released, or the body of the open block
        self._in_call = False
        self._ws_before = ""  # whitespace dropped before the open block (restored if it is not a call)
        self._strip_next = False  # drop leading whitespace: the previous thing was a call
        self._index = -1  # index of the open call once announced, else -1
        self._args_start = 0  # where the announced call's arguments begin in the body
        self._args_sent = 0  # characters of those arguments already sent
        self._calls = 0
        self._finished = False

    @property
    def num_calls(self) -> int:
        """Calls announced so far."""
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

    def finish(self) -> list[StreamEvent]:
        """The output ended: settle an unterminated block and release held text."""
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
        if self._index >= 0:
            # Announced: send the rest of the arguments (the model stopped after the JSON).
            self._send_arguments(body, final=True, events=events)
            return events
        decoded = _decode_call(body)
        if decoded is not None:
            self._announce(decoded[0], events)
            events.append(ToolCallArgumentsDelta(self._index, decoded[1]))
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
            self._index = -1
            return text[at + len(TOOL_CALL_START) :]
        # Hold a possible partial opening tag, and whitespace before it that a call would drop.
        keep = len(text) - _partial_tag_len(text, TOOL_CALL_START)
        keep = len(text[:keep].rstrip())
        if keep:
            events.append(ContentDelta(text[:keep]))
        self._held = text[keep:]
        return None

    def _feed_call(self, body: str, events: list[StreamEvent]) -> str | None:
        """Inside a block: stream or buffer the body; return the text after `</tool_call>`, or None."""
        end = body.find(TOOL_CALL_END)
        if end < 0:
            self._held = body
            if self._index < 0:
                head = _CALL_HEAD.match(body)
                if head is not None:
                    self._announce(json.loads(head.group(1)), events)
                    self._args_start = head.end()
                    self._args_sent = 0
            if self._index >= 0:
                visible = body[: len(body) - _partial_tag_len(body, TOOL_CALL_END)]
                self._send_arguments(visible, final=False, events=events)
            return None
        call_body, rest = body[:end], body[end + len(TOOL_CALL_END) :]
        self._in_call = False
        if self._index >= 0:
            self._send_arguments(call_body, final=True, events=events)
            self._strip_next = True
            return rest
        decoded = _decode_call(call_body)
        if decoded is None:
            # Not a call after all: the whole block is content, whitespace before it included.
            events.append(ContentDelta(self._ws_before + TOOL_CALL_START + call_body + TOOL_CALL_END))
            self._strip_next = False
        else:
            self._announce(decoded[0], events)
            events.append(ToolCallArgumentsDelta(self._index, decoded[1]))
            self._strip_next = True
        return rest

    def _announce(self, name: str, events: list[StreamEvent]) -> None:
        self._index = self._calls
        self._calls += 1
        events.append(ToolCallStart(self._index, new_tool_call_id(), name))

    def _send_arguments(self, body: str, final: bool, events: list[StreamEvent]) -> None:
        """Send the announced call's arguments known so far from `body`.

        The arguments end where the call object closes, so a trailing `}` (with whitespace) is
        held until more text shows whether it was the arguments' own or the call's.
        """
        text = _arguments_text(body, self._args_start)
        if len(text) > self._args_sent:
            events.append(ToolCallArgumentsDelta(self._index, text[self._args_sent :]))
            self._args_sent = len(text)
        if final:
            self._index = -1
