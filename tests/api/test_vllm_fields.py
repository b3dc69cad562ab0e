"""vLLM's request fields that older clients and eval harnesses send: guided_* as aliases of
structured_outputs, echo, prompt_logprobs, return_tokens_as_token_ids, truncate_prompt_tokens and
/tokenize's return_token_strs. Protocol and processor only (no engine); tests/e2e/test_vllm_fields.py
runs them against a real server."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.api.test_protocol import MAX_MODEL_LEN, USER, _app, assert_error
from tokenline.api.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    PromptLogprob,
    TokenizeRequest,
    TokenizeResponse,
    UsageInfo,
)
from tokenline.frontend.processor import InputProcessor, PromptError
from tokenline.frontend.tokenizer import Tokenizer
from tokenline.gateway.errors import APIError
from tokenline.sampling_params import StructuredOutputs

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.fixture(scope="module")
def processor(default_model_dir: Path) -> InputProcessor:
    return InputProcessor(Tokenizer.from_dir(default_model_dir), {}, lambda: MAX_MODEL_LEN)


@pytest.fixture
def client(processor: InputProcessor) -> TestClient:
    return TestClient(_app(processor), raise_server_exceptions=False)


def chat(client: TestClient, **fields: Any) -> Any:
    return client.post("/chat", json={"model": "m", "messages": USER, **fields})


def completion(client: TestClient, **fields: Any) -> Any:
    return client.post("/completions", json={"model": "m", "prompt": "hi", **fields})


# --- guided_* ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "spec"),
    [
        ("guided_json", SCHEMA, StructuredOutputs(json=SCHEMA)),
        ("guided_json", json.dumps(SCHEMA), StructuredOutputs(json=json.dumps(SCHEMA))),
        ("guided_regex", "[0-9]{3}", StructuredOutputs(regex="[0-9]{3}")),
        ("guided_choice", ["yes", "no"], StructuredOutputs(choice=["yes", "no"])),
        ("guided_grammar", 'start: "a" | "b"', StructuredOutputs(grammar='start: "a" | "b"')),
    ],
)
def test_guided_fields_are_aliases_of_structured_outputs(field: str, value: Any, spec: StructuredOutputs) -> None:
    chat_request = ChatCompletionRequest(model="m", messages=USER, **{field: value})
    completion_request = CompletionRequest(model="m", prompt="x", **{field: value})
    for request in (chat_request, completion_request):
        assert request.to_sampling_params().structured_outputs == spec
        assert request.guided_fields == [field]
    # A vLLM backend name chooses how, not what: accepted, and it changes nothing.
    backend = {"guided_decoding_backend": "xgrammar"}
    assert CompletionRequest(model="m", prompt="x", **{field: value}, **backend).structured_spec() == spec


def test_guided_fields_that_cannot_be_honoured_are_refused(client: TestClient) -> None:
    assert_error(completion(client, guided_regex="a+", guided_whitespace_pattern=r"[ ]?"), 400,
                 "guided_whitespace_pattern")
    assert_error(chat(client, guided_choice=["a"], guided_decoding_backend="no-such-backend"), 400,
                 "guided_decoding_backend")


def test_guided_fields_through_the_processor(client: TestClient) -> None:
    body = chat(client, guided_choice=["red", "green"]).json()
    assert body["structured_outputs"]["choice"] == ["red", "green"]
    assert completion(client, guided_regex="a+").json()["structured_outputs"]["regex"] == "a+"
    # An invalid constraint is blamed on the field the caller used.
    assert_error(completion(client, guided_regex="(unclosed"), 400, "guided_regex")
    assert_error(chat(client, guided_json={"type": "no-such-type"}), 400, "guided_json")
    assert_error(chat(client, guided_choice=[]), 400, "guided_choice")


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"guided_json": SCHEMA, "guided_regex": "a"}, "guided_regex"),
        ({"guided_choice": ["a"], "structured_outputs": {"regex": "a"}}, "guided_choice"),
        ({"guided_json": SCHEMA, "response_format": {"type": "json_object"}}, "guided_json"),
    ],
)
def test_guided_conflicts_are_refused(client: TestClient, fields: dict[str, Any], param: str) -> None:
    message = assert_error(chat(client, **fields), 400, param)
    assert "cannot both be set" in message or "only one of" in message
    if "response_format" not in fields:
        assert_error(completion(client, **fields), 400, param)


# --- prompt_logprobs, echo, max_tokens 0 ---------------------------------------------------


def test_prompt_logprobs_are_mapped_and_bounded(client: TestClient) -> None:
    assert chat(client, prompt_logprobs=3).json()["prompt_logprobs"] == 3
    assert completion(client, prompt_logprobs=0).json()["prompt_logprobs"] == 0
    assert completion(client).json()["prompt_logprobs"] is None
    assert "whole vocabulary" in assert_error(completion(client, prompt_logprobs=-1), 400, "prompt_logprobs")
    assert_error(chat(client, prompt_logprobs=21), 400, "prompt_logprobs")
    # As vLLM: a stream has no place for them (0 asks for none, so it passes).
    assert_error(chat(client, prompt_logprobs=2, stream=True), 400, "prompt_logprobs")
    assert_error(completion(client, prompt_logprobs=2, stream=True), 400, "prompt_logprobs")
    assert completion(client, prompt_logprobs=0, stream=True).status_code == 200


def test_echo_with_logprobs_scores_the_prompt(client: TestClient) -> None:
    sp = completion(client, echo=True, logprobs=2).json()
    assert sp["prompt_logprobs"] == 2 and sp["logprobs"] == 2  # vLLM: prompt_logprobs default to logprobs
    assert completion(client, echo=True).json()["prompt_logprobs"] is None
    assert completion(client, echo=True, logprobs=1, prompt_logprobs=4).json()["prompt_logprobs"] == 4
    # echo + max_tokens 0: the prompt scored, nothing generated (lm-evaluation-harness's request).
    sp = completion(client, echo=True, logprobs=1, max_tokens=0).json()
    assert sp["max_tokens"] == 0 and sp["prompt_logprobs"] == 1
    assert "echo" in assert_error(completion(client, max_tokens=0), 400, "max_tokens")
    assert_error(chat(client, max_tokens=0, echo=True), 400, "max_tokens")  # chat has no prompt-only answer


@pytest.mark.parametrize(
    ("messages", "add_generation_prompt", "echoed"),
    [
        (USER, True, ""),  # answering as the assistant after a user turn: nothing to echo
        ([*USER, {"role": "assistant", "content": "Once upon"}], False, "Once upon"),
        ([*USER, {"role": "assistant", "content": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}]}],
         True, "A\nB"),
        (USER, False, "hi"),  # without a generation prompt the answer continues the last turn's role
    ],
)
def test_chat_echo_is_the_last_message_of_the_answered_role(
    messages: list[dict[str, Any]], add_generation_prompt: bool, echoed: str
) -> None:
    request = ChatCompletionRequest(
        model="m", messages=messages, add_generation_prompt=add_generation_prompt, echo=True
    )
    assert request.echo_text() == echoed
    assert ChatCompletionRequest(model="m", messages=messages, add_generation_prompt=add_generation_prompt,
                                 echo=False).echo_text() == ""


# --- truncate_prompt_tokens ----------------------------------------------------------------


@pytest.mark.parametrize("value", [0, -2])
def test_truncate_prompt_tokens_range(client: TestClient, value: int) -> None:
    assert_error(chat(client, truncate_prompt_tokens=value), 400, "truncate_prompt_tokens")
    assert_error(completion(client, truncate_prompt_tokens=value), 400, "truncate_prompt_tokens")
    assert chat(client, truncate_prompt_tokens=-1).status_code == 200


def test_truncation_keeps_the_last_tokens(processor: InputProcessor) -> None:
    prompt = list(range(1, 151))
    assert processor.truncate(prompt, None) == prompt
    assert processor.truncate(prompt, 5) == [146, 147, 148, 149, 150]
    assert processor.truncate(prompt[:3], 5) == [1, 2, 3]
    assert processor.truncate(prompt, -1) == prompt[-MAX_MODEL_LEN:]  # -1: the model's context
    with pytest.raises(PromptError) as exc:
        processor.truncate(prompt, MAX_MODEL_LEN + 1)
    assert exc.value.param == "truncate_prompt_tokens"


# --- return_tokens_as_token_ids, return_token_strs, response shapes ------------------------


def test_token_id_spelling_and_token_strs_are_accepted() -> None:
    assert ChatCompletionRequest(model="m", messages=USER, return_tokens_as_token_ids=True).return_tokens_as_token_ids
    assert CompletionRequest(model="m", prompt="x", return_tokens_as_token_ids=True).return_tokens_as_token_ids
    assert TokenizeRequest(prompt="x", return_token_strs=True).return_token_strs
    assert "token_strs" not in TokenizeResponse(tokens=[1], count=1, max_model_len=8).model_dump()
    shaped = TokenizeResponse(tokens=[1], count=1, max_model_len=8, token_strs=["Ġa"]).model_dump()
    assert shaped["token_strs"] == ["Ġa"]


def test_prompt_logprobs_shapes() -> None:
    entries = [None, {"42": PromptLogprob(logprob=-1.5, rank=3, decoded_token=" cat"),
                      "7": PromptLogprob(logprob=float("-inf"), rank=1, decoded_token="a")}]
    choice = CompletionChoice(index=0, text="x", prompt_logprobs=entries)
    data = json.loads(choice.model_dump_json())
    assert data["prompt_logprobs"] == [
        None, {"42": {"logprob": -1.5, "rank": 3, "decoded_token": " cat"},
               "7": {"logprob": -9999.0, "rank": 1, "decoded_token": "a"}},  # JSON has no -inf
    ]
    assert "prompt_logprobs" not in CompletionChoice(index=0, text="x").model_dump()
    chat_response = ChatCompletionResponse(model="m", choices=[], usage=UsageInfo.of(1, 1))
    assert "prompt_logprobs" not in chat_response.model_dump()
    chat_response.prompt_logprobs = entries
    assert chat_response.model_dump()["prompt_logprobs"][1]["42"]["rank"] == 3


def test_guided_error_names_survive_param_mapping(client: TestClient) -> None:
    request = CompletionRequest(model="m", prompt="x", guided_json=SCHEMA)
    assert request.param_names == {"structured_outputs": "guided_json", "structured_outputs.json": "guided_json"}
    assert_error(completion(client, guided_choice=["a", 1]), 400, "guided_choice[1]")
    with pytest.raises(APIError) as exc:
        ChatCompletionRequest(model="m", messages=USER, guided_choice=["a", "b"], guided_regex="x").structured_spec()
    assert exc.value.param == "guided_choice"  # the second of them, in GUIDED_FIELDS order
