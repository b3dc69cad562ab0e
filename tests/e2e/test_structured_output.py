"""Structured output through a real server on the default model and the official ``openai`` SDK:
``response_format`` (json_schema, json_object), vLLM's ``structured_outputs`` (json, regex, choice,
grammar) on chat and completions, streaming with a schema, and the 400s before any engine work."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Literal

import jsonschema
import openai
import pydantic
import pytest

from tests.e2e.conftest import Server, start_server

MODEL = "SmolLM2-135M-Instruct"


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=24)
    country: Literal["France", "Norway", "Japan"]
    population_millions: float
    landmarks: list[str] = pydantic.Field(max_length=2)


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
        "address": {"anyOf": [{"type": "null"}, {"type": "object", "properties": {"zip": {"type": "string",
                    "pattern": "^[0-9]{5}$"}}, "required": ["zip"], "additionalProperties": False}]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with start_server(tmp_path_factory.mktemp("structured"), "--dtype", "float32") as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api_url, api_key="none", max_retries=0)


def ask(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


def test_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    for seed in range(3):
        completion = client.chat.completions.parse(
            model=MODEL, messages=ask("Describe Paris as JSON."), response_format=City, max_tokens=200,
            temperature=0.8, seed=seed,
        )
        choice = completion.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(choice.message.parsed, City)


def test_json_schema_streamed_and_json_object(client: openai.OpenAI) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    stream = client.chat.completions.create(
        model=MODEL, messages=ask("Invent a person."), response_format=response_format, max_tokens=200,
        stream=True, temperature=0.7, seed=1,
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), PERSON)
    obj = client.chat.completions.create(
        model=MODEL, messages=ask('Reply with the JSON object {"ok": true} and nothing else.'),
        response_format={"type": "json_object"}, max_tokens=60, temperature=0,
    )
    # Any object is allowed (a looping 135M model can fill max_tokens inside one); this prompt ends.
    assert obj.choices[0].finish_reason == "stop"
    assert json.loads(obj.choices[0].message.content) == {"ok": True}


def test_vllm_structured_outputs_on_chat_and_completions(client: openai.OpenAI) -> None:
    regex = r"[A-Z][a-z]{2,8} [0-9]{2}"
    chat = client.chat.completions.create(
        model=MODEL, messages=ask("A name and an age."), max_tokens=30, temperature=1.0, seed=3,
        extra_body={"structured_outputs": {"regex": regex}},
    )
    assert re.fullmatch(regex, chat.choices[0].message.content)
    choices = ["positive", "negative", "neutral"]
    completion = client.completions.create(
        model=MODEL, prompt="The review 'I loved it' is", max_tokens=10, n=3, temperature=1.0, seed=4,
        extra_body={"structured_outputs": {"choice": choices}},
    )
    assert all(c.text in choices and c.finish_reason == "stop" for c in completion.choices)
    grammar = 'start: "The answer is " NUMBER "."\nNUMBER: /[0-9]{1,3}/\n'
    lark = client.completions.create(
        model=MODEL, prompt="2 + 2 =", max_tokens=20, temperature=0,
        extra_body={"structured_outputs": {"grammar": grammar}},
    )
    assert re.fullmatch(r"The answer is [0-9]{1,3}\.", lark.choices[0].text)
    schema = client.completions.create(
        model=MODEL, prompt="A person as JSON:", max_tokens=200, temperature=0.5, seed=5,
        extra_body={"structured_outputs": {"json": PERSON}},
    )
    jsonschema.validate(json.loads(schema.choices[0].text), PERSON)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
         "response_format.json_schema.schema"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {"grammar": "start: nothing_defined"}}, "structured_outputs.grammar"),
        ({"structured_outputs": {"json": {"type": "object"}}, "response_format": {"type": "json_object"}},
         "structured_outputs"),
    ],
)
def test_bad_constraints_are_400s_naming_the_field(client: openai.OpenAI, body: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL, messages=ask("hi"), max_tokens=5, extra_body=body)
    error = exc.value.response.json()["error"]
    assert error["param"] == param, error


def test_the_server_still_serves_after_the_400s(server: Server, client: openai.OpenAI) -> None:
    assert client.chat.completions.create(model=MODEL, messages=ask("hi"), max_tokens=3).choices
    metrics = server.metrics()
    assert metrics["vllm:num_requests_running"] == 0
    # Every distinct spec above compiled once; the repeated ones (n=3 choices) hit the cache.
    assert metrics["tokenline_grammar_compiles_total"] >= 5
    assert metrics["tokenline_grammar_cache_hits_total"] >= 2
    assert metrics["tokenline_grammar_compile_seconds_total"] > 0


# Compiled under llguidance's default limits this regex held ~186 MiB of lexer in the engine for
# good (five of them took it from 1,486 to 2,362 MiB); the server's grammar limits refuse it.
HEAVY = "((a{100}){100}){100}z"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"structured_outputs": {"regex": HEAVY + "<tag>x1"}}, "structured_outputs.regex"),
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"s": {"type": "string", "pattern": f"^{HEAVY}$"}},
                                    "required": ["s"]}}}},
         "response_format.json_schema.schema"),
    ],
)
def test_a_spec_past_the_grammar_limits_is_a_400_naming_its_field(client: openai.OpenAI, body: dict,
                                                                   param: str) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL, messages=ask("hi"), max_tokens=2, extra_body=body)
    error = exc.value.response.json()["error"]
    assert error["param"] == param and "too complex" in error["message"], error


def test_metrics_show_the_grammar_cache_within_its_bound(server: Server, client: openai.OpenAI) -> None:
    before = server.metrics()
    client.chat.completions.create(model=MODEL, messages=ask("Count"), max_tokens=2,
                                   extra_body={"structured_outputs": {"regex": "((a{100}){100}){3}z"}})
    after = server.metrics()
    assert after["tokenline_grammar_cache_entries"] >= 1
    # That regex's lexer is ~11 MiB: counted, and the total within the default 256 MiB bound.
    assert after["tokenline_grammar_cache_bytes"] - before["tokenline_grammar_cache_bytes"] > 4 << 20
    assert after["tokenline_grammar_cache_bytes"] <= 256 << 20
    assert after["tokenline_grammar_cache_evictions_total"] == 0
