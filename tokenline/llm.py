"""The offline API: ``LLM(model).generate(prompts, SamplingParams(...))`` and ``.chat(messages)``.

It drives one in-process ``EngineCore`` to completion through the same request processor as the
server (render, tokenize, check, fan out ``n``; detokenize, stop strings); the engine only sees
token ids.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenline.engine.config import EngineConfig

from tokenline.engine.factory import build_engine_core
from tokenline.engine.messages import RequestTimings, TokenLogprobs
from tokenline.frontend.processor import InputProcessor, PromptError
from tokenline.frontend.request_state import RequestState
from tokenline.frontend.tokenizer import Tokenizer
from tokenline.sampling_params import SamplingParams
from tokenline.store.model_store import resolve_model

Prompt = str | Sequence[int]
Message = dict[str, Any]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[TokenLogprobs] | None = None
    timings: RequestTimings | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    # With SamplingParams.prompt_logprobs: one entry per prompt token, None for the first.
    prompt_logprobs: list[TokenLogprobs | None] | None = None


class LLM:
    def __init__(
        self, model: str | Path | None = None, *, allow_special_tokens_in_content: bool = False, **engine_args: Any
    ) -> None:
        """``allow_special_tokens_in_content``: special-token strings in text prompts and message
        content become special tokens (as the server's flag of that name); by default they are text."""
        self.model_dir = resolve_model(model)
        self.tokenizer = Tokenizer.from_dir(self.model_dir)
        self.engine_config = EngineConfig(**engine_args)
        self.engine = build_engine_core(self.engine_config, self.model_dir, self.tokenizer.vocab_size)
        self.generation_config: dict[str, Any] = self.engine.runner.config.generation_config
        self.processor = InputProcessor(
            self.tokenizer, self.generation_config, lambda: self.engine.max_model_len,
            allow_special_tokens_in_content=allow_special_tokens_in_content,
        )
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt (text or token ids); returns outputs in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params_list = self._params_for(len(prompts), sampling_params)
        requests = [
            (prompt if isinstance(prompt, str) else None, self.processor.encode(prompt), params)
            for prompt, params in zip(prompts, params_list, strict=True)
        ]
        return self._run(requests)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Render each conversation with the model's chat template, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        params_list = self._params_for(len(conversations), sampling_params)
        requests = []
        for conversation, params in zip(conversations, params_list, strict=True):
            text = self.processor.render_chat_text(
                conversation,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tools=tools,
                chat_template_kwargs=chat_template_kwargs,
            )
            requests.append((text, self.processor.encode_rendered(text), params))
        return self._run(requests)

    # --- internals -----------------------------------------------------------------------------

    def _params_for(
        self, count: int, sampling_params: SamplingParams | Sequence[SamplingParams] | None
    ) -> list[SamplingParams]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * count
        if len(sampling_params) != count:
            raise ValueError(f"{len(sampling_params)} sampling params for {count} prompts")
        return list(sampling_params)

    def _run(self, requests: list[tuple[str | None, list[int], SamplingParams]]) -> list[RequestOutput]:
        states: list[tuple[str | None, RequestState]] = []
        try:
            for prompt, prompt_ids, params in requests:
                self.processor.check_prompt(prompt_ids, "prompt")
                params = self.processor.resolve(params, prompt_ids)
                state = self.processor.fan_out(f"{next(self._ids)}", [prompt_ids], params)
                states.append((prompt, state))  # before adding: a failure below aborts what went in
                for engine_request in state.engine_requests:
                    self.engine.add_request(engine_request)
                self._raise_failures()
            by_id = {request_id: state for _, state in states for request_id in state.request_ids}
            while self.engine.has_unfinished_requests():
                outputs = self.engine.step()
                self._raise_failures()
                for engine_output in outputs:
                    state = by_id[engine_output.request_id]
                    if state.absorb(engine_output).abort:
                        # A stop string ended the text: free the engine's work at once.
                        aborted = self.engine.abort_request(engine_output.request_id)
                        if aborted is not None:
                            state.absorb_final(aborted)
        finally:
            # On any error (or KeyboardInterrupt) leave nothing of ours running in the engine.
            for _, state in states:
                for request_id in state.running_in_engine():
                    self.engine.abort_request(request_id)
        return [_request_output(prompt, state) for prompt, state in states]

    def _raise_failures(self) -> None:
        """A request the engine removed (its grammar did not compile, or not in time) fails the call."""
        for failed in self.engine.take_failed_requests():
            raise PromptError(failed.param, failed.message)


def _request_output(prompt: str | None, state: RequestState) -> RequestOutput:
    outputs = [
        CompletionOutput(
            index=seq.index,
            text=seq.stream.text,
            token_ids=seq.token_ids,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            logprobs=seq.logprobs or None,
            timings=seq.engine_final.timings if seq.engine_final is not None else None,
        )
        for seq in state.in_order()
    ]
    usage = state.usage()
    first = state.in_order()[0]
    return RequestOutput(state.group_id, prompt, state.prompts[0], outputs, usage.cached_tokens, first.prompt_logprobs)
