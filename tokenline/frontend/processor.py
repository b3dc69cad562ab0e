"""The request processor's input side: prompt in, engine requests out. Used by the server and the
offline ``LLM`` alike, so both render, tokenize, check limits and fan out ``n`` the same way.

Text stops here: the engine receives token ids and resolved ``SamplingParams`` only. Every check
of a prompt against the model happens here, once, with one message per problem; the engine keeps
only a last-resort guard for callers that skip the processor.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tokenline.engine.context_window import CONTEXT_LENGTH_EXCEEDED, completion_overflow, prompt_overflow
from tokenline.engine.messages import EngineRequest
from tokenline.frontend.chat_messages import content_format, conversation
from tokenline.frontend.chat_output import ChatOutputParser
from tokenline.frontend.chat_template import ChatTemplateError
from tokenline.frontend.reasoning import QWEN3, THINK_END, THINK_START, ReasoningFormat
from tokenline.frontend.request_state import RequestState, SequenceState
from tokenline.frontend.text_stream import TextStream
from tokenline.frontend.thinking import has_thinking_switch, thinking_kwargs
from tokenline.frontend.tokenizer import Tokenizer
from tokenline.frontend.tool_parsers import ToolCallFormat
from tokenline.frontend.user_text import RenderedChat
from tokenline.sampling_params import SamplingParams, SamplingParamsError
from tokenline.structured_output.grammar import validate as validate_structured_outputs


# Makes the reasoning / tool-call parser of one choice, given its prompt's ids (None: plain text).
ChatParserFactory = Callable[[Sequence[int]], ChatOutputParser | None]


class PromptError(ValueError):
    """A request the model cannot serve as given; ``param`` names the field to blame."""

    def __init__(self, param: str, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class InputProcessor:
    def __init__(
        self,
        tokenizer: Tokenizer,
        generation_config: Mapping[str, Any],
        max_model_len: Callable[[], int],
        reasoning: bool | ReasoningFormat = False,
        allow_special_tokens_in_content: bool = False,
    ) -> None:
        """``max_model_len`` is asked when needed: a server learns it once its engine is ready.
        ``reasoning``: the model's answers start with a thought (a reasoning parser is on), in this
        format (True: Qwen3's). ``allow_special_tokens_in_content``: the operator's opt-in to
        tokenize special-token strings in message content and text prompts as special tokens (by
        default they are text)."""
        self.tokenizer = tokenizer
        self.generation_config = dict(generation_config)
        self._max_model_len = max_model_len
        self.reasoning_format = QWEN3 if reasoning is True else reasoning or None
        self.reasoning = self.reasoning_format is not None
        self.allow_special_tokens_in_content = allow_special_tokens_in_content

    @property
    def max_model_len(self) -> int:
        return self._max_model_len()

    # --- prompts -------------------------------------------------------------------------------

    def render_chat_text(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        reasoning_effort: str | None = None,
    ) -> RenderedChat:
        """The conversation rendered with the model's own chat template: text that also remembers
        where caller strings held special-token strings, for ``encode_rendered``. The messages
        are first shaped as vLLM hands them to templates (``chat_messages.conversation``).
        ``reasoning_effort`` sets the template's thinking switch, if it has one."""
        switch = has_thinking_switch(self.tokenizer.chat_templates.values())
        try:
            template = self.tokenizer.pick_template(tools or None)
            return self.tokenizer.render_chat(
                conversation(messages, content_format(template)),
                tools=tools or None,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template_kwargs=thinking_kwargs(reasoning_effort, chat_template_kwargs, switch),
                parse_special_tokens=self.allow_special_tokens_in_content,
            )
        except ChatTemplateError as exc:
            raise PromptError("messages", f"the chat template rejected the messages: {exc}") from exc
        except ValueError as exc:
            raise PromptError("messages", str(exc)) from exc

    def encode_rendered(self, text: str) -> list[int]:
        """Token ids of ``render_chat_text``'s text: the template's markup gives special tokens, the
        caller's text never does (the template already wrote any BOS it wants)."""
        return self.tokenizer.encode_chat(text)

    def encode(self, prompt: str | Sequence[int], add_special_tokens: bool = True) -> list[int]:
        """A text prompt tokenized (special-token strings in it are text unless the operator opted
        in), or a token-id prompt as a list (checked by ``check_prompt``)."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(
                prompt, add_special_tokens=add_special_tokens, parse_special_tokens=self.allow_special_tokens_in_content
            )
        return list(prompt)

    def truncate(self, prompt_ids: list[int], keep: int | None) -> list[int]:
        """vLLM's ``truncate_prompt_tokens``: the prompt's last ``keep`` tokens (-1: as many as the
        model's context holds; None: all of them). The prompt is checked afterwards, as it is."""
        if keep is None:
            return prompt_ids
        max_model_len = self.max_model_len
        if keep > max_model_len:
            raise PromptError(
                "truncate_prompt_tokens",
                f"truncate_prompt_tokens ({keep}) is greater than this model's context of {max_model_len} tokens",
            )
        return prompt_ids[-(max_model_len if keep == -1 else keep) :]

    def check_prompt(self, prompt_ids: Sequence[int], param: str) -> None:
        """The one check of a prompt against the model: not empty, ids in the vocabulary, room for
        at least one generated token in the context."""
        if not prompt_ids:
            raise PromptError(param, "the prompt is empty")
        vocab = self.tokenizer.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise PromptError(param, f"prompt token ids must be in [0, {vocab}); out of range: {bad[:5]}")
        overflow = prompt_overflow(len(prompt_ids), self.max_model_len)
        if overflow is not None:
            raise PromptError(param, overflow, code=CONTEXT_LENGTH_EXCEEDED)

    # --- parameters ----------------------------------------------------------------------------

    def resolve(
        self,
        params: SamplingParams,
        prompt_ids: Sequence[int],
        param_names: Mapping[str, str] | None = None,
        max_tokens_cap: int | None = None,
    ) -> SamplingParams:
        """Parameters as the engine will run them: fitted to the model (``fit``), then unset fields
        from the model's generation config."""
        return self.fit(params, prompt_ids, param_names, max_tokens_cap).with_defaults(self.generation_config)

    def fit(
        self,
        params: SamplingParams,
        prompt_ids: Sequence[int],
        param_names: Mapping[str, str] | None = None,
        max_tokens_cap: int | None = None,
    ) -> SamplingParams:
        """``max_tokens`` fitted to the context (unset: fill it; too large: refuse, as OpenAI does,
        rather than answer shorter than asked) and cut to the server's ``max_tokens_cap``, token
        ids checked against the vocabulary, and a
        structured-output constraint validated (and started after the reasoning, for an answer
        that begins inside ``<think>``). ``param_names`` maps SamplingParams' field names to the
        caller's (e.g. max_completion_tokens). For a batch of prompts, pass the longest."""
        names = dict(param_names or {})
        prompt_len = len(prompt_ids)
        room = self.max_model_len - prompt_len
        # The cap applies to the effective max_tokens: an omitted one (the context's room, or a
        # protocol default) is cut to it; an explicit one above it the gateway already refused.
        max_tokens = room if params.max_tokens is None else params.max_tokens
        if max_tokens_cap is not None:
            max_tokens = min(max_tokens, max_tokens_cap)
        overflow = completion_overflow(prompt_len, max_tokens, self.max_model_len)
        if overflow is not None:
            raise PromptError(names.get("max_tokens", "max_tokens"), overflow, code=CONTEXT_LENGTH_EXCEEDED)
        if max_tokens != params.max_tokens:
            params = self._replace(params, names, max_tokens=max_tokens)
        vocab = self.tokenizer.vocab_size
        if params.logit_bias and any(not 0 <= int(t) < vocab for t in params.logit_bias):
            raise PromptError("logit_bias", f"logit_bias token ids must be in [0, {vocab})")
        if any(not 0 <= t < vocab for t in params.stop_token_ids):
            raise PromptError("stop_token_ids", f"stop_token_ids must be in [0, {vocab})")
        if params.structured_outputs is not None:
            params = self._constrain(params, prompt_ids, names)
        return params

    def _constrain(self, params: SamplingParams, prompt_ids: Sequence[int], names: Mapping[str, str]) -> SamplingParams:
        spec = params.structured_outputs
        assert spec is not None
        try:
            validate_structured_outputs(spec)  # a bad schema is the caller's 400, before any engine work
        except SamplingParamsError as exc:
            raise PromptError(names.get(exc.param, exc.param), str(exc)) from exc
        think_end = self.tokenizer.token_to_id(THINK_END)
        if spec.start_after_token_id is None and self.reasoning and think_end is not None:
            if self.starts_in_reasoning(prompt_ids):
                # reasoning_content stays free text; the answer after </think> obeys the constraint.
                spec = dataclasses.replace(spec, start_after_token_id=think_end)
                params = dataclasses.replace(params, structured_outputs=spec)
        return params

    @staticmethod
    def _replace(params: SamplingParams, names: Mapping[str, str], **changes: Any) -> SamplingParams:
        try:
            return dataclasses.replace(params, **changes)
        except SamplingParamsError as exc:
            raise PromptError(names.get(exc.param, exc.param), str(exc)) from exc

    # --- fan-out -------------------------------------------------------------------------------

    def fan_out(
        self,
        group_id: str,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        priority: int = 0,
        client_request_id: str | None = None,
        chat_parser: ChatParserFactory | None = None,
        session_id: str | None = None,
        cache_salt: str | None = None,
        tenant: str | None = None,
    ) -> RequestState:
        """One engine request per prompt and per ``n``: ``{group_id}-{index}``. Each is generated on
        its own (the prefix cache shares the prompt's blocks); seeded children get distinct seeds.
        ``cache_salt`` and ``tenant`` scope the engine's caches (``EngineRequest``)."""
        sequences: dict[str, SequenceState] = {}
        requests: list[EngineRequest] = []
        for prompt_index, prompt_ids in enumerate(prompts):
            for j in range(params.n):
                index = prompt_index * params.n + j
                child = params.for_child(j)
                request_id = f"{group_id}-{index}"
                sequences[request_id] = SequenceState(
                    index=index,
                    request_id=request_id,
                    prompt_index=prompt_index,
                    stream=TextStream(self.tokenizer, child, prompt_ids),
                    chat_output=chat_parser(prompt_ids) if chat_parser is not None else None,
                )
                requests.append(
                    EngineRequest(
                        request_id, list(prompt_ids), child, priority=priority, client_request_id=client_request_id,
                        session_id=session_id, cache_salt=cache_salt, tenant=tenant,
                    )
                )
        return RequestState(group_id, [list(p) for p in prompts], params, sequences, requests)

    def chat_parser(self, tools: bool | ToolCallFormat, max_calls: int | None = None) -> ChatParserFactory:
        """A factory of per-choice reasoning / tool-call parsers for chat answers to a prompt;
        ``tools``: parse tool calls, in this format (True: Hermes', the forced-call grammar's);
        ``max_calls``: report at most this many tool calls (1 for ``parallel_tool_calls: false``)."""

        def make(prompt_ids: Sequence[int]) -> ChatOutputParser | None:
            if not (self.reasoning or tools):
                return None
            return ChatOutputParser(
                reasoning=self.reasoning,
                starts_in_reasoning=self.starts_in_reasoning(prompt_ids),
                tools=tools,
                max_calls=max_calls,
            )

        return make

    def starts_in_reasoning(self, prompt_ids: Sequence[int]) -> bool:
        """The answer starts inside reasoning when the prompt's last turn opened <think> without
        closing it (a template that opens it, or continue_final_message inside a thought); in a
        format whose answers start in a thought (DeepSeek-R1), unless the prompt ends by closing
        one (thinking switched off)."""
        tail = self.tokenizer.decode(list(prompt_ids[-256:]), skip_special_tokens=False)
        if self.reasoning_format is not None and self.reasoning_format.starts_in_thought:
            return not tail.rstrip().endswith(THINK_END)
        tail = tail[tail.rfind("<|im_start|>") + 1 :]
        return tail.rfind(THINK_START) > tail.rfind(THINK_END)
