"""The OpenAI protocol models and the error shape, through a tiny FastAPI app (no model, no engine)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from tokenline.frontend.processor import InputProcessor, PromptError
from tokenline.frontend.tokenizer import Tokenizer
from tokenline.sampling_params import StructuredOutputs
from tokenline.gateway.errors import APIError, install_error_handlers
from tokenline.api.protocol import (
    AssistantMessage,
    ChatCompletionChunk,
    ChatCompletionChunkChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatLogprobs,
    ChatLogprobToken,
    ChatTopLogprob,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    UsageInfo,
    random_id,
)

MAX_MODEL_LEN = 100
PROMPT_LEN = 10


def _app(processor: InputProcessor) -> FastAPI:
    app = FastAPI()
    install_error_handlers(app, invalid_request_errors=(PromptError,))

    @app.post("/chat")
    def chat(req: ChatCompletionRequest) -> dict[str, Any]:
        req.check()  # as the server does: refuse unsupported fields, map, fit to the context
        return dataclasses.asdict(processor.fit(req.to_sampling_params(), [0] * PROMPT_LEN, req.param_names))

    @app.post("/completions")
    def completions(req: CompletionRequest) -> dict[str, Any]:
        req.check()
        return dataclasses.asdict(processor.fit(req.to_sampling_params(), [0] * PROMPT_LEN, req.param_names))

    @app.post("/tokenize")
    def tokenize(req: TokenizeRequest) -> dict[str, Any]:
        req.check()
        return {"special": req.use_special_tokens}

    @app.post("/detokenize")
    def detokenize(req: DetokenizeRequest) -> dict[str, Any]:
        return {"tokens": req.tokens}

    @app.get("/boom")
    def boom() -> None:
        raise RuntimeError("secret internal detail")

    @app.get("/busy")
    def busy() -> None:
        raise APIError.unavailable("engine is starting", retry_after_s=2)

    return app


@pytest.fixture(scope="module")
def client(processor: InputProcessor) -> TestClient:
    return TestClient(_app(processor), raise_server_exceptions=False)


@pytest.fixture(scope="module")
def processor(default_model_dir: Path) -> InputProcessor:
    """The request processor over the default model's real tokenizer, with a small context."""
    return InputProcessor(Tokenizer.from_dir(default_model_dir), {}, lambda: MAX_MODEL_LEN)


USER = [{"role": "user", "content": "hi"}]


def chat(client: TestClient, **fields: Any) -> Any:
    return client.post("/chat", json={"model": "m", "messages": USER, **fields})


def completion(client: TestClient, **fields: Any) -> Any:
    return client.post("/completions", json={"model": "m", "prompt": "hi", **fields})


def assert_error(response: Any, status: int, param: str | None, type_: str = "invalid_request_error") -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == type_
    assert body["error"]["param"] == param, body
    assert body["error"]["message"]
    return body["error"]["message"]


# --- bad requests ------------------------------------------------------------------------


def test_malformed_json(client: TestClient) -> None:
    r = client.post("/chat", content=b'{"model": "m",', headers={"content-type": "application/json"})
    assert assert_error(r, 400, None).startswith("invalid JSON in request body")


def test_body_not_an_object_or_not_json(client: TestClient) -> None:
    r = client.post("/chat", json=[1, 2])
    assert "JSON object" in assert_error(r, 400, None)
    r = client.post("/chat", content=b'{"model": "m"}', headers={"content-type": "text/plain"})
    assert "Content-Type: application/json" in assert_error(r, 400, None)
    r = client.post("/chat", content=b"", headers={"content-type": "application/json"})
    assert "missing" in assert_error(r, 400, None)


def test_missing_and_null_required_fields(client: TestClient) -> None:
    r = client.post("/chat", json={"messages": USER})
    assert assert_error(r, 400, "model") == "Missing required parameter: 'model'."
    r = client.post("/chat", json={"model": "m", "messages": None})
    assert_error(r, 400, "messages")


