"""What chat and text completions share over HTTP: the OpenAI protocol mapped onto the request
processor (``chat_serving.py`` and ``completion_serving.py`` are the two APIs).

One HTTP request becomes ``len(prompts) * n`` engine requests (the processor's fan-out) whose
outputs share one collector. These modules only map: requests to the processor's inputs, its
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
from fastapi.responses import Response, StreamingResponse

from tokenline.api.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    CompletionChunk,
    CompletionRequest,
    PromptLogprob,
    PromptLogprobs,
    UsageInfo,
    random_id,
)
from tokenline.api.sse import ChunkFrame
from tokenline.engine.client import EngineClient, EngineDeadError, EngineRequestError, OutputCollector
from tokenline.engine.messages import EngineOutput, TokenLogprobs
from tokenline.frontend.processor import ChatParserFactory, InputProcessor
from tokenline.frontend.request_state import RequestState, SequenceUpdate
from tokenline.frontend.text_pool import TextWorkPool
from tokenline.frontend.tokenizer import Tokenizer
from tokenline.frontend.tool_grammar import strict_schema
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


@dataclass(frozen=True)
class ServingDeps:
    """What every serving class is built on. ``served_model_name`` is the name responses report;
    requests may also name one of ``model_aliases``. ``text_pool``: the process's one pool for
    rendering and tokenizing off the event loop (frontend/text_pool.py)."""

    client: EngineClient
    processor: InputProcessor
    gateway: Gateway
    served_model_name: str
    text_pool: TextWorkPool
    request_timeout: float | None = None
    model_aliases: Sequence[str] = ()


class OpenAIServing:
    """What chat and text completions share (``ChatServing``, ``CompletionServing``): the checks, the
    sampling parameters, starting a generation, consuming its updates, the receipt and the SSE frame."""

    def __init__(self, deps: ServingDeps) -> None:
        self.client = deps.client
        self.processor = deps.processor
        self.tokenizer: Tokenizer = deps.processor.tokenizer
        self.gateway = deps.gateway
        self.served_model_name = deps.served_model_name
        self.model_names = frozenset([deps.served_model_name, *deps.model_aliases])
        self.request_timeout = deps.request_timeout
        self.text_pool = deps.text_pool
        self._background: set[asyncio.Task[None]] = set()

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

