"""Reasoning and tool calls shaped for the OpenAI API, streamed and whole."""

from __future__ import annotations

import json

import pytest

from tokenline.frontend.chat_output import ChatOutputParser, ChatPiece

OUTPUT = (
    "<think>\nThe user wants the weather.\n</think>\n\n"
    "Let me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
)


def stream(parser: ChatOutputParser, text: str, size: int) -> ChatPiece:
    piece = ChatPiece()
    for i in range(0, len(text), size):
        piece = piece.merged(parser.feed(text[i : i + size]))
    return piece.merged(parser.finish())


def calls_of(piece: ChatPiece) -> list[tuple[str, dict]]:
    names: dict[int, str] = {}
    args: dict[int, str] = {}
    for call in piece.tool_calls:
        if call.name is not None:
            names[call.index] = call.name
        args[call.index] = args.get(call.index, "") + (call.arguments or "")
    return [(names[i], json.loads(args[i])) for i in sorted(names)]


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_streamed_pieces_add_up_to_the_whole_parse(size: int) -> None:
    whole = ChatOutputParser(reasoning=True, starts_in_reasoning=False, tools=True).parse_all(OUTPUT)
    assert whole.reasoning == "The user wants the weather."
    assert whole.content == "Let me check."
    assert [(c.name, json.loads(c.arguments_json)) for c in whole.tool_calls] == [
        ("get_weather", {"city": "Paris", "unit": "c"})
    ]
    parser = ChatOutputParser(reasoning=True, starts_in_reasoning=False, tools=True)
    piece = stream(parser, OUTPUT, size)
    assert piece.reasoning == whole.reasoning and piece.content == whole.content
    assert calls_of(piece) == [("get_weather", {"city": "Paris", "unit": "c"})]
    assert parser.made_tool_calls
    assert all(c.id and c.id.startswith("call_") for c in piece.tool_calls if c.name)


def test_without_parsers_everything_is_content_and_malformed_calls_stay_content() -> None:
    plain = ChatOutputParser(reasoning=False, starts_in_reasoning=False, tools=False)
    assert stream(plain, OUTPUT, 3).content == OUTPUT
    broken = "<tool_call>\n{not json}\n</tool_call>"
    parsed = ChatOutputParser(reasoning=False, starts_in_reasoning=False, tools=True).parse_all(broken)
    assert parsed.tool_calls == [] and "{not json}" in parsed.content


def test_starting_inside_reasoning() -> None:
    parser = ChatOutputParser(reasoning=True, starts_in_reasoning=True, tools=False)
    piece = stream(parser, "still thinking</think>\n\nThe answer.", 2)
    assert piece.reasoning == "still thinking" and piece.content == "The answer."


def test_finish_reason_is_tool_calls_exactly_when_calls_are_reported() -> None:
    cut = OUTPUT[: OUTPUT.index("</tool_call>")]  # the length limit hit right after the call's JSON
    for truncated, reason in ((False, "stop"), (True, "length")):
        streamed = ChatOutputParser(reasoning=True, starts_in_reasoning=False, tools=True)
        piece = streamed.feed(cut).merged(streamed.finish(truncated=truncated))
        whole = ChatOutputParser(reasoning=True, starts_in_reasoning=False, tools=True)
        parsed = whole.parse_all(cut, truncated=truncated)
        if truncated:  # cut off: no call, the block stays content, the reason stays "length"
            assert piece.tool_calls == [] and parsed.tool_calls == []
            assert piece.content == parsed.content and parsed.content.startswith("Let me check.\n<tool_call>")
        else:  # the model ended the output after complete JSON: a call, sent as one delta
            assert [(c.name, json.loads(c.arguments or "")) for c in piece.tool_calls] == calls_of(piece)
            assert len(piece.tool_calls) == 1 and len(parsed.tool_calls) == 1
        expected = reason if truncated else "tool_calls"
        assert streamed.finish_reason(reason) == whole.finish_reason(reason) == expected


def kinds(pieces: list[ChatPiece]) -> list[tuple[str, str]]:
    """Each piece as (kind, text): reasoning, content, or a call's name and arguments."""
    out = []
    for piece in pieces:
        assert sum(map(bool, (piece.reasoning, piece.content, piece.tool_calls))) == 1, piece  # one kind each
        if piece.reasoning or piece.content:
            out.append(("reasoning", piece.reasoning) if piece.reasoning else ("content", piece.content))
        else:
            out += [("call", f"{c.name}:{c.arguments}") for c in piece.tool_calls]
    return out


TWO_CALLS = (
    'Sure.\n<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\nThen\n'
    '<tool_call>\n{"name": "b", "arguments": {"x": 1}}\n</tool_call>'
)


@pytest.mark.parametrize("size", [1, 5, 1000])
def test_in_order_pieces_keep_the_order_the_model_wrote(size: int) -> None:
    # The Responses API makes an item of each piece: text after a call comes after it.
    parser = ChatOutputParser(reasoning=True, starts_in_reasoning=True, tools=True)
    text = "hmm</think>\n\n" + TWO_CALLS
    pieces = [p for i in range(0, len(text), size) for p in parser.feed_in_order(text[i : i + size])]
    pieces += parser.finish_in_order()
    merged: list[tuple[str, str]] = []
    for kind, part in kinds(pieces):  # a stream splits text into several pieces; a call comes whole
        if merged and merged[-1][0] == kind != "call":
            merged[-1] = (kind, merged[-1][1] + part)
        else:
            merged.append((kind, part))
    assert merged == [("reasoning", "hmm"), ("content", "Sure."), ("call", "a:{}"), ("content", "Then"),
                      ("call", 'b:{"x": 1}')]


def test_max_calls_reports_only_the_first_calls() -> None:
    streamed = ChatOutputParser(reasoning=False, starts_in_reasoning=False, tools=True, max_calls=1)
    piece = stream(streamed, TWO_CALLS, 4)
    assert calls_of(piece) == [("a", {})] and piece.content == "Sure.Then"
    whole = ChatOutputParser(reasoning=False, starts_in_reasoning=False, tools=True, max_calls=1)
    assert [c.name for c in whole.parse_all(TWO_CALLS).tool_calls] == ["a"]


@pytest.mark.parametrize("cut", ["<tool_call>\n{\"name\": \"b\", \"argu", "<tool_", "\n<tool_call>"])
def test_a_cut_call_can_be_dropped_instead_of_shown_as_content(cut: str) -> None:
    text = '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n' + cut
    for drop in (False, True):
        parser = ChatOutputParser(reasoning=False, starts_in_reasoning=False, tools=True)
        pieces = parser.feed_in_order(text) + parser.finish_in_order(truncated=True, drop_cut_call=drop)
        shown = kinds(pieces)
        assert shown[0] == ("call", "a:{}")
        # Kept (the chat API's way), the cut block is content; dropped (the Responses API's), nothing follows.
        assert shown[1:] == ([] if drop else [("content", cut.lstrip())])
