"""Chat completions over HTTP (``/v1/chat/completions``, and what a Responses request becomes):
messages rendered with the chat template, tool calls and reasoning shaped into OpenAI messages and
deltas. The machinery chat shares with text completions is ``serving.OpenAIServing``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

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
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    TokenizeRequest,
    ToolCallItem,
)
from tokenline.api.serving import (
    OpenAIServing,
    ServingDeps,
    _Generation,
    _note_deprecated,
    _sse,
    _token_id_name,
    _until_disconnect,
)
from tokenline.engine.messages import TokenLogprobs
from tokenline.frontend.request_state import SequenceState, SequenceUpdate
from tokenline.frontend.text_pool import INLINE_MAX_CHARS, text_size
from tokenline.frontend.tool_calls import TOOL_CALL_END, TOOL_CALL_START
from tokenline.frontend.tool_grammar import tool_call_grammar
from tokenline.frontend.tool_parsers import HERMES, tool_call_format
from tokenline.gateway.errors import APIError
from tokenline.gateway.gateway import RequestContext
from tokenline.sampling_params import SamplingParamsError


class ChatServing(OpenAIServing):
    def __init__(self, deps: ServingDeps, tool_call_parser: str | None = None) -> None:
        """``tool_call_parser``: the ``--tool-call-parser`` name (None: tools are refused)."""
        super().__init__(deps)
        self.tool_call_parser = tool_call_parser
        self.tool_format = tool_call_format(tool_call_parser) if tool_call_parser else None

    # --- rendering ----------------------------------------------------------------------------

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
