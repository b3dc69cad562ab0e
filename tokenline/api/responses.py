"""The Responses API (``POST /v1/responses``, ``GET`` / ``DELETE /v1/responses/{id}``) over the chat path.

A Responses request becomes a chat request (``responses_protocol.py``) and runs through
``ChatServing.start_chat``: the same template, reasoning and tool-call parsers, tool grammar,
gateway (keys, limits, ledger, metrics, trace, receipt) and engine client as chat completions.
Only the answer's shape differs: output items built by ``OutputBuilder``, streamed as the
Responses event types. With ``store`` (the default, as on OpenAI) the response and its
conversation are kept in the ledger's database, so ``previous_response_id`` can continue it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tokenline.api.chat_serving import ChatServing
from tokenline.api.response_output import Event, OutputBuilder, new_id, response_usage
from tokenline.api.responses_protocol import ResponsesRequest
from tokenline.api.serving import _Generation, _sse, _until_disconnect
from tokenline.frontend.chat_output import ChatPiece
from tokenline.frontend.reasoning import THINK_END
from tokenline.frontend.request_state import SequenceState
from tokenline.gateway.errors import APIError, shorten
from tokenline.gateway.gateway import RequestContext
from tokenline.gateway.response_store import ResponseStore, StoredResponse

__all__ = ["ResponsesServing"]


@dataclass
class _Run:
    """One Responses request in flight."""

    request: ResponsesRequest
    gen: _Generation
    conversation: list[dict[str, Any]]  # earlier turns and this request's input, as items
    builder: OutputBuilder = field(default_factory=OutputBuilder)
    param_names: dict[str, str] = field(default_factory=dict)  # engine-side names -> the request's
    parser_finished: bool = False
    sequence_number: int = 0

    def renamed(self, exc: APIError) -> APIError:
        """An error from below (the engine names SamplingParams' fields) in the request's terms."""
        if exc.param is not None:
            exc.param = self.param_names.get(exc.param, exc.param)
        return exc

    @property
    def seq(self) -> SequenceState:
        return self.gen.state.in_order()[0]  # a Responses request has one choice


class ResponsesServing:
    def __init__(self, chat: ChatServing, store: ResponseStore | None) -> None:
        self.chat = chat
        self.store = store

    async def create(self, request: ResponsesRequest, raw: Request, ctx: RequestContext) -> Response:
        request.check()
        history: list[dict[str, Any]] = []
        if request.previous_response_id is not None:
            previous = await self._load(request.previous_response_id, ctx.tenant_name)
            if previous is None:
                raise APIError.not_found(
                    f"Previous response with id '{shorten(request.previous_response_id)}' not found.",
                    param="previous_response_id",
                    code="previous_response_not_found",
                )
            history = previous.continued()
        conversation = [*history, *request.input_items()]
        chat = request.to_chat(conversation)
        try:
            self.chat.gateway.check_limits(len(chat.messages), request.max_output_tokens, "max_output_tokens")
        except APIError as exc:
            exc.param = "input" if exc.param == "messages" else exc.param  # the conversation's items
            raise
        gen = await self.chat.start_chat(chat, ctx, response_id=new_id("resp"))
        run = _Run(request, gen, conversation, param_names=chat.param_names)
        if request.stream:
            return _sse(self._stream(run))
        return await _until_disconnect(self._full(run), raw)

    async def retrieve(self, response_id: str, tenant: str) -> dict[str, Any]:
        stored = await self._load(response_id, tenant)
        if stored is None:
            raise APIError.not_found(f"Response with id '{shorten(response_id)}' not found.", param="response_id")
        return stored.response

    async def delete(self, response_id: str, tenant: str) -> dict[str, Any]:
        deleted = self.store is not None and await asyncio.to_thread(self.store.delete, response_id, tenant)
        if not deleted:
            raise APIError.not_found(f"Response with id '{shorten(response_id)}' not found.", param="response_id")
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    async def _load(self, response_id: str, tenant: str) -> StoredResponse | None:
        if self.store is None:
            return None
        return await asyncio.to_thread(self.store.get, response_id, tenant)

    # --- answers -------------------------------------------------------------------------------

    async def _full(self, run: _Run) -> Response:
        try:
            async for _ in self.chat._updates(run.gen):
                pass
        except APIError as exc:
            raise run.renamed(exc) from exc.__cause__
        seq = run.seq
        # The whole text through the stream's parsers: the very items a stream would build, in order.
        for piece in self._pieces(run, seq, seq.stream.text):
            run.builder.feed(piece)
        status, _ = _status(seq)
        run.builder.finish(status)
        response = self._response(run)
        await self._save(run, response)
        return JSONResponse(response)

    async def _stream(self, run: _Run) -> AsyncIterator[str]:
        yield self._sse(run, {"type": "response.created", "response": self._response(run, "in_progress")})
        yield self._sse(run, {"type": "response.in_progress", "response": self._response(run, "in_progress")})
        try:
            async for updates in self.chat._updates(run.gen):
                for update in updates:
                    for piece in self._pieces(run, update.seq, update.text):
                        for event in run.builder.feed(piece):
                            yield self._sse(run, event)
            status, _ = _status(run.seq)
            events = run.builder.finish(status)
            response = self._response(run)
            await self._save(run, response)  # before the client hears of it: a follow-up may come at once
            for event in events:
                yield self._sse(run, event)
            yield self._sse(run, {"type": f"response.{status}", "response": response})
        except APIError as exc:
            run.renamed(exc)
            yield self._sse(run, {"type": "error", "code": exc.code, "message": exc.message, "param": exc.param})
            failed = self._response(run, "failed")
            failed["error"] = {"code": exc.code or exc.type, "message": exc.message}
            yield self._sse(run, {"type": "response.failed", "response": failed})

    def _pieces(self, run: _Run, seq: SequenceState, text: str) -> list[ChatPiece]:
        """New text split by the chat parsers, in the order written; at the end, what they held
        back. Only complete calls become items: a call the length limit cut off is dropped, not
        shown as its markup (the response is "incomplete" for it)."""
        parser = seq.chat_output
        if parser is None:
            return [ChatPiece(content=text)] if text else []
        pieces = parser.feed_in_order(text) if text else []
        if seq.finished and not run.parser_finished:
            run.parser_finished = True
            pieces += parser.finish_in_order(truncated=seq.finish_reason == "length", drop_cut_call=True)
        return pieces

    def _sse(self, run: _Run, event: Event) -> str:
        event["sequence_number"] = run.sequence_number
        run.sequence_number += 1
        data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
        return f"event: {event['type']}\ndata: {data}\n\n"

    async def _save(self, run: _Run, response: dict[str, Any]) -> None:
        if not run.request.store or self.store is None:
            return
        stored = StoredResponse(
            id=response["id"], tenant=run.gen.ctx.tenant_name, response=response, conversation=run.conversation,
            previous_response_id=run.request.previous_response_id,
        )
        await asyncio.to_thread(self.store.put, stored)

    # --- the response object -------------------------------------------------------------------

    def _response(self, run: _Run, status: str | None = None) -> dict[str, Any]:
        """The response object: ``status`` "in_progress" / "failed" while or when it did not
        finish (no output, no usage yet), else as the answer ended."""
        request, gen = run.request, run.gen
        output: list[dict[str, Any]] = []
        usage = None
        incomplete = None
        if status is None:
            status, reason = _status(run.seq)
            incomplete = {"reason": reason} if reason else None
            output = run.builder.items
            used = gen.state.usage()
            reasoning = any(item["type"] == "reasoning" for item in output)
            usage = response_usage(
                used.prompt_tokens, used.cached_tokens, used.completion_tokens,
                self._reasoning_tokens(run.seq) if reasoning else 0,
            )
        return {
            "id": gen.response_id,
            "object": "response",
            "created_at": gen.created,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens,
            "max_tool_calls": None,
            "model": self.chat.served_model_name,
            "output": output,
            "parallel_tool_calls": request.parallel_tool_calls is not False,
            "previous_response_id": request.previous_response_id,
            "reasoning": {"effort": request.effort, "summary": request.reasoning.summary if request.reasoning else None},
            "service_tier": "default",
            "store": request.store,
            # The values the engine ran with (a model's generation config fills what was not sent).
            "temperature": gen.params.temperature,
            "text": {"format": request.text.format if request.text and request.text.format else {"type": "text"}},
            "tool_choice": request.tool_choice if request.tool_choice is not None else "auto",
            "tools": request.tools or [],
            "top_p": gen.params.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": request.user,
            "metadata": request.metadata or {},
        }

    def _reasoning_tokens(self, seq: SequenceState) -> int:
        """Generated tokens up to and including ``</think>`` (all of them if it never came)."""
        end = self.chat.tokenizer.token_to_id(THINK_END)
        ids = seq.token_ids
        return ids.index(end) + 1 if end is not None and end in ids else len(ids)


def _status(seq: SequenceState) -> tuple[str, str | None]:
    """"completed", or "incomplete" with OpenAI's reason when the token budget ran out."""
    if seq.finish_reason == "length":
        return "incomplete", "max_output_tokens"
    if seq.finish_reason == "content_filter":  # an output safety filter cut the text (OpenAI's reason)
        return "incomplete", "content_filter"
    return "completed", None
