"""Chat and text completions over HTTP: the OpenAI protocol mapped onto the request processor.

One HTTP request becomes ``len(prompts) * n`` engine requests (the processor's fan-out) whose
outputs share one collector. This module only maps: requests to the processor's inputs, its
updates to OpenAI responses or SSE chunks. Keys, limits, metrics and the receipt are the
gateway's; text, stops and usage the processor's. Whatever ends the HTTP request early — a
disconnect, a timeout, a stop string, an error — aborts the engine requests still running, so no
KV block outlives its client.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tokenline.api.protocol import (
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
    PromptLogprob,
    PromptLogprobs,
    TokenizeRequest,
    ToolCallItem,
    UsageInfo,
    random_id,
)
from tokenline.api.sse import ChunkFrame
from tokenline.engine.client import EngineClient, EngineDeadError, EngineRequestError, OutputCollector
from tokenline.engine.messages import EngineOutput, TokenLogprobs
from tokenline.frontend.processor import ChatParserFactory, InputProcessor
from tokenline.frontend.request_state import RequestState, SequenceState, SequenceUpdate
from tokenline.frontend.text_pool import INLINE_MAX_CHARS, TextWorkPool, text_size
from tokenline.frontend.tokenizer import Tokenizer
from tokenline.frontend.tool_calls import TOOL_CALL_END, TOOL_CALL_START
from tokenline.frontend.tool_grammar import strict_schema, tool_call_grammar
from tokenline.frontend.tool_parsers import HERMES, tool_call_format
from tokenline.gateway.errors import APIError, shorten
from tokenline.gateway.filters import OutputGuard
from tokenline.gateway.gateway import Gateway, Receipt, RequestContext, SequenceReceipt
from tokenline.gateway.ledger import ABORT_REASONS
from tokenline.sampling_params import SamplingParams, SamplingParamsError, StructuredOutputs

ENGINE_RETRY_AFTER_S = 2.0  # what a 503 suggests while the engine loads or restarts


@dataclass
class _Generation:
    """Everything one HTTP request has in flight."""

    state: RequestState
    created: int
    collector: OutputCollector
    ctx: RequestContext
    guard: OutputGuard | None = None  # the tenant's output filters
    param_names: dict[str, str] = field(default_factory=dict)  # engine-side names -> the request's

    @property
    def response_id(self) -> str:
        return self.state.group_id

    @property
    def params(self) -> SamplingParams:
        return self.state.params

    def usage(self) -> UsageInfo:
        usage = self.state.usage()
        return UsageInfo.of(usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens)


class OpenAIServing:
    def __init__(
        self,
        client: EngineClient,
        processor: InputProcessor,
        gateway: Gateway,
        served_model_name: str,
        request_timeout: float | None = None,
        tool_call_parser: str | None = None,
        model_aliases: Sequence[str] = (),
    ) -> None:
        """``served_model_name`` is the name responses report; requests may also name an alias."""
        self.client = client
        self.processor = processor
        self.tokenizer: Tokenizer = processor.tokenizer
        self.gateway = gateway
        self.served_model_name = served_model_name
        self.model_names = frozenset([served_model_name, *model_aliases])
        self.request_timeout = request_timeout
        self.tool_call_parser = tool_call_parser
        self.tool_format = tool_call_format(tool_call_parser) if tool_call_parser else None
        self._background: set[asyncio.Task[None]] = set()
        # Rendering and tokenizing run here, off the event loop, bounded (frontend/text_pool.py).
        self.text_pool = TextWorkPool()

    async def drain(self, timeout: float = 15.0) -> None:
        """Let receipts still being written in the background finish (at shutdown)."""
        if self._background:
            await asyncio.wait(set(self._background), timeout=timeout)

    # --- shared checks -------------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            raise APIError.not_found(
                f"The model `{shorten(model)}` does not exist.", param="model", code="model_not_found"
            )

    @property
    def max_model_len(self) -> int:
        info = self.client.info
        if info is None:
            raise APIError.unavailable("the model is still loading; retry shortly")
        return info.max_model_len

    def ensure_ready(self) -> None:
        self._check_engine()
        if self.client.info is None:
            raise APIError.unavailable("the model is still loading; retry shortly", retry_after_s=ENGINE_RETRY_AFTER_S)

    def _check_engine(self) -> None:
        """A 503 while the engine is down: with Retry-After while a new one is on its way."""
        if self.client.alive:
            return
        if self.client.state == "restarting":
            raise APIError.unavailable("the engine is restarting; retry shortly", retry_after_s=ENGINE_RETRY_AFTER_S)
        raise APIError.unavailable(f"the engine is not available: {self.client.error or 'not running'}")

    def render_chat(self, request: ChatCompletionRequest | TokenizeRequest, ctx: RequestContext | None = None) -> list[int]:
        """The request's messages through the model's chat template, tokenized (trace stamped)."""
        tools = getattr(request, "tools", None)
        if getattr(request, "tool_choice", None) == "none":
            tools = None  # the model is not to call tools: do not offer them
        text = self.processor.render_chat_text(
            request.template_messages(),
            tools=tools,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            chat_template_kwargs=request.chat_template_kwargs,
            reasoning_effort=getattr(request, "reasoning_effort", None),
        )
        if ctx is not None:
            ctx.trace.mark("rendered")
        ids = self.processor.encode_rendered(text)
        if ctx is not None:
            ctx.trace.mark("tokenized")
        return ids

    def _params(
        self, request: ChatCompletionRequest | CompletionRequest, prompt_ids: list[int], tool_grammar: str | None = None
    ) -> SamplingParams:
        params = request.to_sampling_params()
        if tool_grammar is not None:
            # tool_choice "required" or a named function: the answer is made of tool calls, so the
            # call's grammar replaces any output schema for this turn, as in vLLM (openai-agents
            # sends both whenever an agent has an output type).
            params = dataclasses.replace(params, structured_outputs=StructuredOutputs(grammar=tool_grammar))
        elif params.structured_outputs is not None and params.structured_outputs.json is not None:
            params = dataclasses.replace(params, structured_outputs=self._strict_json(params.structured_outputs, request))
        return self.processor.resolve(params, prompt_ids, request.param_names, self.gateway.limits.max_tokens_cap)

    @staticmethod
    def _strict_json(spec: StructuredOutputs, request: ChatCompletionRequest | CompletionRequest) -> StructuredOutputs:
        """A JSON schema that holds only its declared keys unless it says otherwise: what vLLM's
        default backend (xgrammar's strict mode) enforces, and what keeps a weak model from adding
        keys until it runs out of tokens. Text that is not a JSON object is left to the grammar check."""
        schema = spec.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError:
                return spec
        if not isinstance(schema, dict):
            return spec
        param = request.param_names.get("structured_outputs.json", "structured_outputs.json")
        try:
            return dataclasses.replace(spec, json=strict_schema(schema, param))
        except SamplingParamsError as exc:
            raise APIError.bad_request(str(exc), param=exc.param) from exc

    # --- starting and consuming a generation ---------------------------------------------------

    async def _start(
        self,
        ctx: RequestContext,
        prefix: str,
        prompts: list[list[int]],
        params: SamplingParams,
        priority: int,
        chat_parser: ChatParserFactory | None = None,
        response_id: str | None = None,
        session_id: str | None = None,
        cache_salt: str | None = None,
        param_names: dict[str, str] | None = None,
    ) -> _Generation:
        # Tokens are charged before any expensive work: the prompt plus the completion reserved.
        reserved = (params.max_tokens or 0) * params.n * len(prompts)
        await self.gateway.reserve(ctx, sum(len(p) for p in prompts), reserved)
        state = self.processor.fan_out(
            response_id or random_id(prefix), prompts, params, priority=priority, client_request_id=ctx.request_id,
            chat_parser=chat_parser, session_id=session_id, cache_salt=self.gateway.cache_salt(ctx, cache_salt),
            tenant=ctx.tenant.name if ctx.tenant is not None else None,
        )
        ctx.name_response(state.group_id, state.request_ids)
        # Stamped at the hand-off: the engine may schedule the request while the journal row is written.
        handed_over = time.monotonic()
        try:
            collector = self.client.add(state.engine_requests)
        except EngineDeadError as exc:  # it died while the request was being admitted
            await self.gateway.release(ctx)
            self._check_engine()
            raise APIError.unavailable(f"the engine is not available: {exc}") from exc
        self.gateway.journal(ctx, self.served_model_name, sum(len(p) for p in prompts))
        self.gateway.queued(ctx, handed_over)
        return _Generation(state, int(time.time()), collector, ctx, self.gateway.output_guard(ctx), param_names or {})

    async def _updates(self, gen: _Generation) -> AsyncIterator[list[SequenceUpdate]]:
        """Yield, per batch of engine outputs, one update per sequence that changed.

        On a normal end the receipt (usage ledger, metrics, rate-limit settlement, trace) is
        written before this returns, so a client that saw the end of its response is billed
        durably. Any other end — disconnect, timeout, error — aborts what still runs and writes
        the receipt in the background once the engine reports the tokens actually produced.
        """
        status, abort_reason = "failed", "abort:error"
        try:
            async with asyncio.timeout(self.request_timeout):
                while not gen.state.finished:
                    try:
                        outputs = await gen.collector.get()
                    except EngineRequestError as exc:
                        error = APIError.invalid_request(exc)  # named in the request's terms
                        error.param = gen.param_names.get(exc.param, exc.param)
                        raise error from exc
                    except EngineDeadError as exc:
                        abort_reason = ABORT_REASONS["failed"]
                        raise APIError.server_error(f"the engine failed while generating: {exc}") from exc
                    updates = [self._absorb(gen, output) for output in outputs]
                    now = time.monotonic()
                    if self.gateway.progress_due(gen.ctx, now):  # tokens so far, in case we crash
                        usage = gen.state.usage()
                        self.gateway.progress(gen.ctx, now, usage.cached_tokens, usage.completion_tokens)
                    if gen.guard is not None:
                        for update in updates:
                            await self._screen_output(gen, update)
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
                self.client.abort(gen.state.running_in_engine())
                reason = abort_reason if status == "failed" else ABORT_REASONS[status]
                task = asyncio.get_running_loop().create_task(self._settle(gen, status, reason))
                self._background.add(task)
                task.add_done_callback(self._background.discard)
        await self._settle(gen, status)

    def _absorb(self, gen: _Generation, output: EngineOutput) -> SequenceUpdate:
        now = time.monotonic()
        seq = gen.state.sequences[output.request_id]
        previous = seq.last_output_at
        update = gen.state.absorb(output, now)
        if update.num_new_tokens:
            if previous is None:
                self.gateway.first_token(gen.ctx, now)
            else:
                self.gateway.inter_token(gen.ctx, now, now - previous)
        if update.abort:
            self.client.abort([seq.request_id])  # a stop string ended it: free the engine now
        return update

    async def _screen_output(self, gen: _Generation, update: SequenceUpdate) -> None:
        """Run the output filters over a choice's new text, then let out what they passed but the
        guard's hold-back, with only the tokens wholly within that text. A flag ends the choice
        before the flagged text (what a stream already sent stays sent) and aborts its engine
        request; the tokens of the cut text never leave, as text, logprobs or ids."""
        seq, guard = update.seq, gen.guard
        if guard is None:
            return
        if update.text or seq.finished:
            text = seq.stream.text
            start = len(text) - len(update.text)
            decision = await guard.check(seq.request_id, text, start, seq.finished)
            if decision is not None:
                seq.cut(start if decision.offset is None else decision.offset, decision.filter)
                if seq.engine_final is None:
                    self.client.abort([seq.request_id])
        update.text, update.token_ids, update.logprobs = seq.release(guard.holdback)

    async def _settle(self, gen: _Generation, status: str, abort_reason: str | None = None) -> None:
        """Write the request's receipt once the engine has said its last word on every sequence.
        ``abort_reason`` (a ledger ``ABORT_REASONS`` value) is the row's finish reason for a
        request that did not finish."""
        state = gen.state
        self.client.abort(state.running_in_engine())  # sequences a stop string ended may still run
        try:
            async with asyncio.timeout(10.0):
                while not gen.collector.finished:
                    for output in await gen.collector.get():
                        state.absorb_final(output)
        except (TimeoutError, EngineDeadError, EngineRequestError):
            pass  # the engine is gone or silent: bill what we saw
        self.client.forget(gen.collector)
        sequences = []
        for seq in state.in_order():
            final = seq.engine_final
            reason = seq.finish_reason or (final.finish_reason.value if final and final.finish_reason else "abort")
            if status in ("cancelled", "timed_out"):
                reason = "abort"
            sequences.append(
                SequenceReceipt(
                    seq.request_id, len(state.prompts[seq.prompt_index]), seq.num_produced, reason,
                    final.timings if final is not None else None,
                )
            )
        usage = state.usage()
        receipt = Receipt(
            model=self.served_model_name,
            status=status,
            prompt_tokens=usage.prompt_tokens,
            cached_tokens=usage.cached_tokens,
            completion_tokens=usage.completion_tokens,
            finish_reason=abort_reason or next((s.finish_reason for s in state.in_order() if s.finish_reason), None),
            sequences=sequences,
            content_filter=next((s.content_filter for s in state.in_order() if s.content_filter), None),
        )
        if receipt.content_filter is not None:
            receipt.finish_reason = "content_filter"  # the row says a filter ended it, whichever choice
        if self.gateway.log_prompts:  # user text is untrusted and private: logged only when asked
            receipt.prompts = [self.tokenizer.decode(p, skip_special_tokens=False) for p in state.prompts]
            receipt.completions = [s.stream.text for s in state.in_order()]
        await self.gateway.settle(gen.ctx, receipt)

    # --- chat ----------------------------------------------------------------------------------

    async def chat(self, request: ChatCompletionRequest, raw: Request, ctx: RequestContext) -> Response:
        gen = await self.start_chat(request, ctx)
        if request.stream:
            return _sse(self._chat_stream(gen, request))
        return await _until_disconnect(self._chat_full(gen, request), raw)

    async def start_chat(
        self, request: ChatCompletionRequest, ctx: RequestContext, response_id: str | None = None
    ) -> _Generation:
        """Check, render and start a chat request (also what a Responses request becomes)."""
        request.check(tools_enabled=self.tool_call_parser is not None)  # before any tokenizing work
        self.ensure_ready()
        self.check_model(request.model)
        messages = request.template_messages()
        await self.gateway.screen_input(ctx, _message_texts(messages), request.param_names["prompt"])
        use_tools = bool(request.tools) and request.tool_choice != "none" and self.tool_call_parser is not None
        single_call = request.parallel_tool_calls is False
        tool_grammar = None
        if use_tools:  # a bad tool schema is refused before any rendering work
            markers = self.tokenizer.added_token_ids([TOOL_CALL_START, TOOL_CALL_END])
            try:
                tool_grammar = tool_call_grammar(
                    request.tools or [], request.tool_choice, markers, parallel=not single_call
                )
            except SamplingParamsError as exc:
                raise APIError.bad_request(str(exc), param=request.param_names.get(exc.param, exc.param)) from exc
        # Tools render their schemas into the prompt: such a chat always goes to the pool.
        size = INLINE_MAX_CHARS if request.tools else text_size(messages)
        prompt_ids = await self.text_pool.run_sized(size, lambda: self.render_chat(request, ctx), ctx.tenant_name)
        prompt_ids = self.processor.truncate(prompt_ids, request.truncate_prompt_tokens)
        self.processor.check_prompt(prompt_ids, request.param_names["prompt"])
        _note_deprecated(request, ctx)
        params = self._params(request, prompt_ids, tool_grammar)
        # A forced call is written in the grammar's format (Hermes'), the model's own calls in its format.
        tool_format = (HERMES if tool_grammar is not None else self.tool_format) if use_tools else None
        chat_parser = self.processor.chat_parser(tool_format or False, max_calls=1 if single_call else None)
        return await self._start(
            ctx, "chatcmpl", [prompt_ids], params, request.priority, chat_parser,
            response_id=response_id, session_id=request.user, cache_salt=request.cache_salt,
            param_names=request.param_names,
        )

    async def _chat_full(self, gen: _Generation, request: ChatCompletionRequest) -> Response:
        async for _ in self._updates(gen):
            pass
        want_logprobs = gen.params.logprobs is not None
        as_ids, echo = request.return_tokens_as_token_ids, request.echo_text()
        choices = []
        for c in gen.state.in_order():
            message, finish_reason = AssistantMessage(content=c.stream.text), c.finish_reason
            if c.chat_output is not None:
                parsed = c.chat_output.parse_all(c.stream.text, truncated=finish_reason == "length")
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
                finish_reason = c.chat_output.finish_reason(finish_reason)
            if echo:  # vLLM's: the last message's text, then the answer
                message.content = echo + (message.content or "")
            choices.append(
                ChatCompletionResponseChoice(
                    index=c.index,
                    message=message,
                    logprobs=self._chat_logprobs(c.token_ids, c.logprobs, as_ids) if want_logprobs else None,
                    finish_reason=finish_reason,
                )
            )
        first = gen.state.in_order()[0]
        response = ChatCompletionResponse(
            id=gen.response_id, created=gen.created, model=self.served_model_name, choices=choices, usage=gen.usage(),
            prompt_logprobs=self._prompt_logprobs(first.prompt_logprobs, gen.state.prompts[0]),
        )
        return JSONResponse(response.model_dump())

    def _chat_stream(self, gen: _Generation, request: ChatCompletionRequest) -> AsyncIterator[str]:
        want_logprobs = gen.params.logprobs is not None
        as_ids, echo = request.return_tokens_as_token_ids, request.echo_text()
        sent_role: set[int] = set()  # choices whose first chunk (the role) went out

        def entries(update: SequenceUpdate) -> list[ChatCompletionChunkChoice]:
            choice, delta, logprobs = update.seq, update.text, update.logprobs
            out = []
            if choice.index not in sent_role:
                sent_role.add(choice.index)
                out.append(ChatCompletionChunkChoice(index=choice.index, delta=DeltaMessage(role="assistant", content="")))
                if echo:  # vLLM sends the echoed text as a chunk of its own after the role's
                    out.append(ChatCompletionChunkChoice(index=choice.index, delta=DeltaMessage(content=echo)))
            if not (delta or choice.finished or (want_logprobs and logprobs) or update.num_new_tokens):
                return out
            # A token whose text is held back (half a character, a possible stop string) still gets
            # its chunk, empty, as vLLM sends it: clients count tokens by chunks.
            message = DeltaMessage(content=delta) if delta or not choice.finished else DeltaMessage()
            finish_reason = choice.finish_reason
            if choice.chat_output is not None:
                message, finish_reason = _shaped_delta(choice, delta)
                if not (message.content or message.reasoning_content or message.tool_calls or finish_reason
                        or (want_logprobs and logprobs)):
                    return out  # a parser holds the text back (a tool call in the making): no empty delta
            entry = ChatCompletionChunkChoice(index=choice.index, delta=message, finish_reason=finish_reason)
            if want_logprobs:
                entry.logprobs = self._chat_logprobs(update.token_ids, logprobs, as_ids)
            return [*out, entry]

        return self._stream(gen, request, ChatCompletionChunk, entries)

    def _chat_logprobs(self, token_ids: list[int], logprobs: list[TokenLogprobs], as_ids: bool = False) -> ChatLogprobs:
        """``as_ids``: tokens spelled ``token_id:N`` (vLLM's return_tokens_as_token_ids; bytes stay the token's)."""
        name = _token_id_name if as_ids else self._token_text
        content = []
        for token_id, entry in zip(token_ids, logprobs):
            top = [
                ChatTopLogprob(token=name(i), logprob=value, bytes=list(self.tokenizer.token_bytes(i)))
                for i, value in entry.top
            ]
            content.append(
                ChatLogprobToken(
                    token=name(token_id),
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
        raw_prompts = request.prompts()
        if self.gateway.filters_for(ctx.tenant):  # token-id prompts are screened as their text
            texts = [p if isinstance(p, str) else self.tokenizer.decode(p) for p in raw_prompts]
            await self.gateway.screen_input(ctx, texts, "prompt")
        ctx.trace.mark("rendered")  # nothing to render for a text completion
        whole = await self.text_pool.run_sized(
            text_size(raw_prompts),
            lambda: [self.processor.encode(p, add_special_tokens=request.add_special_tokens) for p in raw_prompts],
            ctx.tenant_name,
        )
        ctx.trace.mark("tokenized")
        prompts = [self.processor.truncate(p, request.truncate_prompt_tokens) for p in whole]
        for prompt_ids in prompts:
            self.processor.check_prompt(prompt_ids, "prompt")
        _note_deprecated(request, ctx)
        # Every prompt of a batch shares the parameters; the longest one decides the context check.
        params = self._params(request, max(prompts, key=len))
        gen = await self._start(ctx, "cmpl", prompts, params, request.priority, session_id=request.user,
                                cache_salt=request.cache_salt, param_names=request.param_names)
        echoes = None
        if request.echo:  # the caller's own text where it is whole, else the prompt's tokens decoded
            decode = self.tokenizer.decode
            echoes = [
                text if isinstance(text, str) and len(ids) == len(full) else decode(ids, skip_special_tokens=False)
                for text, ids, full in zip(raw_prompts, prompts, whole)
            ]
        if request.stream:
            return _sse(self._completion_stream(gen, request, echoes))
        return await _until_disconnect(self._completion_full(gen, request, echoes), raw)

    async def _completion_full(
        self, gen: _Generation, request: CompletionRequest, echoes: list[str] | None = None
    ) -> Response:
        """``echoes``: with echo, each prompt's text, put before its choices' text (and its tokens
        before theirs in logprobs)."""
        async for _ in self._updates(gen):
            pass
        want_logprobs = gen.params.logprobs is not None
        want_ids, as_ids = request.return_token_ids, request.return_tokens_as_token_ids
        choices = []
        for c in gen.state.in_order():
            prompt = gen.state.prompts[c.prompt_index]
            text, token_ids = c.stream.text, list(c.token_ids)
            logprobs: list[TokenLogprobs | None] = list(c.logprobs)
            if echoes is not None:
                text = echoes[c.prompt_index] + text
                token_ids = prompt + token_ids
                logprobs = [*self._echoed_logprobs(c, prompt, gen.params.logprobs), *logprobs]
            choices.append(
                CompletionChoice(
                    index=c.index,
                    text=text,
                    logprobs=self._completion_logprobs(token_ids, logprobs, 0, as_ids) if want_logprobs else None,
                    finish_reason=c.finish_reason,
                    token_ids=list(c.token_ids) if want_ids else None,
                    prompt_token_ids=prompt if want_ids else None,
                    prompt_logprobs=self._prompt_logprobs(c.prompt_logprobs, prompt),
                )
            )
        response = CompletionResponse(
            id=gen.response_id, created=gen.created, model=self.served_model_name, choices=choices, usage=gen.usage()
        )
        return JSONResponse(response.model_dump())

    def _completion_stream(
        self, gen: _Generation, request: CompletionRequest, echoes: list[str] | None = None
    ) -> AsyncIterator[str]:
        want_logprobs = gen.params.logprobs is not None
        want_ids, as_ids = request.return_token_ids, request.return_tokens_as_token_ids
        text_offset: dict[int, int] = {}  # characters already streamed per choice (logprobs.text_offset)
        started: set[int] = set()  # choices whose first chunk went out (with the prompt's ids)
        echoed: set[int] = set()  # choices whose prompt went out (on their first chunk, as vLLM)

        def entries(update: SequenceUpdate) -> list[CompletionChoice]:
            choice, delta, logprobs = update.seq, update.text, update.logprobs
            new_ids = update.token_ids if want_ids else []
            echo = echoes is not None and choice.index not in echoed
            # A token whose text is held back still gets its chunk (text ""), as in vLLM.
            changed = delta or choice.finished or (want_logprobs and logprobs) or new_ids or update.num_new_tokens
            if not (echo or changed):
                return []
            prompt = gen.state.prompts[choice.prompt_index]
            ids = list(update.token_ids)  # the tokens shown now (an output filter may hold some back)
            entry_logprobs: list[TokenLogprobs | None] = list(logprobs)
            if echo:
                assert echoes is not None
                echoed.add(choice.index)
                delta = echoes[choice.prompt_index] + delta
                ids = prompt + ids
                entry_logprobs = [*self._echoed_logprobs(choice, prompt, gen.params.logprobs), *entry_logprobs]
            entry = CompletionChoice(index=choice.index, text=delta, finish_reason=choice.finish_reason)
            if want_ids:  # vLLM's shape: the delta's ids, and the prompt's on a choice's first chunk
                entry.token_ids = list(new_ids)
                entry.prompt_token_ids = prompt if choice.index not in started else None
                started.add(choice.index)
            offset = text_offset.get(choice.index, 0)
            if want_logprobs:
                entry.logprobs = self._completion_logprobs(ids, entry_logprobs, offset, as_ids)
            text_offset[choice.index] = offset + len(delta)
            return [entry]

        return self._stream(gen, request, CompletionChunk, entries)

    def _completion_logprobs(
        self, token_ids: list[int], logprobs: Sequence[TokenLogprobs | None], offset: int, as_ids: bool = False
    ) -> CompletionLogprobs:
        """``as_ids``: tokens spelled ``token_id:N`` (vLLM's return_tokens_as_token_ids). A None entry
        (an echoed prompt's first token, which nothing precedes) has no logprob."""
        name = _token_id_name if as_ids else self._token_text
        result = CompletionLogprobs()
        for token_id, entry in zip(token_ids, logprobs):
            token = name(token_id)
            result.tokens.append(token)
            result.token_logprobs.append(None if entry is None else entry.logprob)
            result.top_logprobs.append(None if entry is None else {name(i): v for i, v in entry.top})
            result.text_offset.append(offset)
            offset += len(token)
        return result

    @staticmethod
    def _echoed_logprobs(seq: SequenceState, prompt: list[int], num_top: int | None) -> list[TokenLogprobs | None]:
        """An echoed prompt's entries in a choice's logprobs: its prompt logprobs, each with the top
        ``logprobs`` alternatives (the prompt's own may list more); None entries without them."""
        scores = seq.prompt_logprobs or [None] * len(prompt)
        return [None if e is None else TokenLogprobs(e.logprob, e.top[: num_top or 0], e.rank) for e in scores]

    def _prompt_logprobs(self, scores: list[TokenLogprobs | None] | None, prompt: list[int]) -> PromptLogprobs | None:
        """vLLM's ``prompt_logprobs``: per prompt token {id: {logprob, rank, decoded_token}} for the
        token itself and then the top k (a token among those appears once)."""
        if scores is None:
            return None
        out: PromptLogprobs = []
        for token_id, entry in zip(prompt, scores):
            if entry is None:
                out.append(None)
                continue
            ranked = {str(token_id): PromptLogprob(logprob=entry.logprob, rank=entry.rank,
                                                    decoded_token=self._token_text(token_id))}
            for rank, (top_id, value) in enumerate(entry.top, start=1):
                ranked.setdefault(str(top_id), PromptLogprob(logprob=value, rank=rank,
                                                             decoded_token=self._token_text(top_id)))
            out.append(ranked)
        return out

    # --- small helpers -------------------------------------------------------------------------

    async def _stream(
        self,
        gen: _Generation,
        request: ChatCompletionRequest | CompletionRequest,
        chunk_type: type[ChatCompletionChunk] | type[CompletionChunk],
        entries: Callable[[SequenceUpdate], list[Any]],
    ) -> AsyncIterator[str]:
        """The SSE frame both APIs share: one chunk per choice entry, the usage chunk, [DONE];
        an error after the headers went out becomes an error event."""
        include_usage, continuous = request.stream_include_usage, request.stream_continuous_usage
        frame = ChunkFrame(chunk_type, gen.response_id, gen.created, self.served_model_name, include_usage)

        try:
            async for updates in self._updates(gen):
                # One write per batch of engine outputs: the events are the same, the sends fewer.
                events = [
                    frame.event([entry], gen.usage() if continuous else None)
                    for update in updates
                    for entry in entries(update)
                ]
                if events:
                    yield "".join(events)
            if include_usage:
                yield frame.event([], gen.usage())
        except APIError as exc:
            yield _sse_event(exc.to_dict())
        yield "data: [DONE]\n\n"

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def _token_id_name(token_id: int) -> str:
    return f"token_id:{token_id}"


def _note_deprecated(request: ChatCompletionRequest | CompletionRequest, ctx: RequestContext) -> None:
    """guided_* work, but say where they went (vLLM deprecated them for structured_outputs)."""
    guided = request.guided_fields
    if guided:
        ctx.response_headers["Deprecation"] = "true"
        ctx.response_headers["Warning"] = f'299 - "{guided[0]} is deprecated; use structured_outputs"'


def _message_texts(messages: list[dict[str, Any]]) -> list[str]:
    """What the caller wrote in a chat: each message's text and the arguments of its tool calls."""
    texts = []
    for message in messages:
        if isinstance(message.get("content"), str):
            texts.append(message["content"])
        for call in message.get("tool_calls") or ():
            arguments = (call.get("function") or {}).get("arguments") if isinstance(call, dict) else None
            if isinstance(arguments, str):
                texts.append(arguments)
    return texts


def _shaped_delta(choice: SequenceState, delta: str) -> tuple[DeltaMessage, str | None]:
    """Split a chat choice's text delta into reasoning, content and tool-call pieces."""
    shaper = choice.chat_output
    assert shaper is not None
    piece = shaper.feed(delta)
    if choice.finished:
        piece = piece.merged(shaper.finish(truncated=choice.finish_reason == "length"))
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
    return message, shaper.finish_reason(choice.finish_reason)


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

