"""The offline API: ``LLM(model).generate(prompts, SamplingParams(...))`` and ``.chat(messages)``.

It drives one in-process ``EngineCore`` to completion. Text is handled here (tokenize, chat
template, detokenize, stop strings); the engine only sees token ids.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenline.engine.config import EngineConfig, build_engine_core
from tokenline.engine.messages import EngineOutput, EngineRequest, FinishReason, RequestTimings, TokenLogprobs
from tokenline.frontend.text_stream import TextStream
from tokenline.frontend.tokenizer import Tokenizer
from tokenline.model.model_store import resolve_model
from tokenline.sampling_params import SamplingParams

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


@dataclass
class _Sequence:
    """Book-keeping for one of the n sequences of a prompt while it generates."""

    output: CompletionOutput
    stream: TextStream
    num_cached_tokens: int = 0
    done: bool = False
    token_logprobs: list[TokenLogprobs] = field(default_factory=list)


class LLM:
    def __init__(self, model: str | Path | None = None, **engine_args: Any) -> None:
        self.model_dir = resolve_model(model)
        self.tokenizer = Tokenizer.from_dir(self.model_dir)
        self.engine_config = EngineConfig(**engine_args)
        self.engine = build_engine_core(self.engine_config, self.model_dir, self.tokenizer.vocab_size)
        self.generation_config: dict[str, Any] = self.engine.runner.config.generation_config
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
        requests = []
        for prompt, params in zip(prompts, params_list, strict=True):
            if isinstance(prompt, str):
                requests.append((prompt, self.tokenizer.encode(prompt), params))
            else:
                requests.append((None, self._check_ids(list(prompt)), params))
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
            text = self.tokenizer.apply_chat_template(
                list(conversation),
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tools=tools,
                chat_template_kwargs=chat_template_kwargs,
            )
            # The template already wrote any BOS it wants; do not add another.
            requests.append((text, self.tokenizer.encode(text, add_special_tokens=False), params))
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

    def _check_ids(self, ids: list[int]) -> list[int]:
        vocab = self.tokenizer.vocab_size
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        return ids

    def _run(self, requests: list[tuple[str | None, list[int], SamplingParams]]) -> list[RequestOutput]:
        results: list[RequestOutput] = []
        sequences: dict[str, _Sequence] = {}
        added: list[str] = []
        try:
            for prompt, prompt_ids, params in requests:
                params = params.with_defaults(self.generation_config)
                parent = f"{next(self._ids)}"
                result = RequestOutput(parent, prompt, prompt_ids, [])
                for index in range(params.n):
                    # Each of the n sequences is its own engine request; the prefix cache shares
                    # the prompt's blocks between them. Seeds differ so the samples differ.
                    child = params.for_child(index)
                    request_id = f"{parent}-{index}"
                    output = CompletionOutput(index, "", [], None)
                    result.outputs.append(output)
                    sequences[request_id] = _Sequence(output, TextStream(self.tokenizer, child, prompt_ids))
                    self.engine.add_request(EngineRequest(request_id, prompt_ids, child))
                    added.append(request_id)
                results.append(result)
            while self.engine.has_unfinished_requests():
                for engine_output in self.engine.step():
                    self._absorb(sequences[engine_output.request_id], engine_output)
                for request_id, seq in sequences.items():
                    if seq.stream.stopped and not seq.done:
                        # A stop string ended the text: free the engine's work at once.
                        aborted = self.engine.abort_request(request_id)
                        if aborted is not None:
                            self._absorb(seq, aborted)
        finally:
            # On any error (or KeyboardInterrupt) leave nothing of ours running in the engine.
            for request_id in added:
                if not sequences[request_id].done:
                    self.engine.abort_request(request_id)
        for result in results:
            result.num_cached_tokens = max(
                (sequences[f"{result.request_id}-{o.index}"].num_cached_tokens for o in result.outputs), default=0
            )
        return results

    @staticmethod
    def _absorb(seq: _Sequence, engine_output: EngineOutput) -> None:
        output = seq.output
        # One token at a time: a speculative step brings several, and the ids must end where a
        # stop string ends the text, as they do when tokens come one per step.
        for token_id in engine_output.new_token_ids:
            if seq.stream.stopped:
                break
            output.token_ids.append(token_id)
            seq.stream.push([token_id])
        if engine_output.new_logprobs:
            seq.token_logprobs.extend(engine_output.new_logprobs)
        seq.num_cached_tokens = engine_output.num_cached_tokens
        if engine_output.finish_reason is None:
            return
        seq.done = True
        seq.stream.finish()
        output.text = seq.stream.text
        output.timings = engine_output.timings
        output.logprobs = seq.token_logprobs or None
        if seq.stream.stopped:
            output.finish_reason = FinishReason.STOP.value
            output.stop_reason = seq.stream.stop_string
        else:
            output.finish_reason = engine_output.finish_reason.value
            output.stop_reason = engine_output.stop_reason
