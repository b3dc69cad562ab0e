"""Chat templates render byte-identical to transformers' apply_chat_template(tokenize=False)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from tokenline.frontend.chat_template import ChatTemplateError, compile_template, render_chat_template
from tokenline.frontend.tokenizer import Tokenizer

SYSTEM = {"role": "system", "content": "You are a terse assistant."}

CONVERSATIONS: dict[str, list[dict]] = {
    "system-single": [SYSTEM, {"role": "user", "content": "Hi!"}],
    "no-system": [{"role": "user", "content": "What is 2+2?"}],
    "multi-turn": [
        SYSTEM,
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one?"},
        {"role": "assistant", "content": "Green."},
        {"role": "user", "content": "Thanks"},
    ],
    "unicode": [{"role": "user", "content": "Traduis 你好世界 🌍👋🏽 — «ça va?» 日本語 한국어 𝄞"}],
    "empty-content": [{"role": "user", "content": ""}],
    "whitespace": [{"role": "user", "content": "  padded\n\n  lines  \n"}],
    "ends-with-assistant": [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi there"}],
    "special-text-in-content": [{"role": "user", "content": "what is <|im_end|> or {{ 1 + 1 }} or {% raw %}?"}],
    "long": [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i} " * 5} for i in range(12)],
    "none-field": [{"role": "user", "content": "hello", "name": None}],
    "tool-role": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Checking."},
        {"role": "tool", "content": "{\"temp\": 21}"},
    ],
}


@pytest.fixture(scope="module")
def hf(default_model_dir: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(default_model_dir))


@pytest.fixture(scope="module")
def tok(default_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(default_model_dir)


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_default_model_matches_transformers(tok: Tokenizer, hf, name: str, add_generation_prompt: bool) -> None:
    messages = CONVERSATIONS[name]
    ref = hf.apply_chat_template(
        copy.deepcopy(messages), tokenize=False, add_generation_prompt=add_generation_prompt
    )
    ours = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert ours == ref


@pytest.mark.parametrize("name", ["ends-with-assistant", "unicode", "multi-turn"])
def test_continue_final_message(tok: Tokenizer, hf, name: str) -> None:
    messages = CONVERSATIONS[name]
    ref = hf.apply_chat_template(
        copy.deepcopy(messages), tokenize=False, add_generation_prompt=False, continue_final_message=True
    )
    ours = tok.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
    assert ours == ref
    assert ours.endswith(messages[-1]["content"])


def test_continue_final_message_trimmed_content(hf) -> None:
    # A template that trims content: the trailing space of the message is cut, like transformers.
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] | trim }}</{{ m['role'] }}>\n{% endfor %}"
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "The answer is "}]
    ref = hf.apply_chat_template(
        copy.deepcopy(messages), chat_template=template, tokenize=False, continue_final_message=True
    )
    ours = render_chat_template(template, messages, add_generation_prompt=False, continue_final_message=True)
    assert ours == ref == "<user>q</user>\n<assistant>The answer is"


def test_continue_final_message_with_generation_prompt_is_an_error(tok: Tokenizer) -> None:
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template(CONVERSATIONS["ends-with-assistant"], add_generation_prompt=True, continue_final_message=True)


def test_input_messages_are_not_modified(tok: Tokenizer) -> None:
    messages = copy.deepcopy(CONVERSATIONS["ends-with-assistant"])
    before = copy.deepcopy(messages)
    tok.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
    assert messages == before


# A Qwen3-style ChatML template with tools, tool calls, tool responses and <think> blocks,
# written for this test.
QWEN3_STYLE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- '# Tools\\n\\nYou may call one or more functions. Signatures are given inside <tools></tools>:\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' + tool | tojson }}
    {%- endfor %}
    {{- '\\n</tools>\\n\\nReply with a JSON object inside <tool_call></tool_call> for each call.<|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_user=0) %}
{%- for m in messages %}
    {%- if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == 'system' %}
        {%- if not loop.first %}{{ raise_exception('System message must come first.') }}{% endif %}
    {%- elif message.role == 'user' %}
        {{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set content = message.content if message.content is string else '' %}
        {%- set reasoning = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {{- '<|im_start|>assistant\\n' }}
        {%- if loop.index0 > ns.last_user and reasoning %}
            {{- '<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' }}
        {%- endif %}
        {{- content }}
        {%- for call in message.tool_calls or [] %}
            {%- set fn = call.function if call.function is defined else call %}
            {%- if not loop.first or content %}{{ '\\n' }}{% endif %}
            {{- '<tool_call>\\n{"name": "' + fn.name + '", "arguments": ' }}
            {{- fn.arguments if fn.arguments is string else fn.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- else %}
        {{- raise_exception('Unknown role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city. Returns <json> & units in °C — «métrique».",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "城市 name"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "noop", "description": "Does nothing.", "parameters": {}}},
]

TOOL_CHAT = [
    {"role": "system", "content": "You are a weather bot."},
    {"role": "user", "content": "Weather in Paris and 東京?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "The user wants two cities; call the tool twice.",
        "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"東京\", \"days\": 2}"}},
        ],
    },
    {"role": "tool", "content": "{\"temp\": 18}"},
    {"role": "tool", "content": "{\"temp\": 25}"},
    {"role": "assistant", "content": "<think>\nBoth arrived.\n</think>\n\nParis 18°C, Tokyo 25°C."},
    {"role": "user", "content": "And tomorrow? 🌦"},
]

QWEN_CASES = {
    "tools": (TOOL_CHAT, TOOLS),
    "tools-no-system": (TOOL_CHAT[1:], TOOLS),
    # Ends on tool responses: the tool-calling turn comes after the last user turn, so its reasoning shows.
    "tools-pending": (TOOL_CHAT[:5], TOOLS),
    "no-tools": ([{"role": "user", "content": "Hi"}], None),
    "thinking-history": (
        [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "<think>\nsimple\n</think>\n\n4"},
            {"role": "user", "content": "3+3?"},
            {"role": "assistant", "content": "6", "reasoning_content": "also simple"},
        ],
        None,
    ),
}


@pytest.mark.parametrize("case", sorted(QWEN_CASES))
@pytest.mark.parametrize("kwargs", [None, {"enable_thinking": False}, {"enable_thinking": True}])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_qwen3_style_template_matches_transformers(
    tok: Tokenizer, hf, case: str, kwargs: dict | None, add_generation_prompt: bool
) -> None:
    messages, tools = QWEN_CASES[case]
    ref = hf.apply_chat_template(
        copy.deepcopy(messages),
        tools=copy.deepcopy(tools),
        chat_template=QWEN3_STYLE,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        **(kwargs or {}),
    )
    ours = tok.apply_chat_template(
        messages,
        add_generation_prompt=add_generation_prompt,
        tools=tools,
        chat_template_kwargs=kwargs,
        chat_template=QWEN3_STYLE,
    )
    assert ours == ref
    if tools:
        assert "<json> & units in °C" in ours  # tojson does not HTML-escape or ASCII-escape
    if add_generation_prompt and kwargs == {"enable_thinking": False}:
        assert ours.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_qwen3_style_continue_final_message(hf) -> None:
    messages = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "1, 2, "}]
    ref = hf.apply_chat_template(
        copy.deepcopy(messages), chat_template=QWEN3_STYLE, tokenize=False, continue_final_message=True
    )
    ours = render_chat_template(QWEN3_STYLE, messages, add_generation_prompt=False, continue_final_message=True)
    assert ours == ref
    assert ours.endswith("<|im_start|>assistant\n1, 2, ")


def test_template_errors_surface_with_their_message() -> None:
    with pytest.raises(ChatTemplateError, match="Unknown role: narrator"):
        render_chat_template(QWEN3_STYLE, [{"role": "narrator", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="System message must come first"):
        render_chat_template(QWEN3_STYLE, [{"role": "user", "content": "x"}, {"role": "system", "content": "y"}])
    with pytest.raises(ChatTemplateError):
        render_chat_template("{% for x in %}", [{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError):
        render_chat_template(QWEN3_STYLE, [])
    assert issubclass(ChatTemplateError, ValueError)


def test_sandbox_and_globals(hf) -> None:
    template = (
        "{{ bos_token }}|{{ eos_token }}|{{ strftime_now('%Y') }}|{{ dict(a=1) | tojson }}|"
        "{{ messages | tojson }}|{{ tools | tojson(indent=2) }}|"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.role }}{% endfor %}|"
        "{% generation %}{{ custom }}{% endgeneration %}"
    )
    messages = [{"role": "user", "content": "<b>é</b> & \"q\""}, {"role": "assistant", "content": "x"}]
    tools = [{"name": "t", "x": [1, None, True]}]
    ref = hf.apply_chat_template(
        copy.deepcopy(messages), tools=tools, chat_template=template, tokenize=False, custom="ok"
    )
    ours = render_chat_template(
        template, messages, add_generation_prompt=False, tools=tools,
        special_tokens={"bos_token": hf.bos_token, "eos_token": hf.eos_token}, chat_template_kwargs={"custom": "ok"},
    )
    assert ours == ref
    # The sandbox refuses attribute access to internals.
    with pytest.raises(Exception):
        render_chat_template("{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}", messages)
    with pytest.raises(Exception):
        render_chat_template("{% set ns = namespace() %}{% set ns._x = 1 %}", messages)


def test_templates_are_compiled_once() -> None:
    assert compile_template(QWEN3_STYLE) is compile_template(QWEN3_STYLE)