def test_wrong_types(client: TestClient) -> None:
    assert "(got 'lots')" in assert_error(chat(client, max_tokens="lots"), 400, "max_tokens")
    assert_error(chat(client, temperature="hot"), 400, "temperature")
    assert_error(chat(client, stream="yes please"), 400, "stream")
    message = assert_error(chat(client, stop=5), 400, "stop")
    assert "a string or a list of strings" in message
    assert_error(chat(client, messages="hi"), 400, "messages")
    assert_error(chat(client, messages=[{"role": "user", "content": 5}]), 400, "messages[0].content")
    assert_error(completion(client, prompt=5), 400, "prompt")
    assert_error(completion(client, prompt=[1, "a"]), 400, "prompt")
    assert_error(completion(client, prompt=[-1]), 400, "prompt")


def test_unknown_field(client: TestClient) -> None:
    message = assert_error(chat(client, frobnicate=True), 400, "frobnicate")
    assert message == "Unrecognized request argument supplied: frobnicate"
    assert_error(completion(client, guided_banana={}), 400, "guided_banana")
    r = chat(client, messages=[{"role": "user", "content": "hi", "colour": "red"}])
    assert_error(r, 400, "messages[0].colour")
    assert_error(chat(client, stream=True, stream_options={"include_usage": True, "x": 1}), 400, "stream_options.x")


def test_nulls_mean_defaults(client: TestClient) -> None:
    r = chat(client, n=None, stream=None, temperature=None, logprobs=None, add_generation_prompt=None)
    assert r.status_code == 200, r.text
    assert r.json()["n"] == 1


def test_messages(client: TestClient) -> None:
    assert "at least 1" in assert_error(chat(client, messages=[]), 400, "messages")
    message = assert_error(chat(client, messages=[{"role": "robot", "content": "hi"}]), 400, "messages[0].role")
    assert "'user'" in message and "'robot'" in message
    assert_error(chat(client, messages=[{"role": "user"}]), 400, "messages[0].content")
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    r = chat(client, messages=[{"role": "user", "content": [{"type": "text", "text": "what is this?"}, image]}])
    message = assert_error(r, 400, "messages[0].content")
    assert "'image_url'" in message and "only 'text'" in message
    audio = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
    r = chat(client, messages=[{"role": "system", "content": "s"}, {"role": "user", "content": [audio]}])
    assert "'input_audio'" in assert_error(r, 400, "messages[1].content")


def test_every_message_field_is_accepted(client: TestClient) -> None:
    messages = [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "name": "bo"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "hmm",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
            "refusal": None,
        },
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]
    assert chat(client, messages=messages).status_code == 200
    req = ChatCompletionRequest(model="m", messages=messages)
    rendered = req.template_messages()
    assert rendered[1] == {"role": "user", "content": "a\nb", "name": "bo"}
    assert "content" not in rendered[2] and rendered[2]["reasoning_content"] == "hmm"


@pytest.mark.parametrize("value", [0, -5])
def test_max_tokens_must_be_positive(client: TestClient, value: int) -> None:
    assert_error(chat(client, max_tokens=value), 400, "max_tokens")
    assert_error(chat(client, max_completion_tokens=value), 400, "max_completion_tokens")
    assert_error(completion(client, max_tokens=value), 400, "max_tokens")


@pytest.mark.parametrize("value", [0, 17, -1])
def test_n_out_of_range(client: TestClient, value: int) -> None:
    assert_error(chat(client, n=value), 400, "n")
    assert_error(completion(client, n=value), 400, "n")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", 2.5),
        ("top_p", 0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("min_p", 1.5),
        ("presence_penalty", 3),
        ("frequency_penalty", -2.5),
        ("repetition_penalty", 0),
        ("min_tokens", -1),
        ("top_logprobs", 21),
        ("seed", 2**64),
        ("stop_token_ids", [-1]),
    ],
)
def test_out_of_range(client: TestClient, field: str, value: Any) -> None:
    extra = {"logprobs": True} if field == "top_logprobs" else {}
    param = "stop_token_ids[0]" if field == "stop_token_ids" else field
    assert_error(chat(client, **{field: value}, **extra), 400, param)


