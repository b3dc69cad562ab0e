"""Forced tool calls (``tool_choice`` "required" or a named function) against real servers: nested
schemas resolve, calls hold only their declared keys, ``parallel_tool_calls: false`` is one call,
a bad schema is a 400 naming its tool, and the Responses API shows only complete calls, in order.

The acceptance check runs 8 seeds x 3 nested schemas on the default model and on the tiny Qwen3.5
model (random weights: its text is noise, so only the grammar brings its calls to an end). The
schemas bound every free value (enums, integer ranges, ``maxLength``, ``maxItems``), so each call
ends well inside ``max_tokens``: a cut call would be a failure of the grammar, not of the model."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from tests.conftest import TinyQwen3_5
from tests.e2e.conftest import Server, start_server

SMOL = "smol"
TINY = "tiny"

ORDER = {"type": "object", "properties": {
    "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "object", "properties": {
        "sku": {"type": "string", "maxLength": 8}, "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["sku", "qty"]}},
    "express": {"type": "boolean"}},
    "required": ["items"]}
BOOKING = {"type": "object", "properties": {
    "seat": {"$ref": "#/$defs/Seat"},
    "meal": {"$ref": "#/$defs/Meal"},
    "travellers": {"type": "array", "maxItems": 2, "items": {"$ref": "#/$defs/Traveller"}}},
    "required": ["seat", "travellers"],
    "$defs": {
        "Seat": {"type": "string", "enum": ["aisle", "window", "middle"]},
        "Meal": {"enum": ["veg", "fish", "none"]},
        "AgeBand": {"enum": ["child", "adult", "senior"]},
        "Traveller": {"type": "object", "properties": {"age": {"$ref": "#/$defs/AgeBand"},
                                                       "seat": {"$ref": "#/$defs/Seat"}}, "required": ["age"]}}}
LOCATE = {"type": "object", "properties": {
    "place": {"anyOf": [{"$ref": "#/$defs/City"}, {"$ref": "#/$defs/Point"}]},
    "radius_km": {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 50}, {"type": "null"}]}},
    "required": ["place", "radius_km"],
    "$defs": {
        "City": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                                  "country": {"enum": ["FR", "NO", "JP"]}},
                 "required": ["name", "country"]},
        "Point": {"type": "object", "properties": {"lat": {"type": "integer", "minimum": -90, "maximum": 90},
                                                   "lon": {"type": "integer", "minimum": -180, "maximum": 180}},
                  "required": ["lat", "lon"]}}}
# None of them says additionalProperties: the grammar must still allow only the declared keys.
SCHEMAS = {"place_order": ORDER, "book_seats": BOOKING, "locate": LOCATE}
PROMPTS = {"place_order": "Order two pens and a notebook.", "book_seats": "Book a window seat for me and my kid.",
           "locate": "Find cafes near Oslo."}
SEEDS = range(8)


def closed(schema: Any) -> Any:
    """The schema with additionalProperties false on every object that declares properties."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) if k not in ("enum", "const", "required") else v for k, v in schema.items()}
    if "properties" in out:
        out.setdefault("additionalProperties", False)
    return out


def function_tool(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": f"{name} for the user",
                                             "parameters": SCHEMAS[name]}}


@pytest.fixture(scope="module")
def smol(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[Server]:
    # float32: the greedy requests below are sent twice (chat, then Responses) and must agree.
    flags = ("--tool-call-parser", "hermes", "--dtype", "float32", "--served-model-name", SMOL)
    with start_server(tmp_path_factory.mktemp("forced-smol"), str(default_model_dir), *flags) as server:
        yield server


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, tiny_qwen3_5: TinyQwen3_5) -> Iterator[Server]:
    flags = ("--reasoning-parser", "qwen3", "--tool-call-parser", "qwen3", "--served-model-name", TINY)
    with start_server(tmp_path_factory.mktemp("forced-tiny"), str(tiny_qwen3_5()), *flags) as server:
        yield server


def post(server: Server, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.api_url}{path}", json=body, timeout=300)


def chat_body(model: str, name: str, **extra: Any) -> dict[str, Any]:
    body = {"model": model, "messages": [{"role": "user", "content": PROMPTS[name]}], "tools": [function_tool(name)],
            "max_tokens": 400, **extra}
    if model == TINY:  # thinking on, the grammar would wait for a </think> that random weights never write
        body["chat_template_kwargs"] = {"enable_thinking": False}
    return body


