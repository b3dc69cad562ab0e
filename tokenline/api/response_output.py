"""A chat answer shaped as Responses API output: items, the stream events that build them, usage.

``OutputBuilder`` takes a choice's text as the chat parsers split it (``ChatPiece``: reasoning,
content, tool-call pieces) and keeps the output items — a ``reasoning`` item, a ``message`` with
one ``output_text`` part, ``function_call`` items — in the order the model wrote them. Each call
returns the stream events that happened (``response.output_item.added``, ``…delta``, ``…done``);
a non-streaming response feeds the whole answer at once and ignores them, so both paths build
the very same items.
"""

from __future__ import annotations

import copy
import uuid
from typing import Any

from tokenline.frontend.chat_output import ChatPiece

__all__ = ["OutputBuilder", "response_usage", "new_id"]

Event = dict[str, Any]


def new_id(prefix: str) -> str:
    """An OpenAI-style id: ``resp_…``, ``msg_…``, ``rs_…``, ``fc_…``."""
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputBuilder:
    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the item still being written
        self._has_message = False
        self._has_calls = False

    def feed(self, piece: ChatPiece) -> list[Event]:
        events: list[Event] = []
        if piece.reasoning:
            events += self._text(piece.reasoning, "reasoning")
        if piece.content:
            events += self._text(piece.content, "message")
        for call in piece.tool_calls:
            if call.id is not None:  # a new call: its id and name come first
                events += self._close("completed")
                item = {"id": new_id("fc"), "type": "function_call", "status": "in_progress",
                        "call_id": call.id, "name": call.name or "", "arguments": ""}
                events += self._add(item)
                self._has_calls = True
            if call.arguments and self._open is not None and self._open["type"] == "function_call":
                self._open["arguments"] += call.arguments
                events.append(self._event("response.function_call_arguments.delta", delta=call.arguments))
        return events

    def finish(self, status: str) -> list[Event]:
        """Close what is open with ``status`` ("completed" or "incomplete"); a function call is
        always complete (only whole calls are fed). An answer with no text and no call still has
        its (empty) message, as OpenAI's does."""
        open_call = self._open is not None and self._open["type"] == "function_call"
        events = self._close("completed" if open_call else status)
        if not self._has_message and not self._has_calls:
            events += self._open_text("message") + self._close(status)
        return events

    @property
    def text(self) -> str:
        """The message's text (what the SDK's ``output_text`` gives)."""
        return "".join(p["text"] for item in self.items if item["type"] == "message" for p in item["content"])

    # --- items ---------------------------------------------------------------------------------

    def _text(self, text: str, kind: str) -> list[Event]:
        events: list[Event] = []
        if self._open is None or self._open["type"] != kind:
            events += self._close("completed") + self._open_text(kind)
        assert self._open is not None
        self._open["content"][0]["text"] += text
        delta = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra = {"logprobs": []} if kind == "message" else {}
        events.append(self._event(delta, content_index=0, delta=text, **extra))
        return events

    def _open_text(self, kind: str) -> list[Event]:
        if kind == "message":
            item = {"id": new_id("msg"), "type": "message", "status": "in_progress", "role": "assistant", "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            self._has_message = True
        else:
            item = {"id": new_id("rs"), "type": "reasoning", "status": "in_progress", "summary": [], "content": []}
            part = {"type": "reasoning_text", "text": ""}
        events = self._add(item)
        item["content"].append(part)
        events.append(self._event("response.content_part.added", content_index=0, part=copy.deepcopy(part)))
        return events

    def _add(self, item: dict[str, Any]) -> list[Event]:
        self._open = item
        self.items.append(item)
        return [{"type": "response.output_item.added", "output_index": len(self.items) - 1,
                 "item": copy.deepcopy(item)}]

    def _close(self, status: str) -> list[Event]:
        item = self._open
        if item is None:
            return []
        events: list[Event] = []
        if item["type"] == "function_call":
            events.append(self._event("response.function_call_arguments.done", arguments=item["arguments"]))
        else:
            part = item["content"][0]
            if item["type"] == "message":
                events.append(self._event("response.output_text.done", content_index=0, text=part["text"], logprobs=[]))
            else:
                events.append(self._event("response.reasoning_text.done", content_index=0, text=part["text"]))
            events.append(self._event("response.content_part.done", content_index=0, part=copy.deepcopy(part)))
        item["status"] = status
        events.append({"type": "response.output_item.done", "output_index": len(self.items) - 1,
                       "item": copy.deepcopy(item)})
        self._open = None
        return events

    def _event(self, kind: str, **fields: Any) -> Event:
        """An event about the open item (it is always the last one)."""
        assert self._open is not None
        return {"type": kind, "item_id": self._open["id"], "output_index": len(self.items) - 1, **fields}


def response_usage(input_tokens: int, cached_tokens: int, output_tokens: int, reasoning_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": input_tokens + output_tokens,
    }