def test_completion_logprobs_range(client: TestClient) -> None:
    assert_error(completion(client, logprobs=6), 400, "logprobs")
    assert_error(completion(client, logprobs=-1), 400, "logprobs")


def test_cross_field_rules(client: TestClient) -> None:
    assert "requires logprobs" in assert_error(chat(client, top_logprobs=3), 400, "top_logprobs")
    assert_error(chat(client, stream_options={"include_usage": True}), 400, "stream_options")
    assert_error(completion(client, stream_options={"include_usage": True}), 400, "stream_options")
    assert_error(chat(client, continue_final_message=True), 400, "continue_final_message")
    assert_error(chat(client, min_tokens=50, max_tokens=10), 400, "min_tokens")
    assert_error(chat(client, stop=["x"] * 17), 400, "stop")
    assert_error(chat(client, stop=""), 400, "stop")


def test_context_length(client: TestClient, processor: InputProcessor) -> None:
    r = chat(client, max_tokens=MAX_MODEL_LEN - PROMPT_LEN + 1)
    assert_error(r, 400, "max_tokens")
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert_error(chat(client, max_completion_tokens=1000), 400, "max_completion_tokens")
    with pytest.raises(PromptError) as exc:
        processor.check_prompt([1] * MAX_MODEL_LEN, "messages")
    assert exc.value.param == "messages" and exc.value.code == "context_length_exceeded"
    with pytest.raises(PromptError) as exc:
        request = CompletionRequest(model="m", prompt="x")
        processor.fit(request.to_sampling_params(), [0] * (MAX_MODEL_LEN - 3), request.param_names)
    assert exc.value.param == "max_tokens"  # the default 16 does not fit


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
        ("tool_choice", "auto"),
        ("tool_choice", {"type": "function", "function": {"name": "f"}}),
        ("functions", [{"name": "f", "parameters": {}}]),
        ("function_call", "auto"),
        ("prediction", {"type": "content", "content": "x"}),
        ("audio", {"voice": "alloy", "format": "wav"}),
        ("modalities", ["text", "audio"]),
        ("verbosity", "low"),
        ("web_search_options", {}),
    ],
)
def test_unsupported_chat_fields(client: TestClient, field: str, value: Any) -> None:
    assert "not supported" in assert_error(chat(client, **{field: value}), 400, field)


def test_reasoning_effort_is_accepted_and_checked(client: TestClient) -> None:
    for effort in ("none", "minimal", "low", "medium", "high"):
        assert chat(client, reasoning_effort=effort).status_code == 200
    message = assert_error(chat(client, reasoning_effort="extreme"), 400, "reasoning_effort")
    assert "'high'" in message  # the error lists the accepted values


