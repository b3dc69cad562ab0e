"""OpenAI-compatible request and response models, and the mapping of a request onto SamplingParams.

Requests reject unknown fields (as OpenAI does) and accept, then refuse in `check()`, fields that
would change the output in ways tokenline does not implement yet: a silently ignored `tools` or
`response_format` would hand the client an answer it did not ask for. `null` in a request means
"not given", so a field's default applies.

Responses serialize exactly like OpenAI's with a plain `model_dump()` / `model_dump_json()`: keys
that OpenAI always sends (`finish_reason`, `logprobs`, `content`) stay even when null, optional ones
(`reasoning_content`, `system_fingerprint`) are left out when null, and a chunk's `usage` appears
only when the server sets it (to a value or explicitly to None, as with `include_usage`).
"""

from __future__ import annotations

import math
import re
import time
import uuid
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal, NamedTuple

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

from tokenline.frontend.thinking import ReasoningEffort
from tokenline.gateway.errors import APIError, shorten
from tokenline.sampling_params import MAX_LOGPROBS, SamplingParams, SamplingParamsError, StructuredOutputs

__all__ = [
    "AssistantMessage",
    "ChatCompletionChunk",
    "ChatCompletionChunkChoice",
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "ChatCompletionResponseChoice",
    "ChatLogprobToken",
    "ChatLogprobs",
    "ChatMessage",
    "ChatTopLogprob",
    "CompletionChoice",
    "CompletionChunk",
    "CompletionLogprobs",
    "CompletionRequest",
    "CompletionResponse",
    "DeltaMessage",
    "DetokenizeRequest",
    "DetokenizeResponse",
    "ModelCard",
    "ModelList",
    "PromptLogprob",
    "PromptTokensDetails",
    "StreamOptions",
    "TokenizeRequest",
    "TokenizeResponse",
    "UsageInfo",
    "random_id",
]

MAX_N = 16  # OpenAI allows 128; more choices than this per request is a batch job, not a chat
MAX_STOP = 16  # OpenAI allows 4
MAX_CACHE_SALT_CHARS = 1024
MAX_COMPLETION_LOGPROBS = 5  # the legacy completions API's limit
# torch.Generator.manual_seed accepts exactly this range; outside it the sampler would crash.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
# JSON has no -inf; OpenAI reports an impossible token's logprob as -9999.0.
LOGPROB_FLOOR = -9999.0


def random_id(prefix: str) -> str:
    """A fresh response id such as ``chatcmpl-3f2a...`` (32 hex digits)."""
    return f"{prefix}-{uuid.uuid4().hex}"


def _now() -> int:
    return int(time.time())


def _invalid(reason: str) -> PydanticCustomError:
    # The reason goes in as context, not as the template, so braces in it are safe.
    return PydanticCustomError("invalid_value", "{reason}", {"reason": reason})


