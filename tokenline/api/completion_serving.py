"""Text completions over HTTP (``/v1/completions``): prompts as text or token ids, echo, and
logprobs in the legacy completions shape. The machinery they share with chat is
``serving.OpenAIServing``."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tokenline.api.protocol import (
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from tokenline.api.serving import OpenAIServing, _Generation, _note_deprecated, _sse, _token_id_name, _until_disconnect
from tokenline.engine.messages import TokenLogprobs
from tokenline.frontend.request_state import SequenceState, SequenceUpdate
from tokenline.frontend.text_pool import text_size
from tokenline.gateway.gateway import RequestContext


class CompletionServing(OpenAIServing):
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