def test_structured_output_fields_map_onto_one_spec() -> None:
    base = {"model": "m", "messages": USER}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    json_schema = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": True}}
    assert ChatCompletionRequest(**base, response_format=json_schema).to_sampling_params().structured_outputs == \
        StructuredOutputs(json=schema)
    assert ChatCompletionRequest(**base, response_format={"type": "json_object"}).structured_spec() == \
        StructuredOutputs(json_object=True)
    assert ChatCompletionRequest(**base, response_format={"type": "text"}).structured_spec() is None
    vllm = ChatCompletionRequest(**base, structured_outputs={"json": schema})
    assert vllm.structured_spec() == StructuredOutputs(json=schema)
    assert vllm.param_names.get("structured_outputs") is None  # errors name the vLLM field itself
    regex = CompletionRequest(model="m", prompt="x", structured_outputs={"regex": "[0-9]+"})
    assert regex.to_sampling_params().structured_outputs == StructuredOutputs(regex="[0-9]+")
    for bad, param in [
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": schema}}}, "response_format.json_schema"),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ]:
        with pytest.raises(APIError) as exc:
            ChatCompletionRequest(**base, **bad).to_sampling_params()
        assert exc.value.param == param, bad


def test_harmless_values_of_unsupported_fields(client: TestClient) -> None:
    r = chat(
        client,
        tools=[],
        tool_choice="none",
        response_format={"type": "text"},
        modalities=["text"],
        user="u1",
        metadata={"k": "v"},
        store=False,
        service_tier="auto",
        parallel_tool_calls=True,
    )
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(("field", "value"), [("suffix", "end"), ("best_of", 3)])
def test_unsupported_completion_fields(client: TestClient, field: str, value: Any) -> None:
    assert_error(completion(client, **{field: value}), 400, field)


def test_logit_bias_keys(client: TestClient) -> None:
    assert "'hello'" in assert_error(chat(client, logit_bias={"hello": 5}), 400, "logit_bias")
    assert_error(completion(client, logit_bias={"1.5": 5}), 400, "logit_bias")
    assert_error(chat(client, logit_bias={"-3": 5}), 400, "logit_bias")  # from SamplingParams
    assert_error(chat(client, logit_bias={"3": 500}), 400, "logit_bias")


# --- valid requests map onto SamplingParams ------------------------------------------------


def test_chat_defaults(client: TestClient) -> None:
    r = chat(client)
    assert r.status_code == 200, r.text
    sp = r.json()
    assert sp["max_tokens"] == MAX_MODEL_LEN - PROMPT_LEN  # no max_tokens: up to the context
    # Unset: the model's generation_config fills them later.
    for key in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "logprobs", "seed", "logit_bias"):
        assert sp[key] is None, key
    assert sp["n"] == 1 and sp["stop"] == [] and sp["stop_token_ids"] == [] and sp["skip_special_tokens"] is True


def test_chat_maps_every_field(client: TestClient) -> None:
    r = chat(
        client,
        n=3,
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.1,
        logit_bias={"42": -100, "7": 2.5},
        seed=1234,
        max_tokens=50,
        max_completion_tokens=20,
        min_tokens=2,
        stop="END",
        stop_token_ids=[5, 6],
        include_stop_str_in_output=True,
        ignore_eos=True,
        logprobs=True,
        top_logprobs=4,
        skip_special_tokens=False,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        priority=-1,
        chat_template_kwargs={"enable_thinking": False},
    )
    assert r.status_code == 200, r.text
    assert r.json() == {
        "n": 3,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 40,
        "min_p": 0.05,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "repetition_penalty": 1.1,
        # JSON object keys are strings again on the way out.
        "logit_bias": {"42": -100.0, "7": 2.5},
        "seed": 1234,
        "max_tokens": 20,  # max_completion_tokens wins over max_tokens
        "min_tokens": 2,
        "stop_token_ids": [5, 6],
        "stop": ["END"],
        "include_stop_str_in_output": True,
        "ignore_eos": True,
        "logprobs": 4,
        "prompt_logprobs": None,
        "skip_special_tokens": False,
        "structured_outputs": None,
    }


def test_chat_logprobs_mapping() -> None:
    base = {"model": "m", "messages": USER}
    sp = ChatCompletionRequest(**base, logprobs=True).to_sampling_params()
    assert sp.logprobs == 0
    sp = ChatCompletionRequest(**base, logprobs=False).to_sampling_params()
    assert sp.logprobs is None
    sp = ChatCompletionRequest(**base, logit_bias={"42": 1}).to_sampling_params()
    assert sp.logit_bias == {42: 1.0}
    req = ChatCompletionRequest(**base, stream=True, stream_options={"include_usage": True})
    assert req.stream_include_usage and not req.stream_continuous_usage
    assert not ChatCompletionRequest(**base, stream=True).stream_include_usage


