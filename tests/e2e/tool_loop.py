"""An agent's tool loop, turn 2 and later, sent through the official `openai` client: the history
holds assistant turns that only call tools (``content: null``, or no ``content``) and tool results
as text or as text parts. Shared by the server tests of each shipped chat template."""

from __future__ import annotations

from typing import Any

import httpx
import openai

from tests.e2e.conftest import Server

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def _call(call_id: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


# As openai-agents, LangChain and pydantic-ai send it after two rounds of tool calls.
HISTORY: list[dict[str, Any]] = [
    {"role": "system", "content": "Use the tools."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [_call("call_1")]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    {"role": "assistant", "tool_calls": [_call("call_2")]},
    {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "still sunny"}]},
]


def check_tool_loop(server: Server, model: str) -> None:
    """Chat (plain and streamed) answers 200, and /tokenize renders the very prompt the chat ran."""
    with openai.OpenAI(base_url=server.api_url, api_key="x", max_retries=0, timeout=120) as client:
        completion = client.chat.completions.create(
            model=model, messages=HISTORY, tools=TOOLS, max_tokens=2, temperature=0,  # type: ignore[arg-type]
        )
        assert completion.usage is not None and completion.choices[0].finish_reason
        stream = client.chat.completions.create(
            model=model, messages=HISTORY, tools=TOOLS, max_tokens=2, temperature=0,  # type: ignore[arg-type]
            stream=True, stream_options={"include_usage": True},
        )
        usage = [chunk.usage for chunk in stream if chunk.usage is not None]
    assert [u.prompt_tokens for u in usage] == [completion.usage.prompt_tokens]

    response = httpx.post(f"{server.base_url}/tokenize", timeout=60,
                          json={"model": model, "messages": HISTORY, "tools": TOOLS})
    assert response.status_code == 200, response.text
    tokenized = response.json()
    assert tokenized["count"] == completion.usage.prompt_tokens
    prompt = httpx.post(f"{server.base_url}/detokenize", timeout=60,
                        json={"model": model, "tokens": tokenized["tokens"]}).json()["prompt"]
    assert "None" not in prompt and "still sunny" in prompt and "sunny, 21 C" in prompt
