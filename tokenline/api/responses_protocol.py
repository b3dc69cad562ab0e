"""The OpenAI Responses API's request, and its mapping onto a chat completion request.

A Responses request is a chat request in another shape: ``instructions`` and ``input`` items
become messages, flat function tools become chat tools, ``text.format`` becomes
``response_format`` and ``reasoning.effort`` becomes ``reasoning_effort``. The server then runs it
through the chat path (template, parsers, tool grammar, gateway) and shapes the answer as output
items (``response_output.py``). Errors name the Responses field (``input[2].content``,
``max_output_tokens``), never the chat field it was mapped onto.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import Field, ValidationError

from tokenline.api.protocol import SEED_MAX, SEED_MIN, ChatCompletionRequest, _Request, _Unsupported, _unset
from tokenline.frontend.thinking import ReasoningEffort
from tokenline.gateway.errors import APIError, shorten, validation_error

__all__ = ["ResponsesRequest", "items_to_messages"]

_TEXT_PARTS = frozenset({"input_text", "output_text", "text", "summary_text", "reasoning_text"})
_ROLES = frozenset({"user", "system", "developer", "assistant"})


class TextConfig(_Request):
    format: dict[str, Any] | None = None  # {"type": "text" | "json_object" | "json_schema", ...}
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(_Request):
    effort: ReasoningEffort | None = None
    # The reasoning is returned whole (as reasoning_text content), never summarised.
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


# Fields that would change the output in ways this server does not implement.
UNSUPPORTED_RESPONSES_FIELDS: tuple[_Unsupported, ...] = (
    _Unsupported("background", lambda v: not v, "background responses"),
    _Unsupported("conversation", _unset, "conversations (use previous_response_id)"),
    _Unsupported("prompt", _unset, "prompt templates"),
    _Unsupported("max_tool_calls", _unset, "a tool-call budget"),
    _Unsupported("top_logprobs", lambda v: not v, "log probabilities"),
    _Unsupported("truncation", lambda v: v in (None, "disabled"), "truncating the conversation"),
    _Unsupported("context_management", _unset, "context management"),
)


VLLM_SAMPLING_EXTENSIONS = (
    "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "stop",
    "stop_token_ids", "ignore_eos", "min_tokens", "skip_special_tokens", "include_stop_str_in_output", "priority",
    "chat_template_kwargs", "cache_salt",
)


class ResponsesRequest(_Request):
    """POST /v1/responses."""

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)  # vLLM's extension, as on chat completions
    # vLLM's sampling extensions on its Responses API (`vllm bench serve --backend openai-responses`
    # sends ignore_eos): passed to the chat request as given, which validates them.
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    priority: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    cache_salt: str | None = None
    # Informational: accepted, echoed where OpenAI echoes them.
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    service_tier: str | None = None
    include: list[str] | None = None
    stream_options: dict[str, Any] | None = None
    # Accepted so that `check()` can refuse them by name.
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None
    truncation: str | None = None
    context_management: list[dict[str, Any]] | None = None

    _unsupported: ClassVar[tuple[_Unsupported, ...]] = UNSUPPORTED_RESPONSES_FIELDS

    def check(self) -> None:
        for entry in self._unsupported:
            if not entry.harmless(getattr(self, entry.field)):
                raise APIError.bad_request(
                    f"{entry.field} is not supported by this server ({entry.feature}); remove it from the request",
                    param=entry.field,
                )
        if "message.output_text.logprobs" in (self.include or []):
            raise APIError.bad_request("log probabilities are not supported by this server", param="include")
        if self.stream_options is not None and not self.stream:
            raise APIError.bad_request("stream_options is only allowed when stream is true", param="stream_options")
        if isinstance(self.input, list) and not self.input and self.previous_response_id is None:
            raise APIError.bad_request("input must not be empty", param="input")

    @property
    def effort(self) -> str | None:
        return self.reasoning.effort if self.reasoning is not None else None

    def input_items(self) -> list[dict[str, Any]]:
        """``input`` as items: a string is one user message."""
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": self.input}]
        return list(self.input)

    def to_chat(self, conversation: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat request this request means, over ``conversation`` (earlier turns, then this
        request's input items); ``instructions`` lead as a system message."""
        messages = items_to_messages(conversation, first_param_index=len(conversation) - len(self.input_items()))
        if self.instructions:
            messages.insert(0, {"role": "system", "content": self.instructions})
        if not messages:
            raise APIError.bad_request("input must not be empty", param="input")
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "stream": self.stream,
            "reasoning_effort": self.effort,
            "parallel_tool_calls": self.parallel_tool_calls,
        }
        body |= {name: value for name in VLLM_SAMPLING_EXTENSIONS if (value := getattr(self, name)) is not None}
        if self.tools:
            body["tools"] = chat_tools(self.tools)
        if self.tool_choice is not None:
            body["tool_choice"] = chat_tool_choice(self.tool_choice)
        if self.text is not None and self.text.format is not None:
            body["response_format"] = response_format(self.text.format)
        try:
            return _ResponsesChatRequest.model_validate(body)
        except ValidationError as exc:
            # Each part was checked above, so this is a shape we did not foresee: a 400 all the same.
            error = validation_error(exc.errors())
            # A vLLM extension passed through as given is named as sent; anything else is the input.
            param = error.param if error.param in VLLM_SAMPLING_EXTENSIONS else "input"
            raise APIError.bad_request(error.message, param=param) from exc