def test_completion_mapping(client: TestClient) -> None:
    sp = completion(client).json()
    assert sp["max_tokens"] == 16 and sp["logprobs"] is None and sp["temperature"] is None
    sp = completion(client, max_tokens=5, logprobs=3, stop=["a", "b"], best_of=2, n=2, echo=False, suffix=None).json()
    assert sp["max_tokens"] == 5 and sp["logprobs"] == 3 and sp["stop"] == ["a", "b"] and sp["n"] == 2


def test_completion_prompt_forms(client: TestClient) -> None:
    assert CompletionRequest(model="m", prompt="hi").prompts() == ["hi"]
    assert CompletionRequest(model="m", prompt=["a", "b"]).prompts() == ["a", "b"]
    assert CompletionRequest(model="m", prompt=[1, 2, 3]).prompts() == [[1, 2, 3]]
    assert CompletionRequest(model="m", prompt=[[1], [2, 3]]).prompts() == [[1], [2, 3]]
    assert_error(completion(client, prompt=[]), 400, "prompt")
    assert_error(completion(client, prompt=[[1], []]), 400, "prompt")


def test_tokenize_requests(client: TestClient) -> None:
    assert client.post("/tokenize", json={"prompt": "hi"}).json() == {"special": True}
    assert client.post("/tokenize", json={"messages": USER}).json() == {"special": False}
    r = client.post("/tokenize", json={"prompt": "hi", "messages": USER})
    assert_error(r, 400, "prompt")
    assert_error(client.post("/tokenize", json={}), 400, "prompt")
    assert client.post("/detokenize", json={"tokens": [1, 2]}).json() == {"tokens": [1, 2]}
    assert_error(client.post("/detokenize", json={"tokens": ["a"]}), 400, "tokens[0]")


# --- other errors ----------------------------------------------------------------------------


def test_unknown_route_and_method(client: TestClient) -> None:
    r = client.post("/v1/nope", json={})
    assert assert_error(r, 404, None, "not_found_error") == "Invalid URL (POST /v1/nope)"
    r = client.get("/chat")
    assert_error(r, 405, None)
    assert r.headers["allow"] == "POST"


def test_unexpected_exception_is_a_generic_500(client: TestClient) -> None:
    r = client.get("/boom")
    message = assert_error(r, 500, None, "server_error")
    assert "secret" not in r.text and "RuntimeError" not in message


def test_api_error_constructors(client: TestClient) -> None:
    r = client.get("/busy")
    assert_error(r, 503, None, "service_unavailable")
    assert r.headers["retry-after"] == "2"
    assert APIError.timeout().status_code == 504
    assert APIError.payload_too_large("too big").status_code == 413
    assert APIError.not_found("no such model", param="model").to_dict() == {
        "error": {"message": "no such model", "type": "not_found_error", "param": "model", "code": None}
    }
    assert APIError.server_error().status_code == 500
    assert APIError.rate_limited("slow down", retry_after_s=0.2).headers == {"Retry-After": "1"}


# --- responses serialize like OpenAI's ------------------------------------------------------


def test_chat_response_shape() -> None:
    resp = ChatCompletionResponse(
        model="m",
        choices=[ChatCompletionResponseChoice(index=0, message=AssistantMessage(content="Hi!"), finish_reason="stop")],
        usage=UsageInfo.of(prompt_tokens=9, completion_tokens=3, cached_tokens=4),
    )
    data = json.loads(resp.model_dump_json())
    assert list(data) == ["id", "object", "created", "model", "choices", "usage"]
    assert data["id"].startswith("chatcmpl-") and data["object"] == "chat.completion"
    assert data["choices"] == [
        {"index": 0, "message": {"role": "assistant", "content": "Hi!"}, "logprobs": None, "finish_reason": "stop"}
    ]
    assert data["usage"] == {
        "prompt_tokens": 9,
        "completion_tokens": 3,
        "total_tokens": 12,
        "prompt_tokens_details": {"cached_tokens": 4},
    }
    thinking = AssistantMessage(content=None, reasoning_content="hmm").model_dump()
    assert thinking == {"role": "assistant", "content": None, "reasoning_content": "hmm"}


