"""The tool-call formats vLLM users name (``--tool-call-parser llama3_json`` / ``pythonic``), whole
and streamed: the stream, cut anywhere (inside a tag, a string, an escape, a triple quote), carries
exactly the calls and content the whole output gives; what is not a call stays content."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence

import pytest

from tests.frontend.test_tool_calls import collect
from tokenline.frontend.chat_output import ChatOutputParser
from tokenline.frontend.tool_parsers import HERMES, TOOL_CALL_FORMATS, ToolCallFormat

LLAMA = TOOL_CALL_FORMATS["llama3_json"]
PYTHONIC = TOOL_CALL_FORMATS["pythonic"]


def all_splits(text: str) -> list[list[str]]:
    """Every cut into two deltas, every char on its own, and random cuts into many."""
    cuts = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    cuts.append(list(text))
    rng = random.Random(len(text))
    for _ in range(20):
        points = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, 6)))
        cuts.append([text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)])
    return cuts


def whole(fmt: ToolCallFormat, text: str) -> tuple[str, list[tuple[str, str]]]:
    content, calls = fmt.parse(text, False)
    return content, [(c.name, c.arguments_json) for c in calls]


def streamed(fmt: ToolCallFormat, deltas: Sequence[str]) -> tuple[str, list[tuple[str, str]]]:
    parser = fmt.stream()
    events = [e for d in deltas for e in parser.feed(d)]
    return collect(events + parser.finish())


SF = ("get_weather", '{"city": "SF"}')

LLAMA_CASES = [
    # (output, content, calls)
    ('{"name": "get_weather", "parameters": {"city": "SF"}}', "", [SF]),
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "SF"}}', "", [SF]),
    ('\n <|python_tag|> {"name": "get_weather", "arguments": {"city": "SF"}}\n', "", [SF]),
    ('{"name": "get_weather", "parameters": {"city": "SF"}}; {"name": "f2", "parameters": {"x": 1}}',
     "", [SF, ("f2", '{"x": 1}')]),
    ('{"name":"a","parameters":{}};{"name":"b","parameters":{}}\n{"name":"c","parameters":{}}', "",
     [("a", "{}"), ("b", "{}"), ("c", "{}")]),
    # Braces and quotes inside strings do not end the call; arguments as a JSON string are decoded.
    ('{"name": "echo", "parameters": {"text": "a } \\" {", "n": [1, {"d": 2}]}}', "",
     [("echo", '{"text": "a } \\" {", "n": [1, {"d": 2}]}')]),
    ('{"name": "f", "arguments": "{\\"x\\": \\"東京\\"}"}', "", [("f", '{"x": "東京"}')]),
    # Text after the calls is content, the layout whitespace before it dropped.
    ('{"name": "get_weather", "parameters": {"city": "SF"}}\n\nChecking now.', "Checking now.", [SF]),
    ('{"name": "get_weather", "parameters": {"city": "SF"}}; and more', "; and more", [SF]),
    # Not calls: the whole answer is content, as written.
    ("The weather is fine.", "The weather is fine.", []),
    ('Sure: {"name": "get_weather", "parameters": {"city": "SF"}}',
     'Sure: {"name": "get_weather", "parameters": {"city": "SF"}}', []),
    ('  {"answer": 42} done', '  {"answer": 42} done', []),
    ('{"name": "Bob", "age": 3}', '{"name": "Bob", "age": 3}', []),
    ('<|python_tag|>{"name": "f", "parameters": [1]}', '<|python_tag|>{"name": "f", "parameters": [1]}', []),
    ('{"name": "f", "parameters": {"x": NaN}}', '{"name": "f", "parameters": {"x": NaN}}', []),
    ("<|python_ta", "<|python_ta", []),
    ('{"name": "f", "parameters": {"x": "cut', '{"name": "f", "parameters": {"x": "cut', []),
    # A call after a complete one that is not a call: it is content, from the separator on.
    ('{"name": "a", "parameters": {}}; {"oops": 1}', '; {"oops": 1}', [("a", "{}")]),
    ('{"name": "a", "parameters": {}}; {"name": "b", "parameters": {', '; {"name": "b", "parameters": {',
     [("a", "{}")]),
    ("", "", []),
]

PYTHONIC_CASES = [
    ("[get_weather(city='SF')]", "", [SF]),
    ('  [get_weather(city="SF"), add(x=1, y=-2.5, z=+3)]\n', "",
     [SF, ("add", '{"x": 1, "y": -2.5, "z": 3}')]),
    ("[f(items=[1, (2, 3)], opts={'deep': {'k': None, 'on': True}}, s='it\\'s ]')]", "",
     [("f", '{"items": [1, [2, 3]], "opts": {"deep": {"k": null, "on": true}}, "s": "it\'s ]"}')]),
    ("[f(s='''tri'ple ] \"quote''', t=\"\"\"x\"\"\")]", "", [("f", '{"s": "tri\'ple ] \\"quote", "t": "x"}')]),
    ("[noop()]", "", [("noop", "{}")]),
    ("[get_weather(city='SF')]\n\nLooking it up.", "Looking it up.", [SF]),
    # Not calls: the whole answer is content.
    ("[1, 2, 3]", "[1, 2, 3]", []),
    ("[]", "[]", []),
    ("[f(1)]", "[f(1)]", []),  # a positional argument has no name
    ("[f(**kw)]", "[f(**kw)]", []),
    ("[f(x=y)]", "[f(x=y)]", []),  # a name, not a literal: never looked up
    ("[__import__('os').system('echo hi')]", "[__import__('os').system('echo hi')]", []),
    ("[f(x=1e999)]", "[f(x=1e999)]", []),
    ("[f(x={1: 2})]", "[f(x={1: 2})]", []),
    ("Call [f(x=1)] later", "Call [f(x=1)] later", []),
    ("[f(x='unterminated)]", "[f(x='unterminated)]", []),
    ("[f(x=1)", "[f(x=1)", []),
]


@pytest.mark.parametrize(("fmt", "output", "content", "calls"),
                         [(LLAMA, *case) for case in LLAMA_CASES] + [(PYTHONIC, *case) for case in PYTHONIC_CASES])
def test_whole_output(fmt: ToolCallFormat, output: str, content: str, calls: list[tuple[str, str]]) -> None:
    got_content, got_calls = whole(fmt, output)
    assert (got_content, got_calls) == (content, calls)
    for _, arguments in got_calls:
        assert isinstance(json.loads(arguments), dict)


@pytest.mark.parametrize(("fmt", "output"),
                         [(LLAMA, case[0]) for case in LLAMA_CASES] + [(PYTHONIC, case[0]) for case in PYTHONIC_CASES])
def test_streaming_equals_whole_at_every_split(fmt: ToolCallFormat, output: str) -> None:
    expected = whole(fmt, output)
    for deltas in all_splits(output):
        assert streamed(fmt, deltas) == expected, deltas


def test_a_call_is_sent_once_complete_and_not_before() -> None:
    parser = LLAMA.stream()
    assert parser.feed('<|python_tag|>{"name": "get_weather", "parameters": {"city": "S') == []
    assert parser.in_call
    events = parser.feed('F"}}; {"name": "b", ')
    assert collect(events) == ("", [SF]) and parser.num_calls == 1
    rest = parser.feed('"parameters": {}}') + parser.finish()
    assert [(type(e).__name__, e.index) for e in rest] == [("ToolCallStart", 1), ("ToolCallArgumentsDelta", 1)]
    parser = PYTHONIC.stream()
    assert parser.feed("[get_weather(city='SF'), ") == [] and parser.in_call
    assert collect(parser.feed("g()] ok")) == ("ok", [SF, ("g", "{}")])


def test_plain_text_streams_as_it_comes() -> None:
    for fmt in (LLAMA, PYTHONIC):
        parser = fmt.stream()
        assert collect(parser.feed("Hello")) == ("Hello", [])
        assert collect(parser.feed(" [x] {y}")) == (" [x] {y}", [])


@pytest.mark.parametrize("name", ["llama3_json", "pythonic"])
def test_the_chat_output_uses_the_servers_format(name: str) -> None:
    fmt = TOOL_CALL_FORMATS[name]
    output = ('<think>\nuse the tool\n</think>\n\n'
              + ('{"name": "get_weather", "parameters": {"city": "SF"}}' if name == "llama3_json"
                 else "[get_weather(city='SF')]"))
    parsed = ChatOutputParser(reasoning=True, starts_in_reasoning=False, tools=fmt).parse_all(output)
    assert parsed.reasoning == "use the tool" and parsed.content == ""
    assert [(c.name, c.arguments_json) for c in parsed.tool_calls] == [SF]
    streaming = ChatOutputParser(reasoning=True, starts_in_reasoning=False, tools=fmt)
    pieces = [streaming.feed(c) for c in output] + [streaming.finish()]
    assert "".join(p.reasoning for p in pieces) == "use the tool"
    assert [(t.name, t.arguments) for p in pieces for t in p.tool_calls] == [SF]
    assert streaming.finish_reason("stop") == "tool_calls"
    # Forced calls come in the grammar's format whatever the server's: True means Hermes'.
    assert ChatOutputParser(reasoning=False, starts_in_reasoning=False, tools=True)._format is HERMES
