"""Tool-call parsing, whole and streamed, for <tool_call>{"name": ..., "arguments": {...}}</tool_call>."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Sequence

import pytest

from tokenline.frontend.chat_template import render_chat_template
from tokenline.frontend.qwen_vocab import QWEN_CHAT_TEMPLATE
from tokenline.frontend.reasoning import ReasoningParser, split_reasoning
from tokenline.frontend.tool_calls import (
    ContentDelta,
    StreamEvent,
    ToolCallArgumentsDelta,
    ToolCallStart,
    ToolCallStreamParser,
    parse_tool_calls,
)

ID = re.compile(r"call_[0-9a-f]{24}")


def call(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


def collect(events: Sequence[StreamEvent]) -> tuple[str, list[tuple[str, str]]]:
    """Content and (name, arguments) per call from a stream; checks event order and ids."""
    content: list[str] = []
    calls: list[list[str]] = []
    for event in events:
        if isinstance(event, ContentDelta):
            assert event.text
            content.append(event.text)
        elif isinstance(event, ToolCallStart):
            assert event.index == len(calls) and ID.fullmatch(event.id)
            calls.append([event.name, ""])
        else:
            assert isinstance(event, ToolCallArgumentsDelta)
            # Arguments only ever extend the call that was announced last.
            assert event.index == len(calls) - 1 and event.arguments
            calls[-1][1] += event.arguments
    return "".join(content), [(name, args) for name, args in calls]


def stream(deltas: Sequence[str]) -> tuple[str, list[tuple[str, str]]]:
    parser = ToolCallStreamParser()
    events: list[StreamEvent] = []
    for delta in deltas:
        events += parser.feed(delta)
    events += parser.finish()
    return collect(events)


def whole(text: str) -> tuple[str, list[tuple[str, str]]]:
    content, calls = parse_tool_calls(text)
    for c in calls:
        assert ID.fullmatch(c.id)
    return content, [(c.name, c.arguments_json) for c in calls]


def all_splits(text: str) -> list[list[str]]:
    cuts = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    cuts.append(list(text))
    rng = random.Random(len(text))
    for _ in range(30):
        points = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, 6)))
        cuts.append([text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)])
    return cuts


WEATHER = '{"city": "Paris", "unit": "c"}'
NESTED = '{"query": {"filters": [{"k": "a}b"}, {"k": "</tool"}], "limit": 5}, "text": "多语言 😀"}'
CASES: list[tuple[str, str, list[tuple[str, str]]]] = [
    # (output, content, calls)
    ("Just an answer, no tools.", "Just an answer, no tools.", []),
    (call("get_weather", WEATHER), "", [("get_weather", WEATHER)]),
    ("Let me check.\n\n" + call("get_weather", WEATHER), "Let me check.", [("get_weather", WEATHER)]),
    (
        call("get_weather", WEATHER) + "\n" + call("get_time", "{}") + "\n" + call("search", NESTED),
        "",
        [("get_weather", WEATHER), ("get_time", "{}"), ("search", NESTED)],
    ),
    ("A " + call("f", "{}") + "\n\n B\n", "AB\n", [("f", "{}")]),
    # Malformed blocks stay content, as written, whitespace included.
    ("x\n<tool_call>\n{not json}\n</tool_call>\ny", "x\n<tool_call>\n{not json}\n</tool_call>\ny", []),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    ('<tool_call>{"name": 3, "arguments": {}}</tool_call>', '<tool_call>{"name": 3, "arguments": {}}</tool_call>', []),
    ("<tool_call>[1, 2]</tool_call> " + call("ok", "{}"), "<tool_call>[1, 2]</tool_call>", [("ok", "{}")]),
    # Other layouts are parsed whole: arguments first, missing, or double-encoded.
    ('<tool_call>{"arguments": {"a": 1}, "name": "g"}</tool_call>', "", [("g", '{"a": 1}')]),
    ('<tool_call>{"name": "g"}</tool_call>', "", [("g", "{}")]),
    ('<tool_call>{"name": "g", "arguments": "{\\"a\\": 1}"}</tool_call>', "", [("g", '{"a": 1}')]),
    # Stopped right after the JSON, before </tool_call> (or inside it).
    ('<tool_call>\n{"name": "g", "arguments": {"a": 1}}', "", [("g", '{"a": 1}')]),
    ('<tool_call>\n{"name": "g", "arguments": {"a": 1}}\n</tool', "", [("g", '{"a": 1}')]),
    ("text <tool_call>\n{broken", "text <tool_call>\n{broken", []),
    ("ends with a partial tag <tool_ca", "ends with a partial tag <tool_ca", []),
    ("<tool_call> is mentioned but </tool_call> never used", "<tool_call> is mentioned but </tool_call> never used", []),
]


@pytest.mark.parametrize(("output", "content", "calls"), CASES)
def test_parse_tool_calls(output: str, content: str, calls: list[tuple[str, str]]) -> None:
    assert whole(output) == (content, calls)


@pytest.mark.parametrize(("output", "content", "calls"), CASES)
def test_stream_equals_whole_at_every_split(output: str, content: str, calls: list[tuple[str, str]]) -> None:
    for deltas in all_splits(output):
        assert stream(deltas) == (content, calls), deltas


def test_a_call_is_sent_whole_once_it_closes() -> None:
    parser = ToolCallStreamParser()
    assert parser.feed("Sure.\n\n<tool") == [ContentDelta("Sure.")]
    assert parser.feed('_call>\n{"name": "get_weather", ') == []
    # Until </tool_call> the length limit may still cut the call off: nothing of it is sent.
    assert parser.feed('"arguments": {"city": "Paris"}}\n</tool_') == []
    events = parser.feed("call>")
    assert isinstance(events[0], ToolCallStart) and events[0].name == "get_weather" and events[0].index == 0
    assert events[1:] == [ToolCallArgumentsDelta(0, '{"city": "Paris"}')]
    assert parser.finish() == []
    assert parser.num_calls == 1


# (output, content, calls) when the length limit ended the output: an unterminated block was cut
# off, so it is content even where its JSON happens to be complete; closed calls before it count.
TRUNCATED: list[tuple[str, str, list[tuple[str, str]]]] = [
    ('<tool_call>\n{"name": "g", "arguments": {"a": 1', '<tool_call>\n{"name": "g", "arguments": {"a": 1', []),
    ('<tool_call>\n{"name": "g", "arguments": {"a": 1}}\n</tool',
     '<tool_call>\n{"name": "g", "arguments": {"a": 1}}\n</tool', []),
    (call("f", "{}") + '\n<tool_call>\n{"name": "g", "argu', '<tool_call>\n{"name": "g", "argu', [("f", "{}")]),
    ("Sure. " + call("f", WEATHER), "Sure.", [("f", WEATHER)]),
]


@pytest.mark.parametrize(("output", "content", "calls"), TRUNCATED)
def test_a_call_cut_off_by_the_length_limit_is_content(output: str, content: str, calls: list[tuple[str, str]]) -> None:
    got_content, got_calls = parse_tool_calls(output, truncated=True)
    assert (got_content, [(c.name, c.arguments_json) for c in got_calls]) == (content, calls)
    for deltas in all_splits(output):
        parser = ToolCallStreamParser()
        events = [e for d in deltas for e in parser.feed(d)] + parser.finish(truncated=True)
        assert collect(events) == (content, calls), deltas


def test_partial_opening_tag_is_held_never_leaked() -> None:
    tag = "<tool_call>"
    for k in range(1, len(tag)):
        parser = ToolCallStreamParser()
        first = collect(parser.feed("hello " + tag[:k]))
        assert first == ("hello", [])
        rest = parser.feed(tag[k:] + '{"name": "f", "arguments": {}}</tool_call>') + parser.finish()
        assert collect(rest) == ("", [("f", "{}")])


def test_calls_after_reasoning() -> None:
    """Reasoning is split off first; a <tool_call> inside it is not a call."""
    output = (
        "<think>\nI could write <tool_call> here but it is only thought.\n</think>\n\n"
        "I'll look it up.\n" + call("get_weather", WEATHER) + "\n" + call("get_time", "{}")
    )
    for deltas in all_splits(output):
        reasoning_parser, tool_parser = ReasoningParser(), ToolCallStreamParser()
        reasoning: list[str] = []
        events: list[StreamEvent] = []
        for delta in [*deltas, None]:
            r, c = reasoning_parser.feed(delta) if delta is not None else reasoning_parser.finish()
            reasoning.append(r)
            events += tool_parser.feed(c) if delta is not None else tool_parser.feed(c) + tool_parser.finish()
        assert "".join(reasoning) == "I could write <tool_call> here but it is only thought."
        assert collect(events) == ("I'll look it up.", [("get_weather", WEATHER), ("get_time", "{}")])


def test_parses_back_what_the_template_renders() -> None:
    tool_calls = [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "東京", "unit": "c"}}},
        {"type": "function", "function": {"name": "get_time", "arguments": "{}"}},
    ]
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "Checking both.", "tool_calls": tool_calls},
    ]
    rendered = render_chat_template(QWEN_CHAT_TEMPLATE, messages, add_generation_prompt=False)
    opening = "<|im_start|>assistant\n"
    generated = rendered[rendered.rindex(opening) + len(opening) : -len("<|im_end|>\n")]
    # The final assistant turn carries an empty think block: split it off first, as the server does.
    reasoning, generated = split_reasoning(generated)
    assert reasoning == ""
    content, calls = parse_tool_calls(generated)
    assert content == "Checking both."
    assert [(c.name, json.loads(c.arguments_json)) for c in calls] == [
        ("get_weather", {"city": "東京", "unit": "c"}),
        ("get_time", {}),
    ]
    assert stream([generated]) == whole(generated)


def test_ids_are_unique_and_malformed_input_never_raises() -> None:
    _, calls = parse_tool_calls(call("f", "{}") * 50)
    assert len({c.id for c in calls}) == 50
    rng = random.Random(7)
    alphabet = ['<tool_call>', '</tool_call>', '{', '}', '"name"', '"arguments"', ":", ",", '"f"', " ", "\n", "x"]
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        content, calls = parse_tool_calls(text)
        streamed = stream(all_splits(text)[rng.randrange(len(text) + 1)] if text else [text])
        assert isinstance(content, str) and isinstance(streamed[0], str)