class _ResponsesChatRequest(ChatCompletionRequest):
    """A chat request made from a Responses request: its errors name the Responses fields."""

    @property
    def param_names(self) -> dict[str, str]:
        names = {"max_tokens": "max_output_tokens", "logprobs": "top_logprobs", "prompt": "input"}
        if self.response_format is not None:
            names |= {"structured_outputs": "text.format", "structured_outputs.json": "text.format.schema"}
        # Responses function tools are flat: no "function" level.
        names |= {f"tools[{i}].function.parameters": f"tools[{i}].parameters" for i in range(len(self.tools or []))}
        return names


# --- input items -> chat messages -------------------------------------------------------


def _text(content: Any, param: str) -> str:
    """A message's content as one string: a string, or text parts joined by newlines."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError.bad_request("content must be a string or a list of content parts", param=param)
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            raise APIError.bad_request(
                f"content part type {shorten(kind)!r} is not supported (this server takes text only: input_text, output_text)",
                param=f"{param}[{i}]",
            )
        if not isinstance(part.get("text"), str):
            raise APIError.bad_request("a text content part needs a string 'text'", param=f"{param}[{i}].text")
        texts.append(part["text"])
    return "\n".join(texts)


def items_to_messages(items: list[dict[str, Any]], first_param_index: int = 0) -> list[dict[str, Any]]:
    """Responses items as chat messages. Consecutive function calls (and the assistant text
    before them) make one assistant message with ``tool_calls``; a reasoning item becomes the
    ``reasoning_content`` of the assistant message that follows it. Errors name
    ``input[i - first_param_index]``: items before it came from stored responses."""
    messages: list[dict[str, Any]] = []
    reasoning: list[str] = []

    def assistant() -> dict[str, Any]:
        # The assistant message this item belongs to: the last one, unless a turn came between.
        last = messages[-1] if messages else None
        if last is None or last["role"] != "assistant" or last.get("_closed"):
            last = {"role": "assistant", "content": ""}
            messages.append(last)
        if reasoning:
            last["reasoning_content"] = "\n".join(reasoning)
            reasoning.clear()
        return last

    for i, item in enumerate(items):
        param = f"input[{i - first_param_index}]"
        if not isinstance(item, dict):
            raise APIError.bad_request("each input item must be an object", param=param)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise APIError.bad_request(
                    f"role must be one of user, system, developer, assistant, got {shorten(role)!r}", param=f"{param}.role"
                )
            if "content" not in item:
                raise APIError.bad_request("a message item needs content", param=f"{param}.content")
            text = _text(item["content"], f"{param}.content")
            if role == "assistant":
                message = assistant()
                if message["content"] or message.get("tool_calls"):  # text after calls: a new message
                    message["_closed"] = True
                    message = assistant()
                message["content"] = text
            else:
                # Most chat templates know no "developer" role; OpenAI treats it as the system's.
                messages.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise APIError.bad_request(f"a function_call item needs a string {key}", param=f"{param}.{key}")
            assistant().setdefault("tool_calls", []).append(
                {"id": item["call_id"], "type": "function",
                 "function": {"name": item["name"], "arguments": item["arguments"]}}
            )
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise APIError.bad_request("a function_call_output item needs a string call_id", param=f"{param}.call_id")
            output = item.get("output")
            text = output if isinstance(output, str) else _text(output, f"{param}.output")
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
        elif kind == "reasoning":
            # A reasoning item opens the assistant turn its thought led to.
            if messages and messages[-1]["role"] == "assistant":
                messages[-1]["_closed"] = True
            text = _text(item.get("content") or item.get("summary") or [], f"{param}.content")
            if text:
                reasoning.append(text)
        else:
            raise APIError.bad_request(
                f"input item type {shorten(kind)!r} is not supported (message, function_call, function_call_output "
                "and reasoning are)",
                param=f"{param}.type",
            )
    for message in messages:
        message.pop("_closed", None)
    return messages


# --- tools and formats --------------------------------------------------------------------


def chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Flat Responses function tools ``{type, name, description, parameters, strict}`` as chat tools."""
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise APIError.bad_request(
                f"tool type {shorten(kind)!r} is not supported; only function tools are", param=f"tools[{i}].type"
            )
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise APIError.bad_request("a function tool needs a name", param=f"tools[{i}].name")
        parameters = tool.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise APIError.bad_request("parameters must be a JSON schema object", param=f"tools[{i}].parameters")
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    """``"auto"`` / ``"none"`` / ``"required"`` / ``{"type": "function", "name"}`` in the chat shape."""
    if isinstance(choice, str):
        return choice  # the chat request checks the value
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise APIError.bad_request(
            'tool_choice must be none, auto, required or {"type": "function", "name": ...}', param="tool_choice"
        )
    return {"type": "function", "function": {"name": choice["name"]}}


def response_format(text_format: dict[str, Any]) -> dict[str, Any]:
    """``text.format`` as the chat ``response_format``."""
    kind = text_format.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        if not isinstance(text_format.get("name"), str):
            raise APIError.bad_request("a json_schema format needs a name", param="text.format.name")
        schema = text_format.get("schema")
        if schema is not None and not isinstance(schema, dict):
            raise APIError.bad_request("the schema must be a JSON object", param="text.format.schema")
        entry = {"name": text_format["name"], "schema": schema, "strict": text_format.get("strict")}
        return {"type": "json_schema", "json_schema": {k: v for k, v in entry.items() if v is not None}}
    raise APIError.bad_request(
        f"text.format type must be text, json_object or json_schema, got {json.dumps(kind)}", param="text.format.type"
    )
