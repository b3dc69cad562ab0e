"""Server-sent events byte by byte, with raw httpx: framing, chunk objects, finish_reason and usage
placement, and UTF-8 that never breaks inside a character."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import Server

MODEL = "SmolLM2-135M-Instruct"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MSGS = [{"role": "user", "content": "Name three colours."}]
REPLACEMENT = "\ufffd"


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        yield c


def raw_stream(client: httpx.Client, path: str, body: dict[str, Any]) -> tuple[httpx.Response, str]:
    """POST a streaming request; the response and its whole body as text (checked to be UTF-8)."""
    with client.stream("POST", path, json={**body, "stream": True}) as response:
        data = response.read()
    return response, data.decode("utf-8")  # strict: a broken character raises here


def parse_events(text: str) -> list[dict[str, Any] | str]:
    """Split an SSE body into its events, checking the framing: `data: <payload>\\n\\n` only."""
    assert text.endswith("\n\n"), text[-200:]
    events: list[dict[str, Any] | str] = []
    for block in text[:-2].split("\n\n"):
        assert block.startswith("data: "), block
        assert "\n" not in block, f"an event must be a single data line: {block!r}"
        payload = block[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    assert events and events[-1] == "[DONE]", events[-3:]
    assert "[DONE]" not in events[:-1]
    return events


def chunks_of(client: httpx.Client, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    response, text = raw_stream(client, path, body)
    assert response.status_code == 200, text
    assert response.headers["content-type"].startswith("text/event-stream")
    events = parse_events(text)
    chunks = events[:-1]
    for chunk in chunks:
        assert isinstance(chunk, dict) and "error" not in chunk, chunk
    return chunks  # type: ignore[return-value]


def delta_text(path: str, choice: dict[str, Any]) -> str:
    if path == CHAT:
        return choice["delta"].get("content") or ""
    return choice["text"]


ENDPOINTS = [
    pytest.param(CHAT, {"model": MODEL, "messages": MSGS}, "chat.completion.chunk", "chatcmpl-", id="chat"),
    pytest.param(COMPLETIONS, {"model": MODEL, "prompt": "The three primary colours are"}, "text_completion", "cmpl-",
                 id="completions"),
]


@pytest.mark.parametrize(("path", "body", "object_", "prefix"), ENDPOINTS)
def test_sse_framing_and_chunk_objects(
    client: httpx.Client, path: str, body: dict, object_: str, prefix: str
) -> None:
    response, text = raw_stream(client, path, {**body, "max_tokens": 8, "ignore_eos": True, "temperature": 0})
    assert response.status_code == 200, text
    assert response.headers["content-type"].split(";")[0].strip() == "text/event-stream"
    assert response.headers.get("cache-control") == "no-cache"
    assert response.headers.get("x-request-id")
    events = parse_events(text)
    chunks = events[:-1]
    assert len(chunks) >= 2
    ids = {c["id"] for c in chunks}
    created = {c["created"] for c in chunks}
    assert len(ids) == 1 and ids.pop().startswith(prefix)
    assert len(created) == 1
    for chunk in chunks:
        assert chunk["object"] == object_
        assert chunk["model"] == MODEL
        assert "usage" not in chunk, "usage appears only when stream_options.include_usage is set"
        assert [c["index"] for c in chunk["choices"]] == [0]
    if path == CHAT:
        first = chunks[0]["choices"][0]
        assert first["delta"] == {"role": "assistant", "content": ""}
        assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])
    reasons = [c["choices"][0]["finish_reason"] for c in chunks]
    assert reasons[-1] == "length"
    assert reasons[:-1] == [None] * (len(reasons) - 1), "finish_reason only on the last chunk"


@pytest.mark.parametrize(("path", "body", "object_", "prefix"), ENDPOINTS)
def test_finish_reason_on_each_choices_last_chunk_with_n(
    client: httpx.Client, path: str, body: dict, object_: str, prefix: str
) -> None:
    chunks = chunks_of(client, path, {**body, "max_tokens": 6, "n": 2, "temperature": 1.0, "seed": 7})
    by_index: dict[int, list[dict]] = {0: [], 1: []}
    for chunk in chunks:
        assert len(chunk["choices"]) == 1
        by_index[chunk["choices"][0]["index"]].append(chunk["choices"][0])
    for index, choices in by_index.items():
        reasons = [c["finish_reason"] for c in choices]
        assert reasons[-1] in ("stop", "length"), (index, reasons)
        assert reasons[:-1] == [None] * (len(reasons) - 1), (index, reasons)


@pytest.mark.parametrize(("path", "body", "object_", "prefix"), ENDPOINTS)
def test_include_usage_null_until_the_final_usage_chunk(
    client: httpx.Client, path: str, body: dict, object_: str, prefix: str
) -> None:
    chunks = chunks_of(
        client, path,
        {**body, "max_tokens": 7, "ignore_eos": True, "stream_options": {"include_usage": True}},
    )
    *content, last = chunks
    for chunk in content:
        assert "usage" in chunk and chunk["usage"] is None, chunk
        assert len(chunk["choices"]) == 1
    assert last["choices"] == []
    assert last["id"] == content[0]["id"] and last["created"] == content[0]["created"]
    assert last["object"] == object_
    usage = last["usage"]
    assert usage["completion_tokens"] == 7
    assert usage["prompt_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert content[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(("path", "body", "object_", "prefix"), ENDPOINTS)
def test_continuous_usage_on_every_chunk(
    client: httpx.Client, path: str, body: dict, object_: str, prefix: str
) -> None:
    max_tokens = 6
    chunks = chunks_of(
        client, path,
        {**body, "max_tokens": max_tokens, "ignore_eos": True,
         "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
    )
    *content, last = chunks
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == max_tokens
    seen = []
    for chunk in content:
        usage = chunk["usage"]
        assert usage is not None, chunk
        assert usage["prompt_tokens"] == last["usage"]["prompt_tokens"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        seen.append(usage["completion_tokens"])
    assert seen == sorted(seen), seen
    assert seen[-1] == max_tokens
    assert len(set(seen)) > 1, f"completion_tokens should grow while streaming: {seen}"


# --- UTF-8: deltas never split a character, and add up to the non-streamed text -----------

UTF8_PROMPTS = {
    "chinese": "你好世界。你好世界。你好世界。你好",
    "emoji": "🎉🎉🎉🎉🎉🎉🎉🎉",
    "accents": "Ünïcödé façade naïve — “quotes” — ünïcödé façade naïve — “",
}
# The assistant's reply is continued in Chinese, so the model writes multi-byte text through chat too.
CHINESE_CHAT = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Write it again"},
                 {"role": "assistant", "content": "你好世界。你好世界。你好"}],
    "add_generation_prompt": False,
    "continue_final_message": True,
}


@pytest.fixture(scope="module")
def utf8_runs(client: httpx.Client) -> dict[str, tuple[str, list[dict[str, Any]]]]:
    """Each greedy request non-streamed and streamed, all at once (one batch: quick even on a busy CPU)."""
    requests = {name: (COMPLETIONS, {"model": MODEL, "prompt": prompt, "max_tokens": 13, "temperature": 0})
                for name, prompt in UTF8_PROMPTS.items()}
    requests["chat"] = (CHAT, {**CHINESE_CHAT, "max_tokens": 13, "temperature": 0, "logprobs": True})

    def full(path: str, body: dict) -> str:
        response = client.post(path, json=body)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        return choice["message"]["content"] if path == CHAT else choice["text"]

    with ThreadPoolExecutor(max_workers=2 * len(requests)) as pool:
        texts = {name: pool.submit(full, *request) for name, request in requests.items()}
        streams = {name: pool.submit(chunks_of, client, *request) for name, request in requests.items()}
        return {name: (texts[name].result(timeout=300), streams[name].result(timeout=300)) for name in requests}


@pytest.mark.parametrize("name", [*UTF8_PROMPTS, "chat"])
def test_multibyte_text_streams_whole_characters(utf8_runs: dict, name: str) -> None:
    full_text, chunks = utf8_runs[name]
    path = CHAT if name == "chat" else COMPLETIONS
    deltas = [delta_text(path, c["choices"][0]) for c in chunks]
    assert "".join(deltas) == full_text, deltas
    assert any(len(ch.encode()) > 1 for ch in full_text), f"the model did not write multi-byte text: {full_text!r}"
    # U+FFFD may appear only where the final text has it too (a character cut off by max_tokens).
    position = 0
    for delta in deltas:
        for offset, ch in enumerate(delta):
            if ch == REPLACEMENT:
                assert full_text[position + offset] == REPLACEMENT, (deltas, full_text)
        position += len(delta)
    assert REPLACEMENT not in full_text.rstrip(REPLACEMENT), full_text


def test_chat_logprob_bytes_reassemble_the_streamed_text(utf8_runs: dict) -> None:
    full_text, chunks = utf8_runs["chat"]
    raw = b"".join(bytes(entry["bytes"]) for c in chunks if c["choices"][0]["logprobs"]
                   for entry in c["choices"][0]["logprobs"]["content"])
    assert raw.decode("utf-8", errors="replace") == full_text


@pytest.mark.parametrize(("path", "body"), [
    pytest.param(CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "🎉🎉🎉🎉 " * 4}]}, id="chat"),
    pytest.param(COMPLETIONS, {"model": MODEL, "prompt": "🎉🎉🎉🎉🎉🎉🎉🎉"}, id="completions"),
])
def test_every_token_gets_its_chunk(client: httpx.Client, path: str, body: dict) -> None:
    # As vLLM streams: a token whose text is held back (half a character) still sends its chunk,
    # with empty text, so a client counting chunks counts tokens and times the first one.
    chunks = chunks_of(client, path, {**body, "max_tokens": 12, "ignore_eos": True, "temperature": 0,
                                      "stream_options": {"include_usage": True}})
    *content, last = chunks
    if path == CHAT:
        assert content[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        content = content[1:]
    assert len(content) == last["usage"]["completion_tokens"] == 12
    deltas = [delta_text(path, c["choices"][0]) for c in content]
    if any(len(ch.encode()) == 4 for ch in "".join(deltas)):  # an emoji spans several byte tokens here
        assert "" in deltas, deltas


def test_a_token_id_prompt_ending_inside_a_character(client: httpx.Client) -> None:
    # The prompt's last id is a stray UTF-8 byte: its text ("... tookepsilon" + U+FFFD) is never output.
    body = {"model": MODEL, "prompt": [34713, 2637, 35941, 120], "max_tokens": 6, "ignore_eos": True,
            "temperature": 0}
    full = client.post(COMPLETIONS, json=body)
    assert full.status_code == 200, full.text
    text = full.json()["choices"][0]["text"]
    streamed = "".join(c["choices"][0]["text"] for c in chunks_of(client, COMPLETIONS, body))
    assert streamed == text
    assert "tookepsilon" not in text, text
