"""ReasoningParser / split_reasoning: <think> blocks split off, whatever the delta boundaries."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import pytest

from tokenline.frontend.chat_template import render_chat_template
from tokenline.frontend.qwen_vocab import QWEN_CHAT_TEMPLATE
from tokenline.frontend.processor import InputProcessor
from tokenline.frontend.reasoning import REASONING_FORMATS, ReasoningParser, split_reasoning
from tokenline.frontend.tokenizer import Tokenizer


def run(deltas: Sequence[str], starts_in_reasoning: bool = False) -> tuple[str, str, list[tuple[str, str]]]:
    """Feed deltas, finish; return (reasoning, content, per-call outputs)."""
    parser = ReasoningParser(starts_in_reasoning=starts_in_reasoning)
    outputs = [parser.feed(d) for d in deltas]
    outputs.append(parser.finish())
    return "".join(r for r, _ in outputs), "".join(c for _, c in outputs), outputs


def all_splits(text: str) -> list[list[str]]:
    """Every cut into two deltas, every char on its own, and a few random cuts into many."""
    cuts = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    cuts.append(list(text))
    rng = random.Random(len(text))
    for _ in range(20):
        points = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, 5)))
        cuts.append([text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)])
    return cuts


CASES = [
    # (output, starts_in_reasoning, reasoning or None, content)
    ("<think>\nLet me think.\n</think>\n\nThe answer is 4.", False, "Let me think.", "The answer is 4."),
    ("<think>a\n\nb</think>c", False, "a\n\nb", "c"),
    ("no tags at all, just < and > and </thin", False, None, "no tags at all, just < and > and </thin"),
    ("I think <thinking> is not a tag", False, None, "I think <thinking> is not a tag"),
    ("Before <think>\nmid\n</think>\n\nafter", False, "mid", "Before after"),
    ("Already thinking.\n</think>\n\nDone.", True, "Already thinking.", "Done."),
    ("\nstill thinking, cut off\n\n", True, "still thinking, cut off", ""),
    ("<think>\nunterminated </thi", False, "unterminated </thi", ""),
    ("<think>\n\n</think>\n\nEmpty reasoning.", False, "", "Empty reasoning."),
    ("<think>x</think>\n\n", False, "x", ""),
    ("Content with a stray </think> and\nnewlines\n\n", False, None, "Content with a stray </think> and\nnewlines\n\n"),
    ("<think>多语言 😀 推理\n</think>\n\n答案：👨‍👩‍👧", False, "多语言 😀 推理", "答案：👨‍👩‍👧"),
    ("<think>one</think>mid<think>two</think>end", False, "onetwo", "midend"),
    # An answer that starts in the thought (DeepSeek-R1): a <think> the model writes first anyway
    # is the same thought opened again, not text of it.
    ("<think>\nI reason.\n</think>\n\nAnswer.", True, "I reason.", "Answer."),
    ("\n<think>x</think>y", True, "x", "y"),
    ("<think", True, "<think", ""),  # an incomplete tag is text
    ("<thinking> hmm</think>x", True, "<thinking> hmm", "x"),
    ("a <think> inside</think>b", True, "a <think> inside", "b"),
]


@pytest.mark.parametrize(("output", "starts", "reasoning", "content"), CASES)
def test_split_reasoning(output: str, starts: bool, reasoning: str | None, content: str) -> None:
    assert split_reasoning(output, starts_in_reasoning=starts) == (reasoning, content)


@pytest.mark.parametrize(("output", "starts", "reasoning", "content"), CASES)
def test_streaming_equals_whole_at_every_split(output: str, starts: bool, reasoning: str | None, content: str) -> None:
    for deltas in all_splits(output):
        got_reasoning, got_content, outputs = run(deltas, starts)
        assert (got_reasoning, got_content) == (reasoning or "", content), deltas
        for r, c in outputs:
            # A tag (or part of one) never reaches either stream.
            for piece in (r, c):
                assert "<think>" not in piece or "<think>" in (reasoning or "") + content


@pytest.mark.parametrize("tag", ["<think>", "</think>"])
def test_partial_tag_is_held_not_leaked(tag: str) -> None:
    prefix = "" if tag == "<think>" else "<think>"
    for k in range(1, len(tag)):
        parser = ReasoningParser()
        r0, c0 = parser.feed(prefix + "abc" + tag[:k])
        assert (r0 + c0).endswith("abc") and tag[:k] not in r0 + c0
        r1, c1 = parser.feed(tag[k:] + "xyz")
        r2, c2 = parser.finish()
        if tag == "<think>":
            assert (c0, r0 + r1 + r2, c1 + c2) == ("abc", "xyz", "")
        else:
            assert (r0, r1 + r2, c1 + c2) == ("abc", "", "xyz")


def test_content_streams_without_delay_and_reasoning_newlines_wait() -> None:
    parser = ReasoningParser()
    assert parser.feed("<think>\n") == ("", "")
    assert parser.feed("step 1\n") == ("step 1", "")  # the newline may precede </think>
    assert parser.feed("step 2") == ("\nstep 2", "")
    assert parser.feed("\n</think>\n\n") == ("", "")
    assert not parser.in_reasoning
    assert parser.feed("Answer\n") == ("", "Answer\n")
    assert parser.finish() == ("", "")


def test_feed_after_finish_raises() -> None:
    parser = ReasoningParser()
    parser.finish()
    with pytest.raises(RuntimeError):
        parser.feed("x")


@pytest.mark.parametrize("reasoning", ["Short.", "Line one.\n\nLine two.", "思考 😀"])
@pytest.mark.parametrize("content", ["Answer.", "Multi\nline\n\nanswer", ""])
def test_parses_back_what_the_template_renders(reasoning: str, content: str) -> None:
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": content, "reasoning_content": reasoning},
    ]
    rendered = render_chat_template(QWEN_CHAT_TEMPLATE, messages, add_generation_prompt=False)
    opening = "<|im_start|>assistant\n"
    generated = rendered[rendered.rindex(opening) + len(opening) : -len("<|im_end|>\n")]
    assert split_reasoning(generated) == (reasoning, content)
    # A template that opens <think> in the prompt leaves the model starting inside reasoning.
    assert split_reasoning(generated.removeprefix("<think>"), starts_in_reasoning=True) == (reasoning, content)


@pytest.mark.parametrize(("prompt_end", "inside"), [
    ("<｜Assistant｜><think>\n", True),  # the R1 template opens the thought
    ("<｜Assistant｜>", True),  # older R1 templates: the model opens it, or only closes it
    ("<｜Assistant｜><think>\n\n</think>\n\n", False),  # thinking switched off
])
def test_deepseek_r1_answers_start_in_the_thought_unless_the_prompt_closed_it(
    default_model_dir: Path, prompt_end: str, inside: bool
) -> None:
    tokenizer = Tokenizer.from_dir(default_model_dir)
    prompt = tokenizer.encode("<｜User｜>What is 2 + 2?" + prompt_end, add_special_tokens=False)
    deepseek = InputProcessor(tokenizer, {}, lambda: 4096, reasoning=REASONING_FORMATS["deepseek_r1"])
    qwen3 = InputProcessor(tokenizer, {}, lambda: 4096, reasoning=REASONING_FORMATS["qwen3"])
    assert deepseek.starts_in_reasoning(prompt) is inside
    assert qwen3.starts_in_reasoning(prompt) is prompt_end.endswith("<think>\n")
    # The chat answer is then split as vLLM's deepseek_r1 splits it: the thought up to </think>.
    parser = deepseek.chat_parser(False)(prompt)
    assert parser is not None
    parsed = parser.parse_all("2 + 2 is 4.\n</think>\n\nFour." if inside else "Four.")
    assert (parsed.reasoning, parsed.content) == (("2 + 2 is 4.", "Four.") if inside else (None, "Four."))
