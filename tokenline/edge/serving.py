"""Chat and text completions: prompt in, engine requests out, OpenAI responses or SSE chunks back.

One HTTP request becomes ``len(prompts) * n`` engine requests whose outputs share one collector.
Each sequence's ids become text through a ``TextStream`` (incremental detokenization + stop
strings). Whatever ends the HTTP request early — a disconnect, a timeout, a stop string, an error —
aborts the engine requests still running, so no KV block outlives its client.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tokenline.edge.errors import APIError
from tokenline.edge.keys import Tenant
from tokenline.edge.ledger import UsageLedger, UsageRecord
from tokenline.edge.metrics import ServerMetrics
from tokenline.edge.rate_limit import RateLimiter, Reservation
from tokenline.edge.trace import RequestTrace
from tokenline.edge.protocol import (
    AssistantMessage,
    ChatCompletionChunk,
    ChatCompletionChunkChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatLogprobs,
    ChatLogprobToken,
    ChatTopLogprob,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    TokenizeRequest,
    ToolCallItem,
    UsageInfo,
    random_id,
)
from tokenline.engine.async_client import AsyncEngineClient, EngineDeadError, EngineRequestError, OutputCollector
from tokenline.engine.messages import EngineOutput, EngineRequest, FinishReason, TokenLogprobs
from tokenline.frontend.chat_output import ChatOutputParser, forced_tool_call_prefix
from tokenline.frontend.chat_template import ChatTemplateError
from tokenline.frontend.text_stream import TextStream
from tokenline.frontend.tokenizer import Tokenizer
from tokenline.sampling_params import SamplingParams

logger = logging.getLogger("tokenline.edge")


@dataclass
class RequestContext:
    """What the edge knows about one HTTP request before the model sees it."""

    request_id: str
    trace: RequestTrace
    tenant: Tenant | None = None
    response_headers: dict[str, str] = field(default_factory=dict)  # e.g. x-ratelimit-*, sent by the door

    @property
    def tenant_name(self) -> str:
        return self.tenant.name if self.tenant is not None else "anonymous"

    @property
    def arrival(self) -> float:
        return self.trace.stamps["arrived"]


@dataclass
class _Choice:
    """One generated sequence of the response."""

    index: int
    request_id: str
    prompt_index: int
    stream: TextStream
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    sent_role: bool = False
    text_offset: int = 0  # characters already streamed (completions' logprobs.text_offset)
    # The engine's final word (it may come after the client's view ended, e.g. after a stop string).
    engine_final: EngineOutput | None = None
    chat_output: ChatOutputParser | None = None  # reasoning / tool-call split of a chat choice
    first_token_at: float | None = None
    last_output_at: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_produced(self) -> int:
        """Tokens the engine actually generated (what is billed), known exactly once it is final."""
        if self.engine_final is not None:
            return self.engine_final.num_output_tokens
        return len(self.token_ids)


@dataclass
class _Generation:
    """Everything one HTTP request has in flight."""

    response_id: str
    created: int
    prompts: list[list[int]]
    params: SamplingParams
    choices: dict[str, _Choice]
    collector: OutputCollector
    ctx: RequestContext
    reservation: Reservation | None = None

    def usage(self) -> UsageInfo:
        """Prompt tokens count once per prompt (not per choice); completion tokens are those the engine
        produced (after a stop string that can be a token more than the text shows), as billed."""
        completion = sum(c.num_produced for c in self.choices.values())
        cached: dict[int, int] = {}
        for choice in self.choices.values():
            cached[choice.prompt_index] = max(cached.get(choice.prompt_index, 0), choice.num_cached_tokens)
        return UsageInfo.of(sum(len(p) for p in self.prompts), completion, sum(cached.values()))

    def sorted_choices(self) -> list[_Choice]:
        return sorted(self.choices.values(), key=lambda c: c.index)


class OpenAIServing:
    def __init__(
        self,
        client: AsyncEngineClient,
        tokenizer: Tokenizer,
        served_model_name: str,
        generation_config: dict[str, Any],
        metrics: ServerMetrics,
        request_timeout: float | None = None,
        limiter: RateLimiter | None = None,
        ledger: UsageLedger | None = None,
        log_prompts: bool = False,
        reasoning_parser: str | None = None,
        tool_call_parser: str | None = None,
    ) -> None:
        self.client = client
        self.tokenizer = tokenizer
        self.served_model_name = served_model_name
        self.generation_config = generation_config
        self.metrics = metrics
        self.request_timeout = request_timeout
        self.limiter = limiter
        self.ledger = ledger
        self.log_prompts = log_prompts
        self.reasoning_parser = reasoning_parser
        self.tool_call_parser = tool_call_parser
        self._background: set[asyncio.Task[None]] = set()

    async def drain(self, timeout: float = 15.0) -> None:
        """Let receipts still being written in the background finish (at shutdown)."""
        if self._background:
            await asyncio.wait(set(self._background), timeout=timeout)

    # --- shared checks -------------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.served_model_name:
            raise APIError.not_found(f"The model `{model}` does not exist.", param="model", code="model_not_found")

    @property
    def max_model_len(self) -> int:
        info = self.client.info
        if info is None:
            raise APIError.unavailable("the model is still loading; retry shortly")
        return info.max_model_len

    def ensure_ready(self) -> None:
        if not self.client.alive:
            if self.client.error:
                raise APIError.server_error(f"the engine is not available: {self.client.error}")
            raise APIError.unavailable("the engine is not running")
        if self.client.info is None:
            raise APIError.unavailable("the model is still loading; retry shortly")

    def render_chat(
        self, request: ChatCompletionRequest | TokenizeRequest, trace: RequestTrace | None = None, suffix: str = ""
    ) -> list[int]:
        tools = getattr(request, "tools", None)
        if getattr(request, "tool_choice", None) == "none":
            tools = None  # the model is not to call tools: do not offer them
        try:
            text = self.tokenizer.apply_chat_template(
                request.template_messages(),
                tools=tools or None,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                chat_template_kwargs=request.chat_template_kwargs,
            )
        except ChatTemplateError as exc:
            raise APIError.bad_request(f"the chat template rejected the messages: {exc}", param="messages") from exc
        except ValueError as exc:
            raise APIError.bad_request(str(exc), param="messages") from exc
        if trace is not None:
            trace.mark("rendered")
        # The template already wrote any BOS it wants.
        ids = self.tokenizer.encode(text + suffix, add_special_tokens=False)
        if trace is not None:
            trace.mark("tokenized")
        return ids

    def _check_prompt(self, prompt_ids: list[int], param: str) -> None:
        if not prompt_ids:
            raise APIError.bad_request("the prompt is empty", param=param)
        vocab = self.tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise APIError.bad_request(f"prompt token ids must be in [0, {vocab})", param=param)
        if len(prompt_ids) >= self.max_model_len:
            raise APIError.bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your prompt has "
                f"{len(prompt_ids)} tokens. Please reduce the length of the prompt.",
                param=param,
                code="context_length_exceeded",
            )

    def _sampling_params(self, request: ChatCompletionRequest | CompletionRequest, prompt_len: int) -> SamplingParams:
        params = request.to_sampling_params(self.max_model_len, prompt_len)  # raises 400s itself
        vocab = self.tokenizer.vocab_size
        if params.logit_bias and any(not 0 <= t < vocab for t in params.logit_bias):
            raise APIError.bad_request(f"logit_bias token ids must be in [0, {vocab})", param="logit_bias")
        if any(not 0 <= t < vocab for t in params.stop_token_ids):
            raise APIError.bad_request(f"stop_token_ids must be in [0, {vocab})", param="stop_token_ids")
        return params.with_defaults(self.generation_config)

    # --- starting and consuming a generation ---------------------------------------------------

    async def _start(
        self, ctx: RequestContext, prefix: str, prompts: list[list[int]], params: SamplingParams, priority: int
    ) -> _Generation:
        ctx.trace.prompt_tokens = sum(len(p) for p in prompts)
        reservation = None
        if self.limiter is not None and ctx.tenant is not None:
            # Tokens are charged before any expensive work: the prompt plus the completion reserved.
            reserve = params.max_tokens or 0
            try:
                reservation = await self.limiter.acquire(ctx.tenant, ctx.trace.prompt_tokens, reserve * params.n * len(prompts))
            except APIError as exc:
                self.metrics.rejected.labels("rate_limited").inc()
                self.metrics.rate_limited.labels(ctx.tenant.name, _limit_name(exc)).inc()
                raise
            if reservation.headers is not None:
                ctx.response_headers.update(reservation.headers.as_dict())
        response_id = random_id(prefix)
        choices: dict[str, _Choice] = {}
        requests = []
        for prompt_index, prompt_ids in enumerate(prompts):
            for j in range(params.n):
                index = prompt_index * params.n + j
                child = params.for_child(j)
                request_id = f"{response_id}-{index}"
                choices[request_id] = _Choice(index, request_id, prompt_index, TextStream(self.tokenizer, child, prompt_ids))
                requests.append(EngineRequest(request_id, prompt_ids, child, priority=priority))
        try:
            collector = self.client.add(requests)
        except EngineDeadError as exc:
            if reservation is not None:
                await self.limiter.settle(reservation, 0)  # type: ignore[union-attr]
            raise APIError.server_error(f"the engine is not available: {exc}") from exc
        ctx.trace.mark("queued")
        return _Generation(response_id, int(time.time()), prompts, params, choices, collector, ctx, reservation)

    async def _updates(self, gen: _Generation) -> AsyncIterator[list[tuple[_Choice, str, list[TokenLogprobs]]]]:
        """Yield, per batch of engine outputs, (choice, new text, new logprobs) for each choice.

        On a normal end the receipt (usage ledger, metrics, rate-limit settlement, trace) is
        written before this returns, so a client that saw the end of its response is billed
        durably. Any other end — disconnect, timeout, error — aborts what still runs and writes
        the receipt in the background once the engine reports the tokens actually produced.
        """
        status = "failed"
        try:
            async with asyncio.timeout(self.request_timeout):
                while not all(c.finished for c in gen.choices.values()):
                    try:
                        outputs = await gen.collector.get()
                    except EngineRequestError as exc:
                        raise APIError.bad_request(str(exc), param=exc.param) from exc
                    except EngineDeadError as exc:
                        raise APIError.server_error(f"the engine failed while generating: {exc}") from exc
                    updates = [self._absorb(gen, output) for output in outputs]
                    if updates:
                        yield updates
            status = "finished"
        except TimeoutError as exc:
            status = "timed_out"
            raise APIError.timeout(f"the request did not finish within {self.request_timeout:g} s") from exc
        except (asyncio.CancelledError, GeneratorExit):
            status = "cancelled"  # the client went away
            raise
        finally:
            if status != "finished":
                self._abort(gen)
                task = asyncio.get_running_loop().create_task(self._settle(gen, status))
                self._background.add(task)
                task.add_done_callback(self._background.discard)
        await self._settle(gen, status)

    def _abort(self, gen: _Generation) -> None:
        self.client.abort([c.request_id for c in gen.choices.values() if c.engine_final is None])

    async def _settle(self, gen: _Generation, status: str) -> None:
        """Write the request's receipt once the engine has said its last word on every sequence."""
        self._abort(gen)  # sequences a stop string ended may still run: stop them (no-op otherwise)
        try:
            async with asyncio.timeout(10.0):
                while not gen.collector.finished:
                    for output in await gen.collector.get():
                        self._absorb_final(gen, output)
        except (TimeoutError, EngineDeadError, EngineRequestError):
            pass  # the engine is gone or silent: bill what we saw
        self.client.forget(gen.collector)
        ctx, now = gen.ctx, time.monotonic()
        ctx.trace.mark("finished", now)
        usage = gen.usage()
        completion = sum(c.num_produced for c in gen.choices.values())
        for choice in gen.choices.values():
            final = choice.engine_final
            reason = choice.finish_reason or (final.finish_reason.value if final and final.finish_reason else "abort")
            if status == "cancelled" or status == "timed_out":
                reason = "abort"
            timings = final.timings if final is not None else None
            if timings is not None:
                if timings.first_scheduled is not None:
                    ctx.trace.mark("first_scheduled", timings.first_scheduled)
                ctx.trace.num_steps = max(ctx.trace.num_steps, timings.num_steps)
                ctx.trace.num_shared_steps = max(ctx.trace.num_shared_steps, timings.num_shared_steps)
            self.metrics.finished(
                len(gen.prompts[choice.prompt_index]), choice.num_produced, reason, timings, ctx.arrival, now
            )
        ctx.trace.status = status
        ctx.trace.completion_tokens = completion
        if gen.reservation is not None and self.limiter is not None:
            await self.limiter.settle(gen.reservation, completion)
        if self.ledger is not None:
            record = UsageRecord(
                request_id=ctx.request_id,
                tenant=ctx.tenant_name,
                model=self.served_model_name,
                status=status,
                finish_reason=next((c.finish_reason for c in gen.sorted_choices() if c.finish_reason), None),
                prompt_tokens=usage.prompt_tokens,
                cached_tokens=usage.prompt_tokens_details.cached_tokens,
                completion_tokens=completion,
                created_at=ctx.trace.wall_arrival,
                queue_s=_since(ctx.trace, "first_scheduled"),
                ttft_s=_since(ctx.trace, "first_token"),
                e2e_s=now - ctx.arrival,
            )
            await self.ledger.record(record)
            self.metrics.spend.labels(ctx.tenant_name, self.served_model_name).inc(record.cost_usd or 0.0)
        line: dict[str, Any] = {"event": "request_finished", **ctx.trace.to_dict()}
        if self.log_prompts:  # user text is untrusted and private: logged only when the operator asks
            line["prompts"] = [self.tokenizer.decode(p, skip_special_tokens=False) for p in gen.prompts]
            line["completions"] = [c.stream.text for c in gen.sorted_choices()]
        logger.info("request %s", json.dumps(line, ensure_ascii=False))

    def _absorb_final(self, gen: _Generation, output: EngineOutput) -> None:
        """Late outputs after the client's view ended: only the counts and timings matter now."""
        choice = gen.choices[output.request_id]
        if output.finished:
            choice.engine_final = output

    def _absorb(self, gen: _Generation, output: EngineOutput) -> tuple[_Choice, str, list[TokenLogprobs]]:
        choice = gen.choices[output.request_id]
        if output.finished:
            choice.engine_final = output
        if choice.finished:
            return choice, "", []  # text already ended (a stop string); the engine is catching up
        now = time.monotonic()
        if output.new_token_ids:
            if choice.first_token_at is None:
                choice.first_token_at = now
                gen.ctx.trace.mark("first_token", now)
                self.metrics.first_token(now - gen.ctx.arrival)
            elif choice.last_output_at is not None:
                self.metrics.inter_token(now - choice.last_output_at)
            choice.last_output_at = now
            gen.ctx.trace.stamps["last_token"] = now
        choice.token_ids.extend(output.new_token_ids)
        choice.num_cached_tokens = output.num_cached_tokens
        new_logprobs = output.new_logprobs or []
        choice.logprobs.extend(new_logprobs)
        delta = choice.stream.push(output.new_token_ids)
        if choice.stream.stopped:
            choice.finish_reason = FinishReason.STOP.value
            if not output.finished:
                self.client.abort([choice.request_id])  # a stop string ended it: free the engine now
        elif output.finished:
            delta += choice.stream.finish()
            choice.finish_reason = output.finish_reason.value
        return choice, delta, new_logprobs

    # --- chat ----------------------------------------------------------------------------------

    async def chat(self, request: ChatCompletionRequest, raw: Request, ctx: RequestContext) -> Response:
        request.check(tools_enabled=self.tool_call_parser is not None)  # before any tokenizing work
        self.ensure_ready()
        self.check_model(request.model)
        use_tools = bool(request.tools) and request.tool_choice != "none" and self.tool_call_parser is not None
        # Without a grammar engine, "required" and a named function are enforced by starting the
        # answer inside a tool call: the model can only go on with a name or with the arguments.
        forced = forced_tool_call_prefix(request.tool_choice) if use_tools else ""
        prompt_ids = self.render_chat(request, ctx.trace, suffix=forced)
        self._check_prompt(prompt_ids, "messages")
        params = self._sampling_params(request, len(prompt_ids))
        gen = await self._start(ctx, "chatcmpl", [prompt_ids], params, request.priority)
        if self.reasoning_parser is not None or use_tools:
            # The answer starts inside reasoning when the prompt's last turn opened <think> without
            # closing it (a template that opens it, or continue_final_message inside a thought).
            tail = self.tokenizer.decode(prompt_ids[-256:], skip_special_tokens=False)
            tail = tail[tail.rfind("<|im_start|>") + 1 :]
            starts_in_reasoning = tail.rfind("<think>") > tail.rfind("</think>")
            for choice in gen.choices.values():
                choice.chat_output = ChatOutputParser(
                    reasoning=self.reasoning_parser is not None,
                    starts_in_reasoning=starts_in_reasoning,
                    tools=use_tools,
                    prefix=forced,
                )
        if request.stream:
            return _sse(self._chat_stream(gen, request))
        return await _until_disconnect(self._chat_full(gen), raw)

    async def _chat_full(self, gen: _Generation) -> Response:
        async for _ in self._updates(gen):
            pass
        want_logprobs = gen.params.logprobs is not None
        choices = []
        for c in gen.sorted_choices():
            message, finish_reason = AssistantMessage(content=c.stream.text), c.finish_reason
            if c.chat_output is not None:
                parsed = c.chat_output.parse_all(c.stream.text)
                message = AssistantMessage(
                    content=parsed.content if parsed.content or not parsed.tool_calls else None,
                    reasoning_content=parsed.reasoning,
                    reasoning=parsed.reasoning,
                    tool_calls=[
                        ToolCallItem(id=t.id, function=FunctionCall(name=t.name, arguments=t.arguments_json))
                        for t in parsed.tool_calls
                    ]
                    or None,
                )
                if parsed.tool_calls and finish_reason == "stop":
                    finish_reason = "tool_calls"
            choices.append(
                ChatCompletionResponseChoice(
                    index=c.index,
                    message=message,
                    logprobs=self._chat_logprobs(c.token_ids, c.logprobs) if want_logprobs else None,
                    finish_reason=finish_reason,
                )
            )
        response = ChatCompletionResponse(
            id=gen.response_id, created=gen.created, model=self.served_model_name, choices=choices, usage=gen.usage()
        )
        return JSONResponse(response.model_dump())

    def _chat_stream(self, gen: _Generation, request: ChatCompletionRequest) -> AsyncIterator[str]:
        want_logprobs = gen.params.logprobs is not None

        def entries(choice: _Choice, delta: str, logprobs: list[TokenLogprobs]) -> list[ChatCompletionChunkChoice]:
            out = []
            if not choice.sent_role:
                choice.sent_role = True
                out.append(ChatCompletionChunkChoice(index=choice.index, delta=DeltaMessage(role="assistant", content="")))
            if not (delta or choice.finished or (want_logprobs and logprobs)):
                return out
            message = DeltaMessage(content=delta) if delta else DeltaMessage()
            finish_reason = choice.finish_reason
            if choice.chat_output is not None:
                message, finish_reason = _shaped_delta(choice, delta)
            entry = ChatCompletionChunkChoice(index=choice.index, delta=message, finish_reason=finish_reason)
            if want_logprobs:
                ids = choice.token_ids[len(choice.token_ids) - len(logprobs) :]
                entry.logprobs = self._chat_logprobs(ids, logprobs)
            return [*out, entry]

        return self._stream(gen, request, ChatCompletionChunk, entries)

    def _chat_logprobs(self, token_ids: list[int], logprobs: list[TokenLogprobs]) -> ChatLogprobs:
        content = []
        for token_id, entry in zip(token_ids, logprobs):
            top = [
                ChatTopLogprob(token=self._token_text(i), logprob=value, bytes=list(self.tokenizer.token_bytes(i)))
                for i, value in entry.top
            ]
            content.append(
                ChatLogprobToken(
                    token=self._token_text(token_id),
                    logprob=entry.logprob,
                    bytes=list(self.tokenizer.token_bytes(token_id)),
                    top_logprobs=top,
                )
            )
        return ChatLogprobs(content=content)

    # --- completions ---------------------------------------------------------------------------

    async def completion(self, request: CompletionRequest, raw: Request, ctx: RequestContext) -> Response:
        request.check()
        self.ensure_ready()
        self.check_model(request.model)
        ctx.trace.mark("rendered")  # nothing to render for a text completion
        prompts = [
            self.tokenizer.encode(p, add_special_tokens=request.add_special_tokens) if isinstance(p, str) else list(p)
            for p in request.prompts()
        ]
        ctx.trace.mark("tokenized")
        for prompt_ids in prompts:
            self._check_prompt(prompt_ids, "prompt")
        # Every prompt of a batch shares the parameters; the longest one decides the context check.
        params = self._sampling_params(request, max(len(p) for p in prompts))
        gen = await self._start(ctx, "cmpl", prompts, params, request.priority)
        if request.stream:
            return _sse(self._completion_stream(gen, request))
        return await _until_disconnect(self._completion_full(gen), raw)

    async def _completion_full(self, gen: _Generation) -> Response:
        async for _ in self._updates(gen):
            pass
        want_logprobs = gen.params.logprobs is not None
        response = CompletionResponse(
            id=gen.response_id,
            created=gen.created,
            model=self.served_model_name,
            choices=[
                CompletionChoice(
                    index=c.index,
                    text=c.stream.text,
                    logprobs=self._completion_logprobs(c.token_ids, c.logprobs, 0) if want_logprobs else None,
                    finish_reason=c.finish_reason,
                )
                for c in gen.sorted_choices()
            ],
            usage=gen.usage(),
        )
        return JSONResponse(response.model_dump())

    def _completion_stream(self, gen: _Generation, request: CompletionRequest) -> AsyncIterator[str]:
        want_logprobs = gen.params.logprobs is not None

        def entries(choice: _Choice, delta: str, logprobs: list[TokenLogprobs]) -> list[CompletionChoice]:
            if not (delta or choice.finished or (want_logprobs and logprobs)):
                return []
            entry = CompletionChoice(index=choice.index, text=delta, finish_reason=choice.finish_reason)
            if want_logprobs:
                ids = choice.token_ids[len(choice.token_ids) - len(logprobs) :]
                entry.logprobs = self._completion_logprobs(ids, logprobs, choice.text_offset)
            choice.text_offset += len(delta)
            return [entry]

        return self._stream(gen, request, CompletionChunk, entries)

    def _completion_logprobs(self, token_ids: list[int], logprobs: list[TokenLogprobs], offset: int) -> CompletionLogprobs:
        result = CompletionLogprobs()
        for token_id, entry in zip(token_ids, logprobs):
            token = self._token_text(token_id)
            result.tokens.append(token)
            result.token_logprobs.append(entry.logprob)
            result.top_logprobs.append({self._token_text(i): v for i, v in entry.top})
            result.text_offset.append(offset)
            offset += len(token)
        return result

    # --- small helpers -------------------------------------------------------------------------

    async def _stream(
        self,
        gen: _Generation,
        request: ChatCompletionRequest | CompletionRequest,
        chunk_type: type[ChatCompletionChunk] | type[CompletionChunk],
        entries: Callable[[_Choice, str, list[TokenLogprobs]], list[Any]],
    ) -> AsyncIterator[str]:
        """The SSE frame both APIs share: one chunk per choice entry, the usage chunk, [DONE];
        an error after the headers went out becomes an error event."""
        include_usage, continuous = request.stream_include_usage, request.stream_continuous_usage

        def event(choices: list[Any], usage: UsageInfo | None) -> str:
            body = chunk_type(id=gen.response_id, created=gen.created, model=self.served_model_name, choices=choices)
            if include_usage:
                body.usage = usage  # OpenAI sends "usage": null on the chunks before the last
            return f"data: {body.model_dump_json()}\n\n"

        try:
            async for updates in self._updates(gen):
                for choice, delta, logprobs in updates:
                    for entry in entries(choice, delta, logprobs):
                        yield event([entry], gen.usage() if continuous else None)
            if include_usage:
                yield event([], gen.usage())
        except APIError as exc:
            yield _sse_event(exc.to_dict())
        yield "data: [DONE]\n\n"

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def _shaped_delta(choice: _Choice, delta: str) -> tuple[DeltaMessage, str | None]:
    """Split a chat choice's text delta into reasoning, content and tool-call pieces."""
    shaper = choice.chat_output
    assert shaper is not None
    piece = shaper.feed(delta)
    if choice.finished:
        piece = piece.merged(shaper.finish())
    calls = [
        DeltaToolCall(
            index=t.index,
            id=t.id,
            type="function" if t.id else None,
            function=DeltaFunctionCall(name=t.name, arguments=t.arguments),
        )
        for t in piece.tool_calls
    ]
    message = DeltaMessage(
        content=piece.content or None,
        reasoning_content=piece.reasoning or None,
        reasoning=piece.reasoning or None,
        tool_calls=calls or None,
    )
    finish_reason = choice.finish_reason
    if finish_reason == "stop" and shaper.made_tool_calls:
        finish_reason = "tool_calls"
    return message, finish_reason


def _since(trace: RequestTrace, stage: str) -> float | None:
    at = trace.stamps.get(stage)
    return None if at is None else at - trace.stamps["arrived"]


def _limit_name(error: APIError) -> str:
    """Which limit refused a request, for the rate-limited counter's label."""
    return error.code or "rate_limit"


def _sse_event(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _sse(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(
        events,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def _until_disconnect(work: Awaitable[Response], raw: Request) -> Response:
    """Run a non-streaming handler, but cancel it (aborting its engine requests) if the client
    hangs up first: nobody would read the answer, and its KV blocks are wanted elsewhere."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await raw.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        watcher.cancel()
        return task.result()
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):  # noqa: BLE001 - the client is gone either way
        pass
    return Response(status_code=499)

