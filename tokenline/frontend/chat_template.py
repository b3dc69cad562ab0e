"""Render a model's own Jinja chat template, byte-identical to transformers' `apply_chat_template`.

The template is untrusted code from the model directory, so it runs in jinja2's immutable sandbox
with the same environment options, globals and filters transformers gives it: templates are
written against that environment, and any difference (a `tojson` that escapes `<`, blocks that
keep their newlines) changes the prompt the model sees.
"""

from __future__ import annotations

import codecs
import dataclasses
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["ChatTemplateError", "compile_template", "load_chat_template", "plain_data", "render_chat_template"]


class ChatTemplateError(ValueError):
    """The chat template refused the conversation (``raise_exception``, an unknown role, ...)."""


# Names under which a message's reasoning may arrive; templates read `reasoning_content`
# (Qwen3, DeepSeek) or `thinking` (gpt-oss), so each message gets both, as transformers does.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

# Appended to the final message for continue_final_message; everything from it on is cut away.
# The trailing space lets us notice templates that strip trailing whitespace from content.
_CONTINUE_TAG = "TOKENLINE_CONTINUE_FINAL_MESSAGE "


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson HTML-escapes <, >, & and ' and sorts keys; chat templates expect plain
    # json.dumps output (tool schemas are shown to the model verbatim).
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationExtension(jinja2.ext.Extension):
    """Accept `{% generation %}...{% endgeneration %}` (assistant-mask markers) and render the body as is."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


class _SafeDict:
    """`dict(...)` for templates, without exposing the `dict` type itself to the sandbox."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _SafeNamespace(jinja2.utils.Namespace):
    """A Jinja namespace that refuses underscore attributes (no reaching into CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - mirrors Namespace's signature trick
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _SafeNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _SafeNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates may not set namespace attribute {name!r}")


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationExtension, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _SafeDict()
    env.globals["namespace"] = _SafeNamespace
    return env


def load_chat_template(value: str) -> str:
    """vLLM's ``--chat-template``: a file's contents, or the value itself when it is an inline
    template (it has ``{``, ``}`` or a newline, and ``\\n`` escapes are decoded, as vLLM does).
    Raises ``ValueError`` for a path-like value naming no file, ``ChatTemplateError`` for a
    template that does not compile."""
    path = Path(value).expanduser()
    try:
        is_file = path.is_file()
    except OSError:  # an inline template may be longer than a file name can be
        is_file = False
    if is_file:
        template = path.read_text(encoding="utf-8")
    elif any(c in value for c in "{}\n"):
        # A shell cannot pass a newline easily, so "\\n" stands for one (only in ASCII text,
        # which the decoder reads as Latin-1).
        template = codecs.decode(value, "unicode_escape") if value.isascii() else value
    else:
        raise ValueError(f"--chat-template {value!r} is neither a file nor an inline Jinja template")
    compile_template(template)  # a broken template fails at start-up, not on the first request
    return template


@lru_cache(maxsize=64)
def compile_template(template: str) -> jinja2.Template:
    """Compile a chat template once; later calls with the same source reuse it."""
    try:
        return _environment().from_string(template)
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"chat template does not compile: {e}") from e


def _plain(value: Any) -> Any:
    """Rebuild caller data out of plain JSON-like types before the sandbox sees it.

    Pydantic models and dataclasses become dicts; str/int/float subclasses (enums) lose their
    methods; anything else becomes an inert `<TypeName>` placeholder, as transformers does.
    """
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    if hasattr(value, "item") and type(value).__module__ == "numpy":
        return _plain(value.item())
    return f"<{type(value).__name__}>"


def plain_data(value: Any) -> Any:
    """Caller data rebuilt out of plain JSON-like types, as the template will see it."""
    return _plain(value)


def _prepare_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for raw in messages:
        message = _plain(raw)
        if not isinstance(message, dict):
            raise ChatTemplateError(f"chat messages must be dicts, got {raw!r}")
        # OpenAI clients send `content: null`, `tool_calls: null`; templates handle a missing key
        # but would print "None" for a present one.
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            # Same key order as transformers, since a template may dump the whole message.
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _tag_final_message(chat: list[dict[str, Any]], field: str, template: str) -> str:
    """Append the continue tag to the final message's `field`; return the original text."""
    if not chat:
        raise ChatTemplateError("continue_final_message is set but the conversation is empty")
    final = chat[-1].get(field)
    if final is None:
        raise ChatTemplateError(f'continue_final_message is set but the final message has no "{field}"')
    fields = [field]
    if field in _REASONING_FIELDS:
        fields = [f for f in _REASONING_FIELDS if chat[-1].get(f) == final]
    if not any(f in template for f in fields):
        raise ChatTemplateError(f'continue_final_message: the chat template never reads "{field}"')
    if isinstance(final, (list, tuple)):
        # Multimodal content: continue the last text block.
        for block in reversed(final):
            if isinstance(block, dict) and "text" in block:
                text = block["text"]
                block["text"] = text + _CONTINUE_TAG
                return text
        raise ChatTemplateError("continue_final_message is set but the final message has no text block")
    for f in fields:
        chat[-1][f] = chat[-1][f] + _CONTINUE_TAG
    return final


def render_chat_template(
    template: str,
    messages: Sequence[Any],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool | str = False,
    tools: Sequence[Mapping[str, Any]] | None = None,
    documents: Sequence[Mapping[str, Any]] | None = None,
    special_tokens: Mapping[str, str] | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """Render `messages` with `template` exactly as transformers' `apply_chat_template(tokenize=False)`.

    `special_tokens` (bos_token, eos_token, ...) and `chat_template_kwargs` (e.g. `enable_thinking`)
    become template variables; `chat_template_kwargs` win when both name the same variable.
    `continue_final_message` (True, or the name of the field to continue) leaves the final message
    open so the model continues it; it cannot be combined with `add_generation_prompt`.
    """
    if continue_final_message and add_generation_prompt:
        raise ChatTemplateError("continue_final_message and add_generation_prompt are not compatible")
    if len(messages) == 0:
        raise ChatTemplateError("cannot apply a chat template to an empty conversation")
    compiled = compile_template(template)

    chat = _prepare_messages(messages)
    variables: dict[str, Any] = dict(_plain(dict(special_tokens or {})))
    variables.update(_plain(dict(chat_template_kwargs or {})))
    # These four are set last: a kwarg of the same name must not shadow them (transformers passes
    # them as explicit arguments to render()).
    variables["messages"] = chat
    variables["tools"] = _plain(list(tools)) if tools is not None else None
    variables["documents"] = _plain(list(documents)) if documents is not None else None
    variables["add_generation_prompt"] = add_generation_prompt

    final_text: str | None = None
    if continue_final_message:
        field = continue_final_message if isinstance(continue_final_message, str) else "content"
        final_text = _tag_final_message(chat, field, template)

    try:
        rendered = compiled.render(**variables)
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(e.message or str(e)) from e

    if final_text is not None:
        tag = _CONTINUE_TAG.strip()
        if final_text.strip() not in rendered or tag not in rendered:
            raise ChatTemplateError(
                "continue_final_message is set but the final message does not appear in the rendered chat"
            )
        at = rendered.rindex(tag)
        if rendered[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
            rendered = rendered[:at]
        else:
            # The template trimmed the content's trailing whitespace (and our tag's space with it),
            # so trailing whitespace before the tag is the template's doing: drop it as well.
            rendered = rendered[:at].rstrip()
    return rendered