def test_chat_chunk_shape() -> None:
    first = ChatCompletionChunk(
        id="chatcmpl-1",
        created=1,
        model="m",
        choices=[ChatCompletionChunkChoice(index=0, delta=DeltaMessage(role="assistant", content=""))],
    )
    assert first.model_dump() == {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        ],
    }
    last = ChatCompletionChunk(
        id="chatcmpl-1", created=1, model="m", choices=[ChatCompletionChunkChoice(index=0, finish_reason="length")]
    )
    assert json.loads(last.model_dump_json())["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "length",
    }
    # include_usage: `usage: null` on every chunk, the numbers on a final chunk with no choices.
    with_null = ChatCompletionChunk(id="c", model="m", choices=[ChatCompletionChunkChoice(index=0)], usage=None)
    assert json.loads(with_null.model_dump_json())["usage"] is None
    final = ChatCompletionChunk(id="c", model="m", usage=UsageInfo.of(1, 2))
    assert json.loads(final.model_dump_json())["choices"] == []
    assert json.loads(final.model_dump_json())["usage"]["total_tokens"] == 3


def test_chat_logprobs_shape() -> None:
    token = ChatLogprobToken(
        token="Hi",
        logprob=-0.1,
        bytes=[72, 105],
        top_logprobs=[
            ChatTopLogprob(token="Hi", logprob=-0.1, bytes=[72, 105]),
            ChatTopLogprob(token="x", logprob=float("-inf")),
        ],
    )
    data = json.loads(ChatLogprobs(content=[token]).model_dump_json())
    assert data == {
        "content": [
            {
                "token": "Hi",
                "logprob": -0.1,
                "bytes": [72, 105],
                "top_logprobs": [
                    {"token": "Hi", "logprob": -0.1, "bytes": [72, 105]},
                    {"token": "x", "logprob": -9999.0, "bytes": None},  # JSON has no -inf
                ],
            }
        ]
    }


def test_completion_shapes() -> None:
    logprobs = CompletionLogprobs(
        tokens=["a", "b"], token_logprobs=[-0.5, -1.0], top_logprobs=[{"a": -0.5}, {"b": -1.0}], text_offset=[0, 1]
    )
    resp = CompletionResponse(
        model="m",
        choices=[CompletionChoice(index=0, text="ab", logprobs=logprobs, finish_reason="length")],
        usage=UsageInfo.of(2, 2),
    )
    data = json.loads(resp.model_dump_json())
    assert data["id"].startswith("cmpl-") and data["object"] == "text_completion"
    assert data["choices"][0] == {
        "index": 0,
        "text": "ab",
        "logprobs": {
            "tokens": ["a", "b"],
            "token_logprobs": [-0.5, -1.0],
            "top_logprobs": [{"a": -0.5}, {"b": -1.0}],
            "text_offset": [0, 1],
        },
        "finish_reason": "length",
    }
    chunk = CompletionChunk(id="cmpl-1", created=1, model="m", choices=[CompletionChoice(index=0, text="a")])
    assert chunk.model_dump() == {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "text": "a", "logprobs": None, "finish_reason": None}],
    }


def test_models_and_tokenize_shapes() -> None:
    models = ModelList(data=[ModelCard(id="smollm2", created=5, max_model_len=8192)])
    assert models.model_dump() == {
        "object": "list",
        "data": [{"id": "smollm2", "object": "model", "created": 5, "owned_by": "tokenline", "max_model_len": 8192}],
    }
    assert TokenizeResponse(tokens=[1, 2], count=2, max_model_len=8).model_dump() == {
        "tokens": [1, 2],
        "count": 2,
        "max_model_len": 8,
    }


def test_random_id() -> None:
    a, b = random_id("chatcmpl"), random_id("chatcmpl")
    assert a != b and a.startswith("chatcmpl-") and len(a) == len("chatcmpl-") + 32
