"""Chat and text completions forwarded as TEXT to ``kind=openai`` upstreams (a hosted API).

The gateway's lifecycle is the same as for a local engine — keys and model access (the door and
``Gateway.open``), ``reserve`` before any upstream call, ``journal``, TTFT/ITL measured here as
chunks arrive, ``settle`` with the ledger row — but the text work is the upstream's: the body goes
out as the caller sent it (``model`` rewritten, ``stream_options.include_usage`` forced on so the
upstream reports usage), and each SSE chunk comes back at once with ``model`` and ``id`` rewritten.
The reservation counts the prompt with the local tokenizer when the router has ``--model``, else
bytes/4; the settlement uses the upstream's reported usage. Fields tokenline itself cannot honour
are the upstream's to judge (only the schema is checked here); input filters run, output filters
do not (the text is the upstream's, passed through unbuffered). A caller that hangs up closes the
upstream stream and is billed what the upstream reported, or the content chunks counted so far.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tokenline.api.chat_serving import _message_texts
from tokenline.api.protocol import ChatCompletionRequest, CompletionRequest, random_id
from tokenline.api.serving import _sse, _sse_event, _until_disconnect
from tokenline.gateway.errors import APIError
from tokenline.gateway.gateway import Gateway, Receipt, RequestContext, SequenceReceipt
from tokenline.gateway.ledger import ABORT_REASONS
from tokenline.router.fleet import FleetClient
from tokenline.router.passthrough import UpstreamCall, close_call, open_upstream
from tokenline.router.policy import RouteRequest
from tokenline.router.upstream_stream import UpstreamError, sse_payload

PromptCounter = Callable[[ChatCompletionRequest | CompletionRequest], Awaitable[int]]


def estimate_tokens(text: str) -> int:
    """A tokenizer-free prompt estimate: UTF-8 bytes / 4 (what a hosted API's tokens average)."""
    return max(1, len(text.encode()) // 4)


@dataclass
class _Forwarded:
    """One caller request in flight at an upstream."""

    ctx: RequestContext
    call: UpstreamCall
    response_id: str
    prompt_estimate: int
    usage: dict[str, Any] | None = None  # the upstream's, once reported
    chunks: int = 0  # content chunks seen: the completion count when no usage came
    last_at: float | None = None
    finish_reason: str | None = None
    closed: bool = field(default=False)


class PassthroughServing:
    """``count_prompt``: the local tokenizer's count (router with ``--model``); None: bytes/4."""

    def __init__(self, fleet: FleetClient, gateway: Gateway, served_model_name: str,
                 check_model: Callable[[str | None], None], count_prompt: PromptCounter | None = None,
                 request_timeout: float | None = None) -> None:
        self.fleet = fleet
        self.request_timeout = request_timeout
        self.gateway = gateway
        self.served_model_name = served_model_name
        self.check_model = check_model
        self.count_prompt = count_prompt
        self._background: set[asyncio.Task[None]] = set()

    async def chat(self, request: ChatCompletionRequest, raw: Request, ctx: RequestContext) -> Response:
        texts = _message_texts(request.template_messages())
        return await self._forward("/v1/chat/completions", "chatcmpl", request, texts, raw, ctx)

    async def completion(self, request: CompletionRequest, raw: Request, ctx: RequestContext) -> Response:
        texts = [p if isinstance(p, str) else " ".join(map(str, p)) for p in request.prompts()]
        return await self._forward("/v1/completions", "cmpl", request, texts, raw, ctx)

    async def _forward(self, path: str, prefix: str, request: ChatCompletionRequest | CompletionRequest,
                       texts: list[str], raw: Request, ctx: RequestContext) -> Response:
        text = "\n".join(texts)  # the routing key, and the estimate's input
        self.check_model(request.model)
        if not self.fleet.available():
            raise APIError.unavailable("no upstream is available; retry shortly", retry_after_s=2.0)
        body: dict[str, Any] = await raw.json()
        await self.gateway.screen_input(ctx, texts, request.param_names.get("prompt", "prompt"))
        prompt = await self.count_prompt(request) if self.count_prompt is not None else estimate_tokens(text)
        n = body.get("n") if isinstance(body.get("n"), int) else 1
        await self.gateway.reserve(ctx, prompt, (request.requested_max_tokens or 0) * n)
        response_id = random_id(prefix)
        ctx.name_response(response_id, [response_id])
        stream = bool(body.get("stream"))
        options = body.get("stream_options") if isinstance(body.get("stream_options"), dict) else {}
        want_usage = bool(options.get("include_usage"))
        if stream:  # the upstream must report usage: it is what the ledger bills
            body["stream_options"] = {**options, "include_usage": True}
        try:
            call = await open_upstream(self.fleet, path, body, RouteRequest(response_id, text=text, session=request.user))
        except UpstreamError as exc:
            await self.gateway.release(ctx)
            raise APIError(exc.status, exc.message, "server_error", code="upstream_unavailable") from exc
        if call.response.status_code >= 400:  # the request's own fault: the upstream's answer as it is
            status, content = call.response.status_code, await call.response.aread()
            await close_call(call)
            await self.gateway.release(ctx)
            error = UpstreamError.from_body(status, content)
            try:
                shaped = json.loads(content)
            except ValueError:
                shaped = None
            if not (isinstance(shaped, dict) and isinstance(shaped.get("error"), dict)):
                shaped = APIError(status, error.message, param=error.param).to_dict()
            return JSONResponse(shaped, status_code=status)
        self.gateway.journal(ctx, self.served_model_name, prompt)
        self.gateway.queued(ctx)
        forwarded = _Forwarded(ctx, call, response_id, prompt)
        if stream:
            return _sse(self._stream(forwarded, want_usage))
        return await _until_disconnect(self._full(forwarded), raw)

    async def _full(self, fw: _Forwarded) -> Response:
        status = "failed"
        try:
            async with asyncio.timeout(self.request_timeout):
                data = json.loads(await fw.call.response.aread())
            self.gateway.first_token(fw.ctx, time.monotonic())
            data.update(model=self.served_model_name, id=fw.response_id)
            fw.usage = data.get("usage") if isinstance(data.get("usage"), dict) else None
            fw.finish_reason = next((c.get("finish_reason") for c in data.get("choices") or () if c.get("finish_reason")),
                                    None)
            status = "finished"
        except (asyncio.CancelledError, GeneratorExit):
            status = "cancelled"
            raise
        except TimeoutError as exc:
            status = "timed_out"
            raise APIError.timeout(f"the request did not finish within {self.request_timeout:g} s") from exc
        except (httpx.HTTPError, ValueError) as exc:
            raise APIError(502, f"upstream {fw.call.upstream} broke off: {exc!r}", "server_error") from exc
        finally:
            self._end(fw, status)
        await self._settle(fw, status)
        return JSONResponse(data)

    async def _stream(self, fw: _Forwarded, want_usage: bool) -> AsyncIterator[str]:
        status, payload = "failed", None
        try:
            try:
                async with asyncio.timeout(self.request_timeout):
                    async for line in fw.call.response.aiter_lines():
                        payload = sse_payload(line)
                        if not payload:
                            continue
                        if payload == "[DONE]":
                            break
                        chunk = json.loads(payload)
                        if "error" in chunk:  # the upstream's error event: passed on, the request failed
                            yield _sse_event(chunk)
                            break
                        out = self._observe(fw, chunk, want_usage)
                        if out is not None:
                            yield out
                    else:
                        status = "finished"  # the stream ended without [DONE]: what came is what there is
                    if payload == "[DONE]":
                        status = "finished"
            except TimeoutError:
                status = "timed_out"
                yield _sse_event(APIError.timeout(f"the request did not finish within {self.request_timeout:g} s")
                                 .to_dict())
            except (httpx.HTTPError, ValueError) as exc:
                yield _sse_event(APIError(502, f"upstream {fw.call.upstream} broke off: {exc!r}",
                                          "server_error").to_dict())
        except (asyncio.CancelledError, GeneratorExit):
            status = "cancelled"  # the caller hung up
            raise
        finally:
            self._end(fw, status)  # settles in the background unless finished
        if status == "finished":
            await self._settle(fw, status)
        yield "data: [DONE]\n\n"

    def _observe(self, fw: _Forwarded, chunk: dict[str, Any], want_usage: bool) -> str | None:
        """Measure one upstream chunk (TTFT, ITL, usage) and return it rewritten, or None to drop it."""
        chunk.update(model=self.served_model_name, id=fw.response_id)
        choices = chunk.get("choices") or []
        if isinstance(chunk.get("usage"), dict):
            fw.usage = chunk["usage"]
        if any(_has_output(c) for c in choices):
            now = time.monotonic()
            if fw.last_at is None:
                self.gateway.first_token(fw.ctx, now)
            else:
                self.gateway.inter_token(fw.ctx, now, now - fw.last_at)
            fw.last_at = now
            fw.chunks += 1
            if self.gateway.progress_due(fw.ctx, now):
                self.gateway.progress(fw.ctx, now, 0, fw.chunks)
        fw.finish_reason = next((c.get("finish_reason") for c in choices if c.get("finish_reason")), fw.finish_reason)
        if not want_usage:
            if not choices and "usage" in chunk:
                return None  # the usage chunk we asked for, not the caller
            chunk.pop("usage", None)
        return f"data: {json.dumps(chunk, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def _end(self, fw: _Forwarded, status: str) -> None:
        """Close the upstream call; a request that did not finish is settled in the background
        (the handler is being cancelled: nothing may be awaited on its way out)."""
        if fw.closed:
            return
        fw.closed = True
        loop = asyncio.get_running_loop()
        close = loop.create_task(close_call(fw.call))
        self._keep(close)
        if status != "finished":
            self._keep(loop.create_task(self._settle(fw, status)))

    def _keep(self, task: asyncio.Task[None]) -> None:
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _settle(self, fw: _Forwarded, status: str) -> None:
        usage = fw.usage or {}
        prompt = int(usage.get("prompt_tokens") or fw.prompt_estimate)
        completion = int(usage.get("completion_tokens") or fw.chunks)
        details = usage.get("prompt_tokens_details") or {}
        cached = int(details.get("cached_tokens") or 0) if isinstance(details, dict) else 0
        reason = fw.finish_reason if status == "finished" else ABORT_REASONS.get(status, "abort:error")
        if status == "failed":
            reason = "abort:error"
        await self.gateway.settle(fw.ctx, Receipt(
            model=self.served_model_name, status=status, prompt_tokens=prompt, cached_tokens=cached,
            completion_tokens=completion, finish_reason=reason,
            sequences=[SequenceReceipt(fw.response_id, prompt, completion,
                                       (reason or "stop") if status == "finished" else "abort")],
        ))

    async def drain(self, timeout: float = 15.0) -> None:
        if self._background:
            await asyncio.wait(set(self._background), timeout=timeout)


def _has_output(choice: dict[str, Any]) -> bool:
    """A chunk choice that carries generated text (chat delta or completion text)."""
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return bool(delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"))
    return bool(choice.get("text"))
