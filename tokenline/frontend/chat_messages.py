"""Chat messages as vLLM hands them to a chat template, so a conversation renders the same here.

OpenAI clients send what the template cannot print as is: an assistant turn that only calls tools
carries ``"content": null`` (or no ``content``), tool results may be a list of text parts, and a
call's ``arguments`` is JSON text. vLLM normalises each message before rendering (its
``parse_chat_messages``), and templates are written against that shape:

- ``content`` becomes a string: text parts joined with newlines, ``null`` or missing as ``""`` —
  unless the template loops over ``message.content`` (a multimodal-style template): then every
  content is a list of ``{"type": "text", "text": ...}`` parts (``[]`` for ``null``), vLLM's
  "openai" content format. A tool result is a string either way.
- an assistant turn's ``tool_calls`` keep their order and ids; each call's ``arguments`` become
  an object (JSON text that is not an object's becomes ``{}``); an empty list is dropped.
- ``tool_call_id`` is kept on tool turns, ``name`` on any turn; reasoning on assistant turns.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from functools import lru_cache
from typing import Any, Literal

import jinja2.nodes

from tokenline.frontend.chat_template import ChatTemplateError, compile_template

__all__ = ["ContentFormat", "content_format", "conversation"]

ContentFormat = Literal["string", "openai"]

# Assistant fields a template may read for the turn's thought (chat_template.py mirrors them).
_REASONING_FIELDS = ("reasoning_content", "reasoning", "thinking")


@lru_cache(maxsize=64)
def content_format(template: str) -> ContentFormat:
    """``"openai"`` when the template iterates over a message's ``content`` (so it expects a list
    of parts), else ``"string"``; vLLM's ``--chat-template-content-format auto`` decides the same."""
    try:
        tree = compile_template(template).environment.parse(template)  # the rendering environment's syntax
    except ChatTemplateError:
        return "string"  # rendering will report the error
    message_names = set(_loop_targets(tree, _aliases(tree, "messages"), None))
    return "openai" if any(True for _ in _loop_targets(tree, message_names, "content")) else "string"


def conversation(messages: Sequence[Mapping[str, Any]], fmt: ContentFormat = "string") -> list[dict[str, Any]]:
    """The messages as the chat template sees them (see the module docstring); the input is not
    modified."""
    return [_message(m, fmt) for m in messages]


def _message(message: Mapping[str, Any], fmt: ContentFormat) -> dict[str, Any]:
    role = message.get("role")
    texts = _texts(message.get("content"))
    out: dict[str, Any] = {"role": role}
    if role == "tool" or fmt == "string":
        out["content"] = "\n".join(texts)
    else:
        out["content"] = [{"type": "text", "text": t} for t in texts]
    if role == "assistant":
        calls = message.get("tool_calls")
        if calls:
            out["tool_calls"] = [_tool_call(c) for c in calls]
        for field in _REASONING_FIELDS:
            if message.get(field) is not None:
                out[field] = message[field]
    elif role == "tool" and message.get("tool_call_id") is not None:
        out["tool_call_id"] = message["tool_call_id"]
    if isinstance(message.get("name"), str):
        out["name"] = message["name"]
    return out


def _texts(content: Any) -> list[str]:
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    # Text parts only reach here (the API refuses other part types).
    return [part["text"] for part in content if isinstance(part, Mapping) and isinstance(part.get("text"), str)]


def _tool_call(call: Any) -> Any:
    if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
        return call
    function = dict(call["function"])
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        # Templates print an object (tojson); text that is not JSON is no arguments at all.
        try:
            arguments = json.loads(arguments)
        except ValueError:
            arguments = {}
    elif not isinstance(arguments, (dict, list)):
        arguments = {}
    function["arguments"] = arguments
    return {**call, "function": function}


# --- which template variables hold messages, and which loops walk their content ------------------


def _reads(node: jinja2.nodes.Node, name: str, key: str | None) -> bool:
    """``node`` reads ``name`` (with ``key``: ``name.key`` / ``name['key']``), maybe through a
    filter, a test or a slice."""
    if isinstance(node, (jinja2.nodes.Filter, jinja2.nodes.Test)):
        return node.node is not None and _reads(node.node, name, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _reads(node.node, name, key)
    if key is None:
        return isinstance(node, jinja2.nodes.Name) and node.name == name
    if isinstance(node, jinja2.nodes.Getattr):
        return node.attr == key and _reads(node.node, name, None)
    if isinstance(node, jinja2.nodes.Getitem):
        return isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == key and _reads(node.node, name, None)
    return False


def _aliases(tree: jinja2.nodes.Template, name: str) -> set[str]:
    """``name`` and every variable assigned from it (``{% set ms = messages[1:] %}``)."""
    found, todo = {name}, deque([name])
    while todo:
        current = todo.popleft()
        for assign in tree.find_all(jinja2.nodes.Assign):
            target = assign.target
            fresh = isinstance(target, jinja2.nodes.Name) and target.name not in found
            if fresh and _reads(assign.node, current, None):
                found.add(target.name)
                todo.append(target.name)
    return found


def _loop_targets(tree: jinja2.nodes.Template, names: set[str], key: str | None) -> Iterator[str]:
    """The loop variables of ``{% for x in n %}`` (``n.key`` with ``key``) over any of ``names``."""
    for loop in tree.find_all(jinja2.nodes.For):
        if isinstance(loop.target, jinja2.nodes.Name) and any(_reads(loop.iter, n, key) for n in names):
            yield loop.target.name
