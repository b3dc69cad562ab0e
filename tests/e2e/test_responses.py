"""POST /v1/responses through the official openai SDK, on real servers.

Two servers: the default model (float32, so greedy text repeats exactly) behind two tenants'
keys, and the tiny random-weight Qwen3.5 hybrid with a thinking-first template (its generation
prompt opens ``<think>``, as Qwen3's thinking models do) and the qwen3 reasoning and tool-call
parsers, for reasoning items, reasoning effort and function calls.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import TinyQwen3_5
from tests.e2e.conftest import Server, start_server
from tokenline.frontend.qwen_vocab import QWEN_CHAT_TEMPLATE
from tokenline.gateway.keys import add_key


@dataclass
class Keyed:
    server: Server
    db: Path
    keys: dict[str, str]
    model: str

    def client(self, tenant: str = "alice") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.server.api_url, api_key=self.keys[tenant], max_retries=0, timeout=120)

    def post(self, path: str, body: dict[str, Any], tenant: str = "alice") -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.keys[tenant]}"}
        return httpx.post(f"{self.server.api_url}{path}", json=body, headers=headers, timeout=120)


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[Keyed]:
    tmp = tmp_path_factory.mktemp("responses")
    keys_file = tmp / "keys.toml"
    keys = {name: add_key(keys_file, name) for name in ("alice", "bob")}
    with start_server(tmp, "--keys", str(keys_file), "--dtype", "float32") as server:
        db = next(tmp.glob("usage-*.sqlite3"))
        model = httpx.get(f"{server.api_url}/models", headers={"Authorization": f"Bearer {keys['alice']}"}).json()
        yield Keyed(server, db, keys, model["data"][0]["id"])


@pytest.fixture(scope="module")
def thinker(tmp_path_factory: pytest.TempPathFactory, tiny_qwen3_5: TinyQwen3_5) -> Iterator[openai.OpenAI]:
    model_dir = tmp_path_factory.mktemp("thinker") / "qwen3.5-tiny"
    shutil.copytree(tiny_qwen3_5(), model_dir)  # a copy: its chat template changes below
    closed = "{{- '<think>\\n\\n</think>\\n\\n' -}}\n    {%- endif -%}"
    assert closed in QWEN_CHAT_TEMPLATE
    template = QWEN_CHAT_TEMPLATE.replace(closed, "{{- '<think>\\n\\n</think>\\n\\n' -}}\n    {%- else -%}\n"
                                                  "        {{- '<think>\\n' -}}\n    {%- endif -%}")
    (model_dir / "chat_template.jinja").write_text(template, encoding="utf-8")
    flags = ("--reasoning-parser", "qwen3", "--tool-call-parser", "qwen3", "--served-model-name", "tiny")
    with start_server(tmp_path_factory.mktemp("thinker-server"), str(model_dir), *flags) as server:
        client = openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0, timeout=120)
        warm_up_grammar(client)
        yield client


def warm_up_grammar(client: openai.OpenAI) -> None:
    """The first tool grammar over Qwen's 248k-token vocabulary can take longer than the engine's
    10 s compile limit on a loaded CI machine; the compile goes on and is cached, so wait for it."""
    deadline = time.monotonic() + 120
    while True:
        try:
            client.responses.create(model="tiny", input="hi", tools=[WEATHER], tool_choice=CALL_WEATHER,
                                    reasoning={"effort": "none"}, max_output_tokens=1)
            return
        except openai.BadRequestError as exc:
            if "did not compile" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(5)


def chat_prompt_tokens(keyed: Keyed, messages: list[dict[str, Any]]) -> int:
    body = {"model": keyed.model, "messages": messages, "max_tokens": 1}
    return keyed.post("/chat/completions", body).json()["usage"]["prompt_tokens"]


# --- the default model ------------------------------------------------------------------------


def test_text_with_instructions_is_the_chat_answer(keyed: Keyed) -> None:
    client = keyed.client()
    response = client.responses.create(model=keyed.model, input="Name a colour.", instructions="Answer in one word.",
                                       max_output_tokens=12, temperature=0)
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status in ("completed", "incomplete")
    message = response.output[0]
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"
    assert response.output_text == message.content[0].text and response.output_text
    usage = response.usage
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0
    messages = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Name a colour."}]
    chat = keyed.client().chat.completions.create(model=keyed.model, messages=messages, max_tokens=12, temperature=0)
    assert usage.input_tokens == chat.usage.prompt_tokens
    assert response.output_text == chat.choices[0].message.content
    assert usage.output_tokens == chat.usage.completion_tokens


def test_items_input_renders_like_the_same_chat(keyed: Keyed) -> None:
    items = [
        {"role": "system", "content": "You are kind."},
        {"role": "user", "content": [{"type": "input_text", "text": "Hello"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hi there!"}]},
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "How are you?"},
    ]
    response = keyed.client().responses.create(model=keyed.model, input=items, max_output_tokens=4)
    messages = [{"role": "system", "content": "You are kind."}, {"role": "user", "content": "Hello"},
                {"role": "assistant", "content": "Hi there!"}, {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "How are you?"}]
    assert response.usage.input_tokens == chat_prompt_tokens(keyed, messages)


def test_max_output_tokens_makes_it_incomplete(keyed: Keyed) -> None:
    response = keyed.client().responses.create(model=keyed.model, input="Write a long story about a dragon.",
                                               max_output_tokens=3, temperature=0)
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3
    assert response.output[0].status == "incomplete"


def test_previous_response_id_continues_and_retrieve_is_per_tenant(keyed: Keyed) -> None:
    alice, bob = keyed.client("alice"), keyed.client("bob")
    first = alice.responses.create(model=keyed.model, input="My name is Ada.", max_output_tokens=8, temperature=0)
    second = alice.responses.create(model=keyed.model, input="What is my name?", previous_response_id=first.id,
                                    max_output_tokens=8, temperature=0)
    assert second.previous_response_id == first.id
    history = [{"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": first.output_text},
               {"role": "user", "content": "What is my name?"}]
    assert second.usage.input_tokens == chat_prompt_tokens(keyed, history)
    assert alice.responses.retrieve(first.id).model_dump() == first.model_dump()
    with pytest.raises(openai.NotFoundError):
        bob.responses.retrieve(first.id)  # another tenant's response does not exist for bob
    with pytest.raises(openai.NotFoundError) as exc:
        bob.responses.create(model=keyed.model, input="And now?", previous_response_id=first.id)
    assert exc.value.body["code"] == "previous_response_not_found"
    assert exc.value.body["param"] == "previous_response_id"
    unstored = alice.responses.create(model=keyed.model, input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(unstored.id)
    assert alice.responses.delete(first.id) is None
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(first.id)


YES_NO = {"type": "json_schema", "name": "answer", "strict": True, "schema": {
    "type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
    "additionalProperties": False}}


def test_stream_events_in_order_and_final_response(keyed: Keyed) -> None:
    client = keyed.client()
    body = {"model": keyed.model, "input": "Is the sky blue?", "text": {"format": YES_NO}, "temperature": 0,
            "max_output_tokens": 32}
    with client.responses.stream(**body) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert deltas and types[4:4 + len(deltas)] == ["response.output_text.delta"] * len(deltas)
    assert types[4 + len(deltas):] == ["response.output_text.done", "response.content_part.done",
                                       "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(d.delta for d in deltas)
    assert json.loads(text)["answer"] in ("yes", "no")  # text.format's schema held
    assert final.status == "completed" and final.output_text == text
    assert events[-1].response.id == final.id == events[0].response.id
    again = client.responses.create(**body)
    assert again.output_text == text and again.usage.output_tokens == final.usage.output_tokens


def test_incomplete_stream_ends_with_response_incomplete(keyed: Keyed) -> None:
    events = list(keyed.client().responses.create(model=keyed.model, input="Tell me a story.", stream=True,
                                                  max_output_tokens=2))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-1].response.usage.output_tokens == 2


def test_usage_and_stored_response_in_the_ledger_database(keyed: Keyed) -> None:
    response = keyed.client("bob").responses.create(model=keyed.model, input="Count to three.", max_output_tokens=5)
    with sqlite3.connect(keyed.db) as conn:
        row = conn.execute("SELECT tenant, prompt_tokens, completion_tokens, status FROM usage WHERE response_id = ?",
                           (response.id,)).fetchone()
        stored = conn.execute("SELECT tenant FROM responses WHERE id = ?", (response.id,)).fetchone()
    assert row == ("bob", response.usage.input_tokens, response.usage.output_tokens, "finished")
    assert stored == ("bob",)


@pytest.mark.parametrize(("body", "param"), [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"input": [{"type": "web_search_call"}]}, "input[0].type"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
    ({"input": "hi", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "max_output_tokens": 100_000}, "max_output_tokens"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "frequency_penalty": 5}, "frequency_penalty"),  # vLLM's extension, out of range
    ({"input": []}, "input"),
])
def test_bad_requests_are_400_naming_the_param(keyed: Keyed, body: dict[str, Any], param: str) -> None:
    response = keyed.post("/responses", {"model": keyed.model, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]


def test_unknown_previous_response_is_404(keyed: Keyed) -> None:
    response = keyed.post("/responses", {"model": keyed.model, "input": "hi", "previous_response_id": "resp_nope"})
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "previous_response_not_found"


def test_reasoning_effort_on_a_model_without_thinking(keyed: Keyed) -> None:
    messages = [{"role": "user", "content": "hi"}]
    for effort in ("none", "high"):
        body = {"model": keyed.model, "messages": messages, "max_tokens": 1, "reasoning_effort": effort}
        assert keyed.post("/chat/completions", body).status_code == 200
    bad = keyed.post("/chat/completions", {"model": keyed.model, "messages": messages, "reasoning_effort": "lots"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "reasoning_effort"
    response = keyed.client().responses.create(model=keyed.model, input="hi", reasoning={"effort": "low"},
                                               max_output_tokens=2)
    assert response.reasoning.effort == "low" and all(item.type != "reasoning" for item in response.output)


# --- the thinking hybrid --------------------------------------------------------------------


def test_reasoning_item_and_effort(thinker: openai.OpenAI) -> None:
    # Greedy, random weights write only newlines (layout after <think>): sample, seeded.
    sampled = {"temperature": 1.0, "extra_body": {"seed": 0}}
    thought = thinker.responses.create(model="tiny", input="What is 2 + 2?", reasoning={"effort": "high"},
                                       max_output_tokens=8, **sampled)
    reasoning = thought.output[0]
    assert reasoning.type == "reasoning" and reasoning.content[0].type == "reasoning_text"
    assert reasoning.content[0].text
    # Random weights never close the thought in 8 tokens: every token is reasoning.
    assert thought.usage.output_tokens_details.reasoning_tokens == thought.usage.output_tokens == 8
    plain = thinker.responses.create(model="tiny", input="What is 2 + 2?", reasoning={"effort": "none"},
                                     max_output_tokens=8, **sampled)
    assert [item.type for item in plain.output] == ["message"]
    assert plain.usage.output_tokens_details.reasoning_tokens == 0
    chat = [{"role": "user", "content": "What is 2 + 2?"}]
    on = thinker.chat.completions.create(model="tiny", messages=chat, max_tokens=4, reasoning_effort="medium", seed=0)
    off = thinker.chat.completions.create(model="tiny", messages=chat, max_tokens=4, reasoning_effort="minimal", seed=0)
    assert on.choices[0].message.model_extra.get("reasoning_content")
    assert not off.choices[0].message.model_extra.get("reasoning_content")


def test_streamed_reasoning(thinker: openai.OpenAI) -> None:
    events = list(thinker.responses.create(model="tiny", input="Why?", reasoning={"effort": "high"}, stream=True,
                                           max_output_tokens=6, temperature=1.0, extra_body={"seed": 1}))
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    done = next(e for e in events if e.type == "response.reasoning_text.done")
    final = events[-1].response
    assert deltas and "".join(deltas) == done.text == final.output[0].content[0].text
    assert final.output[0].type == "reasoning"


WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
    "additionalProperties": False}}
CALL_WEATHER = {"type": "function", "name": "get_weather"}


def test_function_call_round_trip(thinker: openai.OpenAI) -> None:
    # Effort "none": with the thought open, the tool grammar would wait for a </think> that
    # random weights never write.
    # A named function: exactly one call, then the grammar ends the answer.
    body = {"model": "tiny", "tools": [WEATHER], "tool_choice": CALL_WEATHER, "reasoning": {"effort": "none"},
            "max_output_tokens": 60, "temperature": 0}
    first = thinker.responses.create(input="Weather in Paris?", **body)
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and first.status == "completed"
    for call in calls:
        assert call.name == "get_weather" and json.loads(call.arguments)["city"] in ("Paris", "Oslo")
        assert call.call_id
    outputs = [{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"} for call in calls]
    second = thinker.responses.create(input=outputs, previous_response_id=first.id,
                                      **{**body, "tool_choice": "auto", "max_output_tokens": 4})
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    # The same conversation, sent whole as items without previous_response_id, is the same prompt.
    items = [{"role": "user", "content": "Weather in Paris?"},
             *[{"type": "function_call", "call_id": c.call_id, "name": c.name, "arguments": c.arguments}
               for c in calls], *outputs]
    whole = thinker.responses.create(input=items, **{**body, "tool_choice": "auto", "max_output_tokens": 4})
    assert whole.usage.input_tokens == second.usage.input_tokens


def test_streamed_function_call(thinker: openai.OpenAI) -> None:
    body = {"model": "tiny", "input": "Weather?", "tools": [WEATHER], "tool_choice": CALL_WEATHER,
            "reasoning": {"effort": "none"}, "max_output_tokens": 60, "temperature": 0}
    with thinker.responses.stream(**body) as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    call = final.output[0]
    assert call.type == "function_call" and call.name == "get_weather"
    assert deltas == done.arguments == call.arguments and json.loads(call.arguments)["city"] in ("Paris", "Oslo")
    assert thinker.responses.create(**body).output[0].arguments == call.arguments
