"""The server's ``--tool-call-parser`` and ``--reasoning-parser`` reach its answers: the real app on a
fake engine that replies with scripted text, through the official `openai` client, streamed and not.
DeepSeek-R1's answer starts in its thought (only ``</think>`` appears); Llama's calls are JSON."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from fastapi.testclient import TestClient

from tests.gateway.fake_engine import FakeEngineClient
from tokenline.api.app import ServerSettings, build_app
from tokenline.frontend.tokenizer import Tokenizer

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
REPLY = 'The user wants the weather.\n</think>\n\n{"name": "get_weather", "parameters": {"city": "Paris"}}'


@pytest.fixture
def sdk(default_model_dir: Path, tmp_path: Path) -> Iterator[openai.OpenAI]:
    reply_ids = Tokenizer.from_dir(default_model_dir).encode(REPLY, add_special_tokens=False)
    settings = ServerSettings(model=str(default_model_dir), served_model_name="m", usage_db=str(tmp_path / "u.db"),
                              tool_call_parser="llama3_json", reasoning_parser="deepseek_r1")
    with TestClient(build_app(settings, client=FakeEngineClient(reply_ids))) as client:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client, max_retries=0)


def test_deepseek_thought_and_llama_calls_come_back_parsed(sdk: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    completion = sdk.chat.completions.create(model="m", messages=messages, tools=TOOLS, max_tokens=64)
    choice = completion.choices[0]
    assert choice.message.reasoning_content == "The user wants the weather."  # type: ignore[attr-defined]
    assert not choice.message.content and choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls or []
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})

    reasoning, calls, finish = "", [], None
    for chunk in sdk.chat.completions.create(model="m", messages=messages, tools=TOOLS, max_tokens=64, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        assert not delta.content
        calls += [(t.function.name, t.function.arguments) for t in delta.tool_calls or []]
        finish = chunk.choices[0].finish_reason or finish
    assert reasoning == "The user wants the weather." and finish == "tool_calls"
    assert calls == [("get_weather", json.dumps({"city": "Paris"}))]
