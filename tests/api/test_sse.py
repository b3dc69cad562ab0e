"""``ChunkFrame`` writes the bytes the chunk models write: the template path for plain choices and
the model path for the rest, over every character class JSON escapes."""

from __future__ import annotations

import itertools

import pytest

from tokenline.api.protocol import (
    ChatCompletionChunk,
    ChatCompletionChunkChoice,
    ChatLogprobs,
    ChatLogprobToken,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    UsageInfo,
)
from tokenline.api.sse import ChunkFrame, json_string

# Control characters, quotes, backslash, DEL, non-ASCII (2-, 3- and 4-byte UTF-8), JS line separators.
TEXTS = ["", "hello", " world", '"quoted"', "back\\slash", "tab\there", "new\nline\r\n", "\x00\x01\x1f\x7f",
         "caf\u00e9", "\u4e2d\u6587", "\U0001f600 emoji", "\u2028\u2029", "\ufffd", "</script>", "a/b"]


def expected(chunk_type: type, choices: list, usage: UsageInfo | None, include_usage: bool) -> str:
    body = chunk_type(id="cmpl-abc", created=1700000000, model="Smol/LM \"2\"", choices=choices)
    if include_usage:
        body.usage = usage
    return f"data: {body.model_dump_json()}\n\n"


def test_json_string_escapes_as_pydantic() -> None:
    every_char = "".join(chr(c) for c in range(0x0, 0x3000) if not 0xD800 <= c < 0xE000)
    choice = CompletionChoice(index=0, text=every_char)
    assert f'"text":{json_string(every_char)}' in choice.model_dump_json()


@pytest.mark.parametrize("include_usage", [False, True])
def test_completion_chunks_match_the_model(include_usage: bool) -> None:
    frame = ChunkFrame(CompletionChunk, "cmpl-abc", 1700000000, 'Smol/LM "2"', include_usage)
    for text, finish in itertools.product(TEXTS, [None, "stop", "length"]):
        choices = [CompletionChoice(index=3, text=text, finish_reason=finish)]
        assert frame.event(choices) == expected(CompletionChunk, choices, None, include_usage)
    # Shapes that take the model's path: logprobs, token ids, several choices, usage.
    rich = [
        CompletionChoice(index=0, text="a", logprobs=CompletionLogprobs(tokens=["a"], token_logprobs=[-0.5],
                                                                        top_logprobs=[{"a": -0.5}], text_offset=[0])),
        CompletionChoice(index=1, text="b", token_ids=[5, 6], prompt_token_ids=[1, 2]),
        CompletionChoice(index=2, text="c\n", finish_reason="stop"),
    ]
    assert frame.event(rich) == expected(CompletionChunk, rich, None, include_usage)
    usage = UsageInfo.of(10, 4, 2)
    assert frame.event([], usage) == expected(CompletionChunk, [], usage, include_usage)
    assert frame.event(rich[:1], usage) == expected(CompletionChunk, rich[:1], usage, include_usage)


@pytest.mark.parametrize("include_usage", [False, True])
def test_chat_chunks_match_the_model(include_usage: bool) -> None:
    frame = ChunkFrame(ChatCompletionChunk, "cmpl-abc", 1700000000, 'Smol/LM "2"', include_usage)
    deltas = [DeltaMessage(role="assistant", content=""), DeltaMessage(), *(DeltaMessage(content=t) for t in TEXTS)]
    for delta, finish in itertools.product(deltas, [None, "stop", "tool_calls"]):
        choices = [ChatCompletionChunkChoice(index=1, delta=delta, finish_reason=finish)]
        assert frame.event(choices) == expected(ChatCompletionChunk, choices, None, include_usage)
    rich = [
        ChatCompletionChunkChoice(index=0, delta=DeltaMessage(reasoning_content="hm", reasoning="hm")),
        ChatCompletionChunkChoice(index=0, delta=DeltaMessage(tool_calls=[DeltaToolCall(
            index=0, id="call_1", type="function", function=DeltaFunctionCall(name="f", arguments='{"x":'))])),
        ChatCompletionChunkChoice(index=0, delta=DeltaMessage(content="x"), logprobs=ChatLogprobs(content=[
            ChatLogprobToken(token="x", logprob=-0.1, bytes=[120], top_logprobs=[])])),
    ]
    for choice in rich:
        assert frame.event([choice]) == expected(ChatCompletionChunk, [choice], None, include_usage)
    usage = UsageInfo.of(7, 3, 0)
    assert frame.event([], usage) == expected(ChatCompletionChunk, [], usage, include_usage)