def _one_of(description: str) -> WrapValidator:
    """One clear error for a union, instead of pydantic's one error per member ("str", "list[str]")."""

    def validate(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise _invalid(f"must be {description}") from None

    return WrapValidator(validate)


def _finite_logprob(value: float) -> float:
    return LOGPROB_FLOOR if math.isnan(value) or value < LOGPROB_FLOOR else value


NonNegInt = Annotated[int, Field(ge=0)]
Logprob = Annotated[float, AfterValidator(_finite_logprob)]
StopField = Annotated[str | list[str] | None, _one_of("a string or a list of strings")]
PromptField = Annotated[
    str | list[str] | list[NonNegInt] | list[list[NonNegInt]],
    _one_of("a string, a list of strings, a list of token ids, or a list of lists of token ids"),
]


# --- requests -----------------------------------------------------------------------------


class _Request(BaseModel):
    # strict: "0.5" is not a number and true is not an integer, as OpenAI answers (ints still pass as floats).
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        # Clients send `"n": null`, `"stream": null` for "not set"; let the default apply rather
        # than fail on "Input should be a valid boolean". A required field has no default (it is
        # PydanticUndefined), so a null there is dropped and reported as missing.
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {
            k: v
            for k, v in data.items()
            if v is not None or k not in fields or (fields[k].default is None and fields[k].default_factory is None)
        }


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage on every chunk
    # OpenAI pads chunks with a random `obfuscation` field against length side channels; we do
    # not send it, which changes nothing a client reads, so the option is accepted and ignored.
    include_obfuscation: bool | None = None


Role = Literal["system", "developer", "user", "assistant", "tool"]


class ChatMessage(_Request):
    role: Role
    content: Annotated[
        str | list[dict[str, Any]] | None, _one_of("a string, a list of content parts, or null")
    ] = Field(None, validate_default=True)
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    # The openai SDK echoes these back when a client appends a response message to its history;
    # they carry nothing the prompt needs.
    refusal: str | None = None
    annotations: list[Any] | None = None

    @field_validator("content")
    @classmethod
    def _check_content(cls, content: Any, info: ValidationInfo) -> Any:
        role = info.data.get("role")
        if content is None and role in ("system", "developer", "user", "tool"):
            raise _invalid(f"a {role} message needs content")
        if isinstance(content, list):
            for i, part in enumerate(content):
                kind = part.get("type")
                if kind != "text":
                    raise _invalid(
                        f"content part {i} has type {shorten(kind)!r}; only 'text' parts are supported "
                        "(this server takes text input only)"
                    )
                if not isinstance(part.get("text"), str):
                    raise _invalid(f"content part {i} needs a string 'text'")
        return content

    def text(self) -> str | None:
        """The content as one string: text parts joined by newlines (as vLLM does)."""
        if isinstance(self.content, list):
            return "\n".join(part["text"] for part in self.content)
        return self.content


def _template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    # Flatten content parts to a string: most chat templates (SmolLM2's among them) print
    # `message['content']` as is and would render a list of parts as Python's repr.
    out = []
    for message in messages:
        data = message.model_dump(exclude_none=True, exclude={"refusal", "annotations"})
        if isinstance(message.content, list):
            data["content"] = message.text()
        out.append(data)
    return out


class _Unsupported(NamedTuple):
    """A request field tokenline refuses unless its value is one that changes nothing."""

    field: str
    harmless: Callable[[Any], bool]
    feature: str


def _unset(value: Any) -> bool:
    return value is None


# Fields that change the output and are not implemented yet. Remove an entry as its feature lands.
UNSUPPORTED_CHAT_FIELDS: tuple[_Unsupported, ...] = (
    _Unsupported("tools", lambda v: not v, "tool calling"),
    _Unsupported("tool_choice", lambda v: v in (None, "none"), "tool calling"),
    _Unsupported("functions", lambda v: not v, "function calling"),
    _Unsupported("function_call", lambda v: v in (None, "none"), "function calling"),
    _Unsupported("prediction", _unset, "predicted outputs"),
    _Unsupported("audio", _unset, "audio output"),
    _Unsupported("modalities", lambda v: v is None or v == ["text"], "non-text output"),
    _Unsupported("verbosity", _unset, "verbosity control"),
    _Unsupported("web_search_options", _unset, "web search"),
)
UNSUPPORTED_COMPLETION_FIELDS: tuple[_Unsupported, ...] = (
    _Unsupported("suffix", lambda v: not v, "insertion (suffix)"),
)
# Older vLLM's spelling of structured_outputs (deprecated there too): each an alias of one kind.
GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
# vLLM's names for its structured-output engines (guided_decoding_backend).
VLLM_DECODING_BACKENDS = ("auto", "xgrammar", "guidance", "outlines", "lm-format-enforcer")


class StructuredOutputsField(_Request):
    """vLLM's ``structured_outputs``: exactly one constraint on what may be generated."""

    json_schema: dict[str, Any] | str | None = Field(None, alias="json")  # a JSON schema
    json_object: bool | None = None  # any JSON object
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark (llguidance's dialect)

    def to_spec(self) -> StructuredOutputs:
        try:
            return StructuredOutputs(
                json=self.json_schema, json_object=bool(self.json_object), regex=self.regex, choice=self.choice,
                grammar=self.grammar,
            )
        except SamplingParamsError as exc:
            raise APIError.bad_request(str(exc), param=exc.param) from exc


def _response_format_spec(response_format: dict[str, Any]) -> StructuredOutputs | None:
    """OpenAI's ``response_format``: text (no constraint), json_object, or json_schema."""
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    if kind == "json_schema":
        entry = response_format.get("json_schema")
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise APIError.bad_request(
                'response_format json_schema must be {"name": ..., "schema": {...}, "strict": ...}',
                param="response_format.json_schema",
            )
        schema = entry.get("schema")
        if schema is None:
            return StructuredOutputs(json_object=True)  # OpenAI: no schema, any JSON object
        if not isinstance(schema, dict):
            raise APIError.bad_request("the schema must be a JSON object", param="response_format.json_schema.schema")
        return StructuredOutputs(json=schema)
    raise APIError.bad_request(
        f"response_format type must be text, json_object or json_schema, got {shorten(kind)!r}", param="response_format"
    )


class _GenerationRequest(_Request):
    """Fields shared by /v1/chat/completions and /v1/completions."""

    model: str
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None  # keys are token ids as strings
    n: int = Field(1, ge=1, le=MAX_N)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: StopField = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    user: str | None = None  # informational
    # vLLM extensions.
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[NonNegInt] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = 0  # lower is served earlier, as in vLLM
    structured_outputs: StructuredOutputsField | None = None
    # vLLM's: the prompt's own logprobs, the prompt kept to its last k tokens, logprob tokens
    # spelled "token_id:N", and the prompt (completions) or the last message (chat) echoed.
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None
    return_tokens_as_token_ids: bool = False
    echo: bool = False
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # Which of vLLM's engines enforces the constraint: here llguidance always does, and the
    # constraint holds the same, so any of vLLM's names is accepted; an unknown one is a 400.
    guided_decoding_backend: str | None = None
    # Not supported (it would change which outputs the constraint allows): a 400 when set.
    guided_whitespace_pattern: str | None = None
    # vLLM's: prompts reuse cached prefixes only with the same salt (within the tenant's own cache).
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)

    _unsupported: ClassVar[tuple[_Unsupported, ...]] = ()

    @field_validator("prompt_logprobs")
    @classmethod
    def _check_prompt_logprobs(cls, value: int | None) -> int | None:
        if value is not None and not 0 <= value <= MAX_LOGPROBS:
            whole = "; -1 (the whole vocabulary) is not supported" if value == -1 else ""
            raise _invalid(f"must be in [0, {MAX_LOGPROBS}]{whole}")
        return value

    @field_validator("guided_decoding_backend")
    @classmethod
    def _check_guided_decoding_backend(cls, value: str | None) -> str | None:
        if value is not None and value not in VLLM_DECODING_BACKENDS:
            raise _invalid(f"must be one of {', '.join(VLLM_DECODING_BACKENDS)} (llguidance enforces it either way)")
        return value

    @field_validator("guided_whitespace_pattern")
    @classmethod
    def _check_guided_whitespace_pattern(cls, value: str | None) -> str | None:
        if value is not None:
            raise _invalid("is not supported: tokenline cannot hold JSON whitespace to a pattern")
        return value

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _check_truncate_prompt_tokens(cls, value: int | None) -> int | None:
        if value is not None and value != -1 and value < 1:
            raise _invalid("must be -1 (keep the model's context) or at least 1")
        return value

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOP:
            raise _invalid(f"at most {MAX_STOP} stop sequences are allowed, got {len(stops)}")
        if any(s == "" for s in stops):
            # An empty stop string would match before the first token.
            raise _invalid("stop sequences must not be empty")
        return stop

    @property
    def stream_include_usage(self) -> bool:
        """Send a final chunk with usage (and `usage: null` on the others)."""
        return self.stream and self.stream_options is not None and self.stream_options.include_usage

    @property
    def stream_continuous_usage(self) -> bool:
        """Send usage so far on every chunk (vLLM's `continuous_usage_stats`)."""
        options = self.stream_options
        return self.stream_include_usage and options is not None and options.continuous_usage_stats

    def check(self, allow: frozenset[str] = frozenset()) -> None:
        """Refuse what the models accept but tokenline cannot honour; raises `APIError` (400).
        ``allow`` names fields the server does support for this model (tools with a tool parser)."""
        for entry in self._unsupported:
            if entry.field not in allow and not entry.harmless(getattr(self, entry.field)):
                raise APIError.bad_request(
                    f"{entry.field} is not supported by this server yet ({entry.feature}); remove it from the request",
                    param=entry.field,
                )
        if self.stream_options is not None and not self.stream:
            raise APIError.bad_request(
                "stream_options is only allowed when stream is true", param="stream_options"
            )
        if self.stream and self.prompt_logprobs:  # as vLLM: a stream has no place for them
            raise APIError.bad_request("prompt_logprobs are not available when stream is true", param="prompt_logprobs")

    def _logit_bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            if not re.fullmatch(r"-?\d+", key):
                raise APIError.bad_request(
                    f"logit_bias keys must be token ids (integers as strings), got {shorten(key)!r}", param="logit_bias"
                )
            bias[int(key)] = value
        return bias

    @property
    def param_names(self) -> dict[str, str]:
        """This request's names for SamplingParams' fields, where they differ (for error messages)."""
        raise NotImplementedError

    @property
    def guided_fields(self) -> list[str]:
        """The deprecated guided_* constraint fields this request sets."""
        return [name for name in GUIDED_FIELDS if getattr(self, name) is not None]

    def _guided_param_names(self) -> dict[str, str]:
        """Errors about the constraint name the guided_* field that gave it."""
        guided = self.guided_fields
        if not guided:
            return {}
        return {"structured_outputs": guided[0], f"structured_outputs.{guided[0].removeprefix('guided_')}": guided[0]}

    def structured_spec(self) -> StructuredOutputs | None:
        """The constraint the request asks for, if any: structured_outputs or one guided_* alias."""
        guided = self.guided_fields
        if len(guided) > 1:
            raise APIError.bad_request(f"only one of {', '.join(guided)} may be set", param=guided[1])
        if guided and self.structured_outputs is not None:
            raise APIError.bad_request(
                f"{guided[0]} and structured_outputs cannot both be set ({guided[0]} is the deprecated "
                f"spelling of structured_outputs.{guided[0].removeprefix('guided_')})",
                param=guided[0],
            )
        if guided:
            name = guided[0]
            try:
                return StructuredOutputs(**{name.removeprefix("guided_"): getattr(self, name)})
            except SamplingParamsError as exc:
                raise APIError.bad_request(str(exc), param=name) from exc
        return self.structured_outputs.to_spec() if self.structured_outputs is not None else None

    def _sampling_params(
        self, *, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None
    ) -> SamplingParams:
        """Map onto SamplingParams; the request processor then fits ``max_tokens`` to the context
        (unset: up to the context). The caller runs check() first (with what this server supports)."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        try:
            return SamplingParams(
                n=self.n,
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=self.top_k,
                min_p=self.min_p,
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                repetition_penalty=self.repetition_penalty,
                logit_bias=self._logit_bias(),
                seed=self.seed,
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                stop_token_ids=list(self.stop_token_ids or []),
                stop=stop,
                include_stop_str_in_output=self.include_stop_str_in_output,
                ignore_eos=self.ignore_eos,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                skip_special_tokens=self.skip_special_tokens,
                structured_outputs=self.structured_spec(),
            )
        except SamplingParamsError as e:
            # SamplingParams names its own fields; report the request's name for them.
            raise APIError.bad_request(str(e), param=self.param_names.get(e.param, e.param)) from e


class ChatCompletionRequest(_GenerationRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    max_tokens: int | None = Field(None, ge=1)  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = Field(None, ge=1)
    # Informational: accepted and ignored.
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    parallel_tool_calls: bool | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # Accepted so that `check()` can refuse them by name (see UNSUPPORTED_CHAT_FIELDS).
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    # Mapped onto the chat template's thinking switch where it has one (frontend/thinking.py).
    reasoning_effort: ReasoningEffort | None = None
    verbosity: str | None = None
    web_search_options: dict[str, Any] | None = None
    # vLLM chat-template extensions.
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    _unsupported: ClassVar[tuple[_Unsupported, ...]] = UNSUPPORTED_CHAT_FIELDS

    def check(self, tools_enabled: bool = False) -> None:
        """``tools_enabled``: the server parses tool calls for this model (``--tool-call-parser``)."""
        if tools_enabled:
            self._check_tools()
        super().check(allow=frozenset({"tools", "tool_choice"}) if tools_enabled else frozenset())
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError.bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
        if self.continue_final_message and self.add_generation_prompt:
            raise APIError.bad_request(
                "continue_final_message and add_generation_prompt cannot both be true "
                "(set add_generation_prompt to false to continue the final message)",
                param="continue_final_message",
            )

    def template_messages(self) -> list[dict[str, Any]]:
        """The messages as dicts for the chat template: nulls dropped, text parts joined."""
        return _template_messages(self.messages)

    def _check_tools(self) -> None:
        """Validate `tools` and `tool_choice`, then stop refusing them."""
        names = []
        for i, tool in enumerate(self.tools or []):
            function = tool.get("function") if isinstance(tool, dict) else None
            if tool.get("type") != "function" or not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise APIError.bad_request(
                    'each tool must be {"type": "function", "function": {"name": ..., "parameters": ...}}',
                    param=f"tools[{i}]",
                )
            names.append(function["name"])
        choice = self.tool_choice
        if isinstance(choice, dict):
            name = (choice.get("function") or {}).get("name")
            if choice.get("type") != "function" or name not in names:
                raise APIError.bad_request(f"tool_choice names no tool of this request: {shorten(name)!r}", param="tool_choice")
        elif choice not in (None, "none", "auto", "required"):
            raise APIError.bad_request("tool_choice must be none, auto, required or a named function", param="tool_choice")
        if choice is not None and choice != "none" and not names:
            raise APIError.bad_request("tool_choice needs tools", param="tool_choice")


    @property
    def requested_max_tokens(self) -> int | None:
        """max_completion_tokens wins over the deprecated max_tokens."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def param_names(self) -> dict[str, str]:
        """This request's names for SamplingParams' fields, for error messages."""
        max_tokens = "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
        names = {"max_tokens": max_tokens, "logprobs": "top_logprobs", "prompt": "messages"}
        names |= self._guided_param_names()
        if self.response_format is not None:  # the constraint came from response_format
            names |= {"structured_outputs": "response_format",
                      "structured_outputs.json": "response_format.json_schema.schema"}
        return names

    def structured_spec(self) -> StructuredOutputs | None:
        """response_format or vLLM's structured_outputs (one of them); tool_choice's grammar is
        the server's to add (it knows the tool-call format)."""
        if self.response_format is not None and self.structured_outputs is not None:
            raise APIError.bad_request(
                "response_format and structured_outputs cannot both be set", param="structured_outputs"
            )
        if self.response_format is not None and self.guided_fields:
            name = self.guided_fields[0]
            raise APIError.bad_request(f"response_format and {name} cannot both be set", param=name)
        if self.response_format is not None:
            try:
                return _response_format_spec(self.response_format)
            except SamplingParamsError as exc:
                raise APIError.bad_request(str(exc), param="response_format") from exc
        return super().structured_spec()

    def to_sampling_params(self) -> SamplingParams:
        """Map onto the engine's SamplingParams; raises `APIError` (400) naming the offending field."""
        return self._sampling_params(
            max_tokens=self.requested_max_tokens,
            logprobs=(self.top_logprobs or 0) if self.logprobs else None,
            prompt_logprobs=self.prompt_logprobs,
        )

    def echo_text(self) -> str:
        """vLLM's chat ``echo``: the last message's text goes before the answer when that message
        has the role being answered (the assistant's, or with add_generation_prompt false, its own)."""
        if not self.echo:
            return ""
        last = self.messages[-1]
        role = "assistant" if self.add_generation_prompt else last.role
        return (last.text() or "") if last.role == role else ""


class CompletionRequest(_GenerationRequest):
    """POST /v1/completions (the legacy text completions API)."""

    prompt: PromptField
    max_tokens: int = Field(16, ge=0)  # 0 only with echo: the prompt scored, nothing generated
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    suffix: str | None = None
    add_special_tokens: bool = True  # vLLM: add BOS etc. when tokenizing a text prompt
    # vLLM's: each choice carries its token ids (deltas when streaming) and the prompt's (the first
    # chunk of a stream). A router in front speaks these (and return_tokens_as_token_ids).
    return_token_ids: bool = False

    _unsupported: ClassVar[tuple[_Unsupported, ...]] = UNSUPPORTED_COMPLETION_FIELDS

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, prompt: Any) -> Any:
        if isinstance(prompt, list):
            if not prompt:
                raise _invalid("must not be empty")
            if any(isinstance(p, list) and not p for p in prompt):
                raise _invalid("a list of token ids must not be empty")
        return prompt

    def check(self) -> None:
        super().check()
        if self.max_tokens == 0 and not self.echo:
            raise APIError.bad_request(
                "max_tokens must be at least 1 (0 only with echo, which returns the prompt without generating)",
                param="max_tokens",
            )
        if self.best_of is not None and self.best_of != self.n:
            # best_of > n means sampling extra candidates and ranking them, which we do not do.
            raise APIError.bad_request(
                f"best_of is only supported when equal to n (got best_of={self.best_of}, n={self.n})",
                param="best_of",
            )

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a batch: each entry is text or token ids; each gets `n` choices."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

    @property
    def requested_max_tokens(self) -> int | None:
        """max_tokens as the client sent it; None when omitted (the default of 16 applies, cut to
        the server's cap, not refused by it)."""
        return self.max_tokens if "max_tokens" in self.model_fields_set else None

    @property
    def param_names(self) -> dict[str, str]:
        return self._guided_param_names()  # otherwise the same names as SamplingParams

    def to_sampling_params(self) -> SamplingParams:
        """Map onto the engine's SamplingParams (shared by every prompt of the batch); raises `APIError` (400).
        With echo, logprobs cover the prompt too (vLLM: prompt_logprobs default to logprobs)."""
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is None and self.echo:
            prompt_logprobs = self.logprobs
        return self._sampling_params(
            max_tokens=self.max_tokens, logprobs=self.logprobs, prompt_logprobs=prompt_logprobs
        )


