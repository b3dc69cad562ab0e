"""The server on the tiny Qwen3.5 hybrid: reasoning and tool calls travel the whole pipeline.

The tiny model's weights are random, so its text is noise: these tests check what the pipeline
does with it (the parsers themselves are driven with scripted text in tests/frontend)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import TinyQwen3_5
from tests.e2e.conftest import Server, start_server, wait_until
from tests.e2e.event_stream import EventReader
from tests.e2e.tool_loop import check_tool_loop

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory, tiny_qwen3_5: TinyQwen3_5) -> Iterator[Server]:
    model_dir = tiny_qwen3_5()
    flags = ("--reasoning-parser", "qwen3", "--tool-call-parser", "qwen3", "--served-model-name", "tiny")
    with start_server(tmp_path_factory.mktemp("hybrid"), str(model_dir), *flags) as server:
        yield server


def chat(server: Server, **body: object) -> httpx.Response:
    return httpx.post(f"{server.api_url}/chat/completions", json={"model": "tiny", **body}, timeout=120)


def stream_chunks(server: Server, **body: object) -> list[dict]:
    chunks = []
    with httpx.stream("POST", f"{server.api_url}/chat/completions", json={"model": "tiny", "stream": True, **body},
                      timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


THINKING = {
    "messages": [
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "<think>\nLet me work this out"},
    ],
    "add_generation_prompt": False,
    "continue_final_message": True,  # the answer continues inside the open thought
    "max_tokens": 8,
    "temperature": 0,
}


def test_reasoning_goes_to_reasoning_content_streamed_and_not(hybrid: Server) -> None:
    response = chat(hybrid, **THINKING)
    assert response.status_code == 200, response.text
    message = response.json()["choices"][0]["message"]
    assert message["reasoning_content"] and message["reasoning"] == message["reasoning_content"]
    assert not message.get("content")  # the thought never closed: nothing of it leaks into content
    chunks = stream_chunks(hybrid, **THINKING)
    streamed = "".join(c["choices"][0]["delta"].get("reasoning_content", "") for c in chunks if c["choices"])
    assert streamed == message["reasoning_content"]
    assert not "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


def test_disabled_thinking_renders_the_empty_think_block(hybrid: Server) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"enable_thinking": False}}
    tokens = httpx.post(f"{hybrid.base_url}/tokenize", json={"model": "tiny", **body}, timeout=30).json()["tokens"]
    text = httpx.post(f"{hybrid.base_url}/detokenize", json={"model": "tiny", "tokens": tokens}, timeout=30).json()
    assert text["prompt"].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


# Random weights write noise; arguments from small enums let the grammar bring every call to its end.
ENUM_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "strict": True, "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}}},
]


def test_auto_tool_choice_applies_no_grammar(hybrid: Server) -> None:
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS,
            "tool_choice": "auto", "max_tokens": 6, "temperature": 0}
    response = chat(hybrid, **body)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")
    stream_chunks(hybrid, **body)  # streaming the same request completes without an error event


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_required_and_named_tool_calls_always_parse(hybrid: Server, tool_choice: object) -> None:
    for seed in range(4):
        body = {"messages": [{"role": "user", "content": "Weather or time?"}], "tools": ENUM_TOOLS,
                "tool_choice": tool_choice, "max_tokens": 120, "temperature": 1.0, "seed": seed,
                # Thinking on, the grammar would wait for a </think> that random weights never write.
                "chat_template_kwargs": {"enable_thinking": False}}
        response = chat(hybrid, **body)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        calls = choice["message"]["tool_calls"]
        assert calls and choice["finish_reason"] == "tool_calls", choice
        for call in calls:
            arguments = json.loads(call["function"]["arguments"])
            if call["function"]["name"] == "get_weather":
                assert arguments["city"] in ("Paris", "Oslo") and arguments["unit"] in ("c", "f")
            else:
                assert call["function"]["name"] == "get_time" and arguments == {"zone": arguments["zone"]}
        if isinstance(tool_choice, dict):
            assert [c["function"]["name"] for c in calls] == ["get_time"]
    streamed = stream_chunks(hybrid, **{**body, "seed": 7})
    # While the parser holds a call back, nothing is sent: no chunk with an empty delta.
    assert all(c["choices"][0]["delta"] or c["choices"][0]["finish_reason"] for c in streamed if c["choices"])
    names = [tc["function"]["name"] for c in streamed for tc in (c["choices"][0]["delta"].get("tool_calls") or [])
             if c["choices"] and tc.get("function", {}).get("name")]
    assert names and streamed[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_required_tool_calls_through_the_openai_sdk(hybrid: Server) -> None:
    import openai

    client = openai.OpenAI(base_url=hybrid.api_url, api_key="none", max_retries=0)
    completion = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Time?"}], tools=ENUM_TOOLS, tool_choice="required",
        max_tokens=120, temperature=1.0, seed=11, extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.function.name in ("get_weather", "get_time") and json.loads(call.function.arguments)


def test_an_agent_tool_loop_renders_and_tokenizes_alike(hybrid: Server) -> None:
    # Turn 2 of an agent: tool-calling turns with content null or none, tool results as parts.
    check_tool_loop(hybrid, "tiny")


def test_tool_choice_naming_an_unknown_tool_is_a_400(hybrid: Server) -> None:
    response = chat(hybrid, messages=[{"role": "user", "content": "x"}], tools=TOOLS,
                    tool_choice={"type": "function", "function": {"name": "nope"}})
    assert response.status_code == 400 and response.json()["error"]["param"] == "tool_choice"


def test_a_tool_call_cut_off_by_max_tokens_is_content_with_finish_reason_length(hybrid: Server) -> None:
    # The grammar starts a call at once; 6 tokens cannot finish it, so the length limit cuts it off.
    body = {"messages": [{"role": "user", "content": "Time?"}], "tools": ENUM_TOOLS, "tool_choice": "required",
            "max_tokens": 6, "temperature": 0, "chat_template_kwargs": {"enable_thinking": False}}
    choice = chat(hybrid, **body).json()["choices"][0]
    assert choice["finish_reason"] == "length" and not choice["message"].get("tool_calls"), choice
    assert choice["message"]["content"].startswith("<tool_call>")
    chunks = [c for c in stream_chunks(hybrid, **body) if c["choices"]]
    assert not any(c["choices"][0]["delta"].get("tool_calls") for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert streamed == choice["message"]["content"]
    # Given room, the same request ends its call: tool_calls, and finish_reason "tool_calls", both ways.
    done = chat(hybrid, **{**body, "max_tokens": 120}).json()["choices"][0]
    assert done["message"]["tool_calls"] and done["finish_reason"] == "tool_calls"
    chunks = [c for c in stream_chunks(hybrid, **{**body, "max_tokens": 120}) if c["choices"]]
    assert any(c["choices"][0]["delta"].get("tool_calls") for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_the_live_stream_shows_the_hybrids_state_slots_filling_and_freeing(hybrid: Server) -> None:
    reader = EventReader(hybrid.base_url, "no-keys-on-this-server")
    thread = threading.Thread(target=reader.run, kwargs={"deadline_s": 60}, daemon=True)
    thread.start()
    assert reader.connected.wait(30)
    assert chat(hybrid, messages=[{"role": "user", "content": "Hi"}], max_tokens=8, temperature=0).status_code == 200
    wait_until(lambda: any(s["num_state_slots_used"] == 0 and s["num_state_slots"] > 0 for s in reader.of("stats")), 10)
    reader.stop.set()
    thread.join(timeout=10)
    steps = reader.of("step")
    assert steps and all(s["num_state_slots"] > 0 for s in steps)
    assert max(s["num_state_slots_used"] for s in steps) >= 1  # the request held a recurrent-state slot
    assert any(s["num_state_slots_used"] == 0 and s["num_state_slots"] > 0 for s in reader.of("stats"))  # and freed it