def warm_up(server: Server, model: str, name: str) -> None:
    """Compile the tool's grammar once: over Qwen's 248k-token vocabulary the first compile can
    outlast the engine's limit on a loaded machine; it goes on and is cached, so wait for it."""
    deadline = time.monotonic() + 180
    body = chat_body(model, name, tool_choice="required", parallel_tool_calls=False, max_tokens=1)
    while True:
        response = post(server, "/chat/completions", body)
        if response.status_code == 200:
            return
        assert "did not compile" in response.text and time.monotonic() < deadline, response.text
        time.sleep(3)


# --- acceptance: 8 seeds x 3 nested schemas, on both models ----------------------------------


@pytest.mark.parametrize("model", [SMOL, TINY])
def test_forced_calls_over_seeds_and_nested_schemas(request: pytest.FixtureRequest, model: str) -> None:
    server = request.getfixturevalue("smol" if model == SMOL else "tiny")
    for name in SCHEMAS:
        warm_up(server, model, name)
    # parallel_tool_calls false throughout; the tool named on even seeds, "required" on odd ones.
    def forced(name: str, seed: int) -> dict[str, Any]:
        named = {"type": "function", "function": {"name": name}}
        return {"tool_choice": "required" if seed % 2 else named, "parallel_tool_calls": False}

    jobs = [("required" if seed % 2 else "named", name, seed,
             chat_body(model, name, temperature=1.0, seed=seed, **forced(name, seed)))
            for name in SCHEMAS for seed in SEEDS]
    with ThreadPoolExecutor(max_workers=8) as pool:
        responses = list(pool.map(lambda job: post(server, "/chat/completions", job[3]), jobs))
    failures = []
    distinct: dict[str, set[str]] = {name: set() for name in SCHEMAS}
    for (mode, name, seed, _), response in zip(jobs, responses, strict=True):
        where = f"{model} {mode} {name} seed {seed}"
        assert response.status_code == 200, f"{where}: {response.text}"
        choice = response.json()["choices"][0]
        calls = choice["message"].get("tool_calls") or []
        try:
            assert choice["finish_reason"] == "tool_calls", choice["finish_reason"]
            assert not choice["message"].get("content"), choice["message"]["content"]
            assert len(calls) == 1 and calls[0]["function"]["name"] == name, calls
            arguments = json.loads(calls[0]["function"]["arguments"])
            jsonschema.validate(arguments, SCHEMAS[name])
            jsonschema.validate(arguments, closed(SCHEMAS[name]))  # no key the schema does not declare
            distinct[name].add(calls[0]["function"]["arguments"])
        except (AssertionError, ValueError, jsonschema.ValidationError) as exc:
            failures.append(f"{where}: {exc}")
    assert not failures, f"{len(failures)} of {len(jobs)} failed:\n" + "\n".join(failures)
    # The seeds drew different calls: the test covers more than one path through each grammar.
    assert all(len(seen) > 1 for seen in distinct.values()), distinct


# --- the defects, one by one, on the default model -------------------------------------------

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"]}
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}
TWO_CITIES = "What is the weather in Paris and in Oslo?"


def weather_chat(**extra: Any) -> dict[str, Any]:
    return {"model": SMOL, "messages": [{"role": "user", "content": TWO_CITIES}], "tools": [WEATHER_TOOL],
            "tool_choice": "required", "temperature": 0, **extra}


def weather_responses(**extra: Any) -> dict[str, Any]:
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER}
    return {"model": SMOL, "input": TWO_CITIES, "tools": [tool], "tool_choice": "required", "temperature": 0,
            **extra}


def test_a_call_holds_only_its_declared_keys(smol: Server) -> None:
    # Before, SmolLM2 added "unit_type" and "unit_value" to this very call.
    response = post(smol, "/chat/completions", weather_chat(max_tokens=80, parallel_tool_calls=False))
    assert response.status_code == 200, response.text
    calls = response.json()["choices"][0]["message"]["tool_calls"]
    assert calls
    for call in calls:
        jsonschema.validate(json.loads(call["function"]["arguments"]), closed(WEATHER))


