"""Conversations render as vLLM renders them, on every chat template tokenline ships: an agent's
tool loop (an assistant turn with ``content: null`` or no ``content`` and tool calls, then tool
results as text or as text parts) is shaped the way vLLM hands messages to a template before the
template sees it. The expected renders are the templates applied to the conversation written out
by hand in vLLM's shape, so the shaping is checked against vLLM's rules, not against itself."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from tokenline.frontend.chat_messages import content_format, conversation
from tokenline.frontend.processor import InputProcessor
from tokenline.frontend.qwen_vocab import QWEN_CHAT_TEMPLATE
from tokenline.frontend.tokenizer import Tokenizer

CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"SF"}'}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]

# What agent frameworks send on turn 2 and later (openai-agents, LangChain, pydantic-ai all do).
AGENT_LOOP = [
    {"role": "system", "content": "You answer with tools."},
    {"role": "user", "content": "Weather in SF?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "assistant", "tool_calls": [{**CALL, "id": "call_2"}]},  # no content key at all
    {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "sunny"},
                                                           {"type": "text", "text": "20 C"}]},
    {"role": "assistant", "content": "It is sunny.", "tool_calls": []},
    {"role": "user", "content": [{"type": "text", "text": "And"}, {"type": "text", "text": "tomorrow?"}]},
]

# The same conversation as vLLM's parse_chat_messages passes it to a "string"-format template.
VLLM_SHAPE = [
    {"role": "system", "content": "You answer with tools."},
    {"role": "user", "content": "Weather in SF?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "SF"}}}]},
    {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "SF"}}}]},
    {"role": "tool", "content": "sunny\n20 C", "tool_call_id": "call_2"},
    {"role": "assistant", "content": "It is sunny."},
    {"role": "user", "content": "And\ntomorrow?"},
]


def shipped_templates(default_model_dir: Path, qwen_tokenizer_dir: Path) -> dict[str, Tokenizer]:
    """Every chat template tokenline ships: the default model's (SmolLM2) and the test model's
    Qwen3-style template (``make-test-model``), each with its own tokenizer."""
    qwen = Tokenizer.from_dir(qwen_tokenizer_dir)
    assert qwen.chat_template == QWEN_CHAT_TEMPLATE
    return {"smollm2": Tokenizer.from_dir(default_model_dir), "qwen": qwen}


@pytest.fixture(scope="module")
def templates(default_model_dir: Path, qwen_tokenizer_dir: Path) -> dict[str, Tokenizer]:
    return shipped_templates(default_model_dir, qwen_tokenizer_dir)


def test_messages_take_vllms_shape() -> None:
    before = copy.deepcopy(AGENT_LOOP)
    assert conversation(AGENT_LOOP) == VLLM_SHAPE
    assert AGENT_LOOP == before  # the caller's messages are not modified
    # Arguments that are not JSON are no arguments; an object stays an object.
    broken = {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}
    assert conversation([broken])[0]["tool_calls"][0]["function"]["arguments"] == {}
    given = {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {"x": [1]}}}]}
    assert conversation([given])[0]["tool_calls"][0]["function"]["arguments"] == {"x": [1]}


@pytest.mark.parametrize("name", ["smollm2", "qwen"])
@pytest.mark.parametrize("with_tools", [False, True])
def test_an_agent_loop_renders_on_every_shipped_template(templates: dict[str, Tokenizer], name: str,
                                                         with_tools: bool) -> None:
    tokenizer = templates[name]
    tools = TOOLS if with_tools else None
    rendered = InputProcessor(tokenizer, {}, lambda: 4096).render_chat_text(AGENT_LOOP, tools=tools)
    assert rendered == tokenizer.apply_chat_template(VLLM_SHAPE, tools=tools)
    assert "None" not in rendered and "sunny\n20 C" in rendered


def test_a_template_that_loops_over_content_gets_parts() -> None:
    loops = "{% for m in messages %}{% for part in m['content'] %}[{{ part.text }}]{% endfor %}{% endfor %}"
    aliased = ("{% set turns = messages %}{% for m in turns %}{% if m.content is string %}{{ m.content }}"
               "{% else %}{% for p in m.content | list %}{{ p.text }}{% endfor %}{% endif %}{% endfor %}")
    assert content_format(loops) == content_format(aliased) == "openai"
    assert content_format(QWEN_CHAT_TEMPLATE) == "string"  # it reads parts through a macro argument
    assert content_format("{{ messages[0]['content'] }}") == "string"
    shaped = conversation(AGENT_LOOP, "openai")
    assert shaped[1]["content"] == [{"type": "text", "text": "Weather in SF?"}]
    assert shaped[2]["content"] == []  # null content: no parts
    assert shaped[5]["content"] == "sunny\n20 C"  # a tool result is text either way
    assert shaped[7]["content"] == [{"type": "text", "text": "And"}, {"type": "text", "text": "tomorrow?"}]


def test_a_content_looping_template_renders_string_content(default_model_dir: Path) -> None:
    tokenizer = Tokenizer.from_dir(default_model_dir)
    tokenizer.set_chat_template("{% for m in messages %}{% for part in m.content %}<{{ part.text }}>{% endfor %}"
                                "{% endfor %}")
    rendered = InputProcessor(tokenizer, {}, lambda: 4096).render_chat_text(AGENT_LOOP[:3], add_generation_prompt=False)
    assert rendered == "<You answer with tools.><Weather in SF?>"