class TokenizeRequest(_Request):
    """POST /tokenize: either `prompt` or `messages` (rendered with the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # None: add them for a text prompt, not for messages (the template already writes BOS).
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None  # rendered into the prompt as a chat with them would be
    return_token_strs: bool = False  # vLLM's: each token's vocabulary string too

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise APIError.bad_request("give exactly one of prompt or messages", param="prompt")
        if self.messages is not None and not self.messages:
            raise APIError.bad_request("messages must not be empty", param="messages")
        if self.messages is not None and self.continue_final_message and self.add_generation_prompt:
            raise APIError.bad_request(
                "continue_final_message and add_generation_prompt cannot both be true",
                param="continue_final_message",
            )

    @property
    def use_special_tokens(self) -> bool:
        if self.add_special_tokens is not None:
            return self.add_special_tokens
        return self.prompt is not None

    def template_messages(self) -> list[dict[str, Any]]:
        return _template_messages(self.messages or [])


class DetokenizeRequest(_Request):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[NonNegInt]


# --- responses ----------------------------------------------------------------------------


class _Response(BaseModel):
    # Keys OpenAI leaves out when they have no value (others are sent as null).
    _drop_if_none: ClassVar[frozenset[str]] = frozenset()
    # Keys left out unless the server set them, even to None (a chunk's `usage`).
    _drop_if_unset: ClassVar[frozenset[str]] = frozenset()

    @model_serializer(mode="wrap")
    def _openai_shape(self, handler: SerializerFunctionWrapHandler) -> Any:
        data = handler(self)
        if isinstance(data, dict):
            for key in self._drop_if_none:
                if key in data and data[key] is None:
                    del data[key]
            for key in self._drop_if_unset:
                if key in data and data[key] is None and key not in self.model_fields_set:
                    del data[key]
        return data


class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class UsageInfo(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int | None = None  # computed when not given
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)

    @model_validator(mode="after")
    def _total(self) -> UsageInfo:
        if self.total_tokens is None:
            self.total_tokens = self.prompt_tokens + self.completion_tokens
        return self

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> UsageInfo:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        )


class ChatTopLogprob(_Response):
    token: str
    logprob: Logprob
    bytes: list[int] | None = None  # the token's UTF-8 bytes (a token may hold part of a character)


class ChatLogprobToken(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Response):
    content: list[ChatLogprobToken] | None = None


class FunctionCall(_Response):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallItem(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(_Response):
    _drop_if_none: ClassVar[frozenset[str]] = frozenset({"name", "arguments"})

    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_Response):
    """A piece of a streamed tool call: the first carries id and name, later ones argument text."""

    _drop_if_none: ClassVar[frozenset[str]] = frozenset({"id", "type"})

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class AssistantMessage(_Response):
    """A choice's `message` in a chat completion. `reasoning_content` is what DeepSeek-style
    clients read, `reasoning` what newer vLLM clients read; both carry the same text."""

    _drop_if_none: ClassVar[frozenset[str]] = frozenset({"reasoning_content", "reasoning", "tool_calls"})

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallItem] | None = None


class DeltaMessage(_Response):
    """A chunk's `delta`: only what is new (an empty dict on the final chunk)."""

    _drop_if_none: ClassVar[frozenset[str]] = frozenset(
        {"role", "content", "reasoning_content", "reasoning", "tool_calls"}
    )

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class PromptLogprob(_Response):
    """One token's entry in vLLM's ``prompt_logprobs`` (keyed by its id)."""

    logprob: Logprob
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's prompt_logprobs: per prompt token, None for the first, else {token id: entry} for the
# prompt's own token and the top k at that position.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class ChatCompletionResponseChoice(_Response):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None  # "stop", "length", ...


