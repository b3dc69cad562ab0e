"""Streamed chunks as SSE events, built for the per-token path.

Every chunk of one stream shares its id, object, created and model, so ``ChunkFrame`` serializes
that envelope once and each event only adds its choices. The plainest choices (text or a chat
content delta, no logprobs, no token ids, no tool calls) are written from a template; any other
choice goes through its pydantic model. Both give the bytes ``chunk.model_dump_json()`` gives
(tests/api/test_sse.py compares them), at a fraction of the CPU the API process spends per token.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel

from tokenline.api.protocol import ChatCompletionChunk, ChatCompletionChunkChoice, CompletionChoice, CompletionChunk

_CHOICES = '"choices":[]'


def json_string(text: str) -> str:
    """``text`` as a JSON string, escaped as pydantic escapes it (UTF-8 kept, control characters
    as ``\\uXXXX`` or their short forms)."""
    return json.dumps(text, ensure_ascii=False)


def _json_optional(text: str | None) -> str:
    return "null" if text is None else json_string(text)


def choice_json(choice: BaseModel) -> str:
    """One chunk choice as JSON: a template for the plain shapes, the model's serializer otherwise."""
    if type(choice) is CompletionChoice:
        if choice.logprobs is None and choice.token_ids is None and choice.prompt_token_ids is None:
            return (f'{{"index":{choice.index},"text":{json_string(choice.text)},"logprobs":null,'
                    f'"finish_reason":{_json_optional(choice.finish_reason)}}}')
    elif type(choice) is ChatCompletionChunkChoice:
        delta = choice.delta
        if (choice.logprobs is None and delta.reasoning_content is None and delta.reasoning is None
                and delta.tool_calls is None):
            fields = []
            if delta.role is not None:
                fields.append(f'"role":{json_string(delta.role)}')
            if delta.content is not None:
                fields.append(f'"content":{json_string(delta.content)}')
            return (f'{{"index":{choice.index},"delta":{{{",".join(fields)}}},"logprobs":null,'
                    f'"finish_reason":{_json_optional(choice.finish_reason)}}}')
    return choice.model_dump_json()


class ChunkFrame:
    """One stream's chunk envelope, serialized once; ``event`` wraps choices into an SSE event."""

    def __init__(
        self, chunk_type: type[ChatCompletionChunk] | type[CompletionChunk], response_id: str, created: int,
        model: str, include_usage: bool,
    ) -> None:
        self._chunk_type = chunk_type
        self._fields: dict[str, Any] = {"id": response_id, "created": created, "model": model}
        self._include_usage = include_usage
        envelope = self._chunk([], None).model_dump_json()
        # A key's quotes are never escaped inside a JSON string, so this is the choices key itself.
        head, tail = envelope.split(_CHOICES, 1)
        self._head = f'data: {head}"choices":['
        self._tail = f"]{tail}\n\n"

    def _chunk(self, choices: list[Any], usage: BaseModel | None) -> ChatCompletionChunk | CompletionChunk:
        body = self._chunk_type(choices=choices, **self._fields)
        if self._include_usage:
            body.usage = usage  # OpenAI sends "usage": null on the chunks before the last
        return body

    def event(self, choices: list[Any], usage: BaseModel | None = None) -> str:
        """``data: {chunk}\\n\\n`` for these choices; a chunk carrying usage takes the model's path."""
        if usage is not None and self._include_usage:
            return f"data: {self._chunk(choices, usage).model_dump_json()}\n\n"
        return self._head + ",".join(map(choice_json, choices)) + self._tail
