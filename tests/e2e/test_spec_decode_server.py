"""A server with `--speculative ngram` streams the same greedy text, with the same usage, as one
without it; its metrics count the drafts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx

from tests.e2e.conftest import Server, start_server

MODEL = "SmolLM2-135M-Instruct"
PASSAGE = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick, polished the "
    "great lens, and wrote the weather in a leather logbook."
)
GREEDY = {
    "model": MODEL,
    "messages": [{"role": "user", "content": f"Repeat the following text exactly:\n\n{PASSAGE}"}],
    "temperature": 0,
    "max_tokens": 64,
    "stream": True,
    "stream_options": {"include_usage": True},
}


def stream(server: Server, body: dict[str, Any]) -> tuple[str, str | None, dict[str, int]]:
    """Text, finish reason and usage of one streamed chat completion."""
    text, finish, usage = "", None, {}
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200, response.read()
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: ") :])
                for choice in chunk["choices"]:
                    text += choice["delta"].get("content") or ""
                    finish = choice.get("finish_reason") or finish
                if chunk.get("usage"):
                    usage = chunk["usage"]
    return text, finish, usage


def tokens_until(server: Server, stop: str) -> int:
    """How many greedy tokens it takes for the text to contain ``stop`` (their pieces, via logprobs)."""
    body = {**GREEDY, "stream": False, "logprobs": True}
    body.pop("stream_options")
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    pieces = [t["token"] for t in response.json()["choices"][0]["logprobs"]["content"]]
    return next(k for k in range(1, len(pieces) + 1) if stop in "".join(pieces[:k]))


def test_same_streamed_text_and_usage_as_without_speculation(tmp_path: Path, server: Server) -> None:
    with_stop = {**GREEDY, "stop": ["great lens"]}
    expected = stream(server, GREEDY)
    expected_stopped = stream(server, with_stop)
    assert PASSAGE.split(".")[0] in expected[0]  # the model does copy the passage

    with start_server(tmp_path, "--speculative", "ngram", "--dtype", "float32") as spec_server:
        got = stream(spec_server, GREEDY)
        got_stopped = stream(spec_server, with_stop)
        metrics = spec_server.metrics()

    # Cached prompt tokens depend on what each server saw before (the session server has served
    # other chats sharing the template's system prompt); everything else must be equal.
    for usage in (got[2], expected[2], got_stopped[2], expected_stopped[2]):
        usage.pop("prompt_tokens_details", None)
    assert got == expected
    assert got[2]["completion_tokens"] > 20
    # A stop string inside a run of accepted drafts ends the text at the same place. Both servers bill
    # what their engine produced: at least the tokens up to the one completing the stop string, and a
    # few more where the engine ran on before the API's abort reached it (a step or two of plain
    # decoding, or the rest of a run of drafts), as vLLM does. How many more is a race.
    assert got_stopped[:2] == expected_stopped[:2] and got_stopped[1] == "stop"
    needed = tokens_until(server, with_stop["stop"][0])
    for usage in (got_stopped[2], expected_stopped[2]):
        assert needed <= usage["completion_tokens"] <= needed + 12, (needed, got_stopped, expected_stopped)

    assert metrics["vllm:spec_decode_num_draft_tokens_total"] > 0
    assert 0 < metrics["vllm:spec_decode_num_accepted_tokens_total"] <= metrics["vllm:spec_decode_num_draft_tokens_total"]
    assert metrics["vllm:spec_decode_num_drafts_total"] > 0
    # Several tokens per engine step still count one by one.
    completion = got[2]["completion_tokens"] + got_stopped[2]["completion_tokens"]
    assert metrics["vllm:generation_tokens_total"] == completion
