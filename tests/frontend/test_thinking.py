"""reasoning_effort onto the chat template's thinking switch, rendered with real templates."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenline.frontend.processor import InputProcessor
from tokenline.frontend.thinking import has_thinking_switch, thinking_kwargs
from tokenline.frontend.tokenizer import Tokenizer

USER = [{"role": "user", "content": "hi"}]
CLOSED_THOUGHT = "<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_efforts_map_onto_the_switch() -> None:
    assert thinking_kwargs("none", None, True) == {"enable_thinking": False}
    assert thinking_kwargs("minimal", {"x": 1}, True) == {"x": 1, "enable_thinking": False}
    for effort in ("low", "medium", "high", "xhigh", "max"):
        assert thinking_kwargs(effort, None, True) == {"enable_thinking": True}
    assert thinking_kwargs("high", {"enable_thinking": False}, True) == {"enable_thinking": False}  # explicit wins
    assert thinking_kwargs("high", None, False) is None  # no switch: nothing changes
    assert thinking_kwargs(None, {"x": 1}, True) == {"x": 1}
    with pytest.raises(ValueError, match="reasoning effort"):
        thinking_kwargs("extreme", None, True)
    assert has_thinking_switch(["{% if enable_thinking %}x{% endif %}"])
    assert not has_thinking_switch(["{{ messages }}"])


def _processor(model_dir: Path) -> InputProcessor:
    return InputProcessor(Tokenizer.from_dir(model_dir), {}, lambda: 4096)


def test_qwen_template_renders_the_effort(qwen_tokenizer_dir: Path) -> None:
    processor = _processor(qwen_tokenizer_dir)
    assert processor.render_chat_text(USER, reasoning_effort="none").endswith(CLOSED_THOUGHT)
    assert not processor.render_chat_text(USER, reasoning_effort="high").endswith(CLOSED_THOUGHT)
    assert processor.render_chat_text(USER, reasoning_effort="high") == processor.render_chat_text(USER)


def test_template_without_switch_ignores_the_effort(default_model_dir: Path) -> None:
    processor = _processor(default_model_dir)
    plain = processor.render_chat_text(USER)
    assert processor.render_chat_text(USER, reasoning_effort="none") == plain
    assert processor.render_chat_text(USER, reasoning_effort="high") == plain