class ChatCompletionResponse(_Response):
    _drop_if_none: ClassVar[frozenset[str]] = frozenset({"system_fingerprint", "prompt_logprobs"})

    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # with prompt_logprobs (vLLM's extension)


class ChatCompletionChunkChoice(_Response):
    index: int
    delta: DeltaMessage = Field(default_factory=DeltaMessage)
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Response):
    """One SSE event of a streamed chat completion; every chunk of a stream shares id and created."""

    _drop_if_none: ClassVar[frozenset[str]] = frozenset({"system_fingerprint"})
    _drop_if_unset: ClassVar[frozenset[str]] = frozenset({"usage"})

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionChunkChoice] = Field(default_factory=list)
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class CompletionLogprobs(_Response):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[Logprob | None] = Field(default_factory=list)  # None for an echoed first token
    top_logprobs: list[dict[str, Logprob] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Response):
    """A choice in a completion response and in a completion chunk (OpenAI uses one shape)."""

    _drop_if_none: ClassVar[frozenset[str]] = frozenset({"token_ids", "prompt_token_ids", "prompt_logprobs"})

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None  # with return_token_ids (vLLM's extension)
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: PromptLogprobs | None = None  # with prompt_logprobs, or echo with logprobs (vLLM's)


class CompletionResponse(_Response):
    _drop_if_none: ClassVar[frozenset[str]] = frozenset({"system_fingerprint"})

    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class CompletionChunk(_Response):
    _drop_if_none: ClassVar[frozenset[str]] = frozenset({"system_fingerprint"})
    _drop_if_unset: ClassVar[frozenset[str]] = frozenset({"usage"})

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice] = Field(default_factory=list)
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class ModelCard(_Response):
    _drop_if_none: ClassVar[frozenset[str]] = frozenset({"root", "max_model_len"})

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "tokenline"
    root: str | None = None  # the model's directory, as vLLM reports it
    max_model_len: int | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class TokenizeResponse(_Response):
    _drop_if_none: ClassVar[frozenset[str]] = frozenset({"token_strs"})

    tokens: list[int]
    count: int
    max_model_len: int | None  # None while the model is loading
    token_strs: list[str] | None = None  # with return_token_strs: the vocabulary's string of each token


class DetokenizeResponse(_Response):
    prompt: str