def test_parallel_tool_calls_false_is_exactly_one_call(smol: Server) -> None:
    # By default the model writes several calls (it asks about two cities) ...
    several = post(smol, "/chat/completions", weather_chat(max_tokens=100)).json()
    assert len(several["choices"][0]["message"]["tool_calls"]) >= 2, several
    # ... and with parallel_tool_calls false exactly one, which ends the answer.
    for stream in (False, True):
        body = weather_chat(max_tokens=100, parallel_tool_calls=False, stream=stream)
        if not stream:
            choice = post(smol, "/chat/completions", body).json()["choices"][0]
            names = [c["function"]["name"] for c in choice["message"]["tool_calls"]]
            finish_reason = choice["finish_reason"]
        else:
            chunks = []
            with httpx.stream("POST", f"{smol.api_url}/chat/completions", json=body, timeout=120) as response:
                for line in response.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        chunks.append(json.loads(line[6:]))
            deltas = [tc for c in chunks for tc in (c["choices"][0]["delta"].get("tool_calls") or [])]
            names = [tc["function"]["name"] for tc in deltas if tc.get("id")]
            finish_reason = chunks[-1]["choices"][0]["finish_reason"]
        assert names == ["get_weather"] and finish_reason == "tool_calls", (stream, names, finish_reason)
    # The Responses API too: one function_call, and the response completes.
    response = post(smol, "/responses", weather_responses(max_output_tokens=100, parallel_tool_calls=False)).json()
    assert response["status"] == "completed", response
    assert [item["type"] for item in response["output"]] == ["function_call"], response["output"]
    assert response["parallel_tool_calls"] is False


def test_responses_show_only_complete_calls_in_order(smol: Server) -> None:
    # Find where the first call ends in the greedy answer, then cut the answer inside the second.
    first = post(smol, "/chat/completions", weather_chat(max_tokens=100, logprobs=True)).json()["choices"][0]
    tokens = [entry["token"] for entry in first["logprobs"]["content"]]
    text = "".join(tokens)
    assert text.count("</tool_call>") >= 2, text  # two calls at least (the premise of the cut below)
    end = next(i for i in range(len(tokens)) if "</tool_call>" in "".join(tokens[: i + 1])) + 1
    body = weather_responses(max_output_tokens=end + 6)
    whole = post(smol, "/responses", body).json()
    # Before: a "message" item with the cut "<tool_call>…" markup, placed before the function_call.
    assert whole["status"] == "incomplete", whole
    assert [item["type"] for item in whole["output"]] == ["function_call"], whole["output"]
    call = whole["output"][0]
    assert call["status"] == "completed" and call["name"] == "get_weather"
    jsonschema.validate(json.loads(call["arguments"]), closed(WEATHER))
    # Streamed: the same items, and no text event carrying the markup.
    events = []
    with httpx.stream("POST", f"{smol.api_url}/responses", json={**body, "stream": True}, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    assert not [e for e in events if e["type"].startswith("response.output_text")], events
    added = [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"]
    final = events[-1]
    assert added == ["function_call"] and final["type"] == "response.incomplete", (added, final["type"])
    assert [(i["type"], i["arguments"]) for i in final["response"]["output"]] == [("function_call", call["arguments"])]


BAD_SCHEMAS = [
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, "/$defs/missing"),
    ({"type": "object", "properties": {"a": {"type": "strin"}}}, "strin"),
    ({"type": "objekt"}, "objekt"),
]


@pytest.mark.parametrize("schema, fault", BAD_SCHEMAS)
def test_a_bad_tool_schema_is_a_400_naming_the_tool(smol: Server, schema: dict[str, Any], fault: str) -> None:
    ok = {"type": "function", "function": {"name": "ok", "parameters": {"type": "object", "properties": {}}}}
    bad = {"type": "function", "function": {"name": "bad", "parameters": schema}}
    for tool_choice in ("required", {"type": "function", "function": {"name": "bad"}}):
        body = {"model": SMOL, "messages": [{"role": "user", "content": "x"}], "tools": [ok, bad],
                "tool_choice": tool_choice, "max_tokens": 5}
        response = post(smol, "/chat/completions", body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "tools[1].function.parameters" and fault in error["message"], error
        assert "%json" not in error["message"] and "tool_call" not in error["message"], error  # no grammar
    flat = [{"type": "function", **t["function"]} for t in (ok, bad)]
    response = post(smol, "/responses", {"model": SMOL, "input": "x", "tools": flat, "tool_choice": "required",
                                         "max_output_tokens": 5})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "tools[1].parameters" and fault in error["message"] and "%json" not in error["message"]
