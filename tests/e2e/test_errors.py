"""Bad requests against a real server, with raw httpx: every one is a 4xx (never a 500) in
OpenAI's error shape ``{"error": {"message", "type", "param", "code"}}`` naming the field to fix."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import Server, wait_until

MODEL = "SmolLM2-135M-Instruct"
CONTEXT = 8192  # SmolLM2's max_model_len
MSGS = [{"role": "user", "content": "hi"}]
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        yield c


def assert_openai_error(
    response: httpx.Response, status: int, param: str | None, code: str | None = None, type_: str | None = None
) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert list(body) == ["error"], body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"].strip(), error
    assert isinstance(error["type"], str) and error["type"], error
    assert error["param"] == param, error
    assert error["code"] == code, error
    if type_ is not None:
        assert error["type"] == type_, error
    elif status == 400:
        assert error["type"] == "invalid_request_error", error
    return error


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": MSGS, **fields}


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "hi", **fields}


JSON = {"content-type": "application/json"}

# (id, method, path, request kwargs, status, param, code, words the message must contain)
CASES = [
    ("malformed-json", "POST", CHAT, {"content": b'{"model": ', "headers": JSON}, 400, None, None, ["JSON"]),
    ("json-array", "POST", CHAT, {"content": b"[1, 2]", "headers": JSON}, 400, None, None, ["object"]),
    ("json-string", "POST", CHAT, {"content": b'"hello"', "headers": JSON}, 400, None, None, ["object"]),
    ("empty-body", "POST", CHAT, {"content": b"", "headers": JSON}, 400, None, None, []),
    ("form-body", "POST", CHAT, {"content": b"model=x", "headers": {"content-type": "application/x-www-form-urlencoded"}},
     400, None, None, ["JSON"]),
    ("messages-string", "POST", CHAT, {"json": {"model": MODEL, "messages": "hi"}}, 400, "messages", None, []),
    ("temperature-hot", "POST", CHAT, {"json": chat(temperature="hot")}, 400, "temperature", None, []),
    ("max-tokens-float", "POST", CHAT, {"json": chat(max_tokens=1.5)}, 400, "max_tokens", None, []),
    ("model-number", "POST", CHAT, {"json": chat(model=5)}, 400, "model", None, []),
    ("missing-model", "POST", CHAT, {"json": {"messages": MSGS}}, 400, "model", None, ["model"]),
    ("missing-model-completions", "POST", COMPLETIONS, {"json": {"prompt": "hi"}}, 400, "model", None, ["model"]),
    ("missing-prompt", "POST", COMPLETIONS, {"json": {"model": MODEL}}, 400, "prompt", None, ["prompt"]),
    ("unknown-field", "POST", CHAT, {"json": chat(frobnicate=1)}, 400, "frobnicate", None, ["frobnicate"]),
    ("unknown-field-completions", "POST", COMPLETIONS, {"json": completion(frobnicate=1)}, 400, "frobnicate", None,
     ["frobnicate"]),
    ("unknown-field-in-message", "POST", CHAT, {"json": chat(messages=[{"role": "user", "content": "x", "extra": 1}])},
     400, "messages[0].extra", None, ["extra"]),
    ("max-tokens-negative", "POST", CHAT, {"json": chat(max_tokens=-1)}, 400, "max_tokens", None, []),
    ("max-tokens-zero", "POST", CHAT, {"json": chat(max_tokens=0)}, 400, "max_tokens", None, []),
    ("max-tokens-zero-completions", "POST", COMPLETIONS, {"json": completion(max_tokens=0)}, 400, "max_tokens", None, []),
    ("max-tokens-oversized", "POST", CHAT, {"json": chat(max_tokens=100_000)}, 400, "max_tokens",
     "context_length_exceeded", ["8192"]),
    ("max-completion-tokens-oversized", "POST", CHAT, {"json": chat(max_completion_tokens=CONTEXT)}, 400,
     "max_completion_tokens", "context_length_exceeded", ["8192"]),
    ("max-tokens-oversized-completions", "POST", COMPLETIONS, {"json": completion(max_tokens=CONTEXT)}, 400,
     "max_tokens", "context_length_exceeded", ["8192"]),
    ("prompt-plus-max-tokens-over-context", "POST", COMPLETIONS,
     {"json": completion(prompt=[1] * (CONTEXT - 10), max_tokens=16)}, 400, "max_tokens", "context_length_exceeded", []),
    ("empty-messages", "POST", CHAT, {"json": chat(messages=[])}, 400, "messages", None, []),
    ("unknown-role", "POST", CHAT, {"json": chat(messages=[{"role": "wizard", "content": "x"}])}, 400,
     "messages[0].role", None, ["wizard"]),
    ("user-without-content", "POST", CHAT, {"json": chat(messages=[{"role": "user"}])}, 400, "messages[0].content",
     None, []),
    ("message-not-object", "POST", CHAT, {"json": chat(messages=[{"role": "user", "content": "a"}, "x"])}, 400,
     "messages[1]", None, []),
    ("image-content-part", "POST", CHAT,
     {"json": chat(messages=[{"role": "user", "content": [
         {"type": "text", "text": "what is this?"},
         {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
     ]}])}, 400, "messages[0].content", None, ["image_url"]),
    ("chat-prompt-over-context", "POST", CHAT,
     {"json": chat(messages=[{"role": "user", "content": "hello world " * 5000}])}, 400, "messages",
     "context_length_exceeded", ["8192"]),
    ("completion-ids-over-context", "POST", COMPLETIONS, {"json": completion(prompt=[1] * 9000)}, 400, "prompt",
     "context_length_exceeded", ["8192", "9000"]),
    ("completion-text-over-context", "POST", COMPLETIONS, {"json": completion(prompt="hello world " * 5000)}, 400,
     "prompt", "context_length_exceeded", ["8192"]),
    ("completion-prompt-exactly-context", "POST", COMPLETIONS, {"json": completion(prompt=[1] * CONTEXT)}, 400,
     "prompt", "context_length_exceeded", []),
    ("empty-prompt-string", "POST", COMPLETIONS, {"json": completion(prompt="")}, 400, "prompt", None, []),
    ("empty-prompt-list", "POST", COMPLETIONS, {"json": completion(prompt=[])}, 400, "prompt", None, []),
    ("prompt-id-out-of-vocab", "POST", COMPLETIONS, {"json": completion(prompt=[49152])}, 400, "prompt", None, []),
    ("prompt-id-negative", "POST", COMPLETIONS, {"json": completion(prompt=[-5])}, 400, "prompt", None, []),
    ("tools", "POST", CHAT,
     {"json": chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])},
     400, "tools", None, ["tools"]),
    ("response-format-unknown-type", "POST", CHAT, {"json": chat(response_format={"type": "yaml"})}, 400,
     "response_format", None, ["response_format"]),
    ("prompt-logprobs-whole-vocabulary", "POST", COMPLETIONS, {"json": completion(prompt_logprobs=-1)}, 400,
     "prompt_logprobs", None, ["vocabulary"]),
    ("truncate-prompt-tokens-over-context", "POST", COMPLETIONS,
     {"json": completion(truncate_prompt_tokens=CONTEXT + 1)}, 400, "truncate_prompt_tokens", None, ["8192"]),
    ("guided-json-beside-structured-outputs", "POST", CHAT,
     {"json": chat(guided_json={"type": "object"}, structured_outputs={"regex": "a"})}, 400, "guided_json", None,
     ["structured_outputs"]),
    ("suffix", "POST", COMPLETIONS, {"json": completion(suffix="the end")}, 400, "suffix", None, ["suffix"]),
    ("best-of-above-n", "POST", COMPLETIONS, {"json": completion(best_of=3)}, 400, "best_of", None, []),
    ("logit-bias-non-integer-key", "POST", CHAT, {"json": chat(logit_bias={"abc": 1})}, 400, "logit_bias", None,
     ["abc"]),
    ("logit-bias-out-of-vocab", "POST", CHAT, {"json": chat(logit_bias={"999999": 1})}, 400, "logit_bias", None, []),
    ("logit-bias-negative-id", "POST", CHAT, {"json": chat(logit_bias={"-1": 1})}, 400, "logit_bias", None, []),
    ("logit-bias-value-too-big", "POST", CHAT, {"json": chat(logit_bias={"1": 500})}, 400, "logit_bias", None, []),
    ("top-logprobs-without-logprobs", "POST", CHAT, {"json": chat(top_logprobs=2)}, 400, "top_logprobs", None,
     ["logprobs"]),
    ("top-logprobs-too-many", "POST", CHAT, {"json": chat(logprobs=True, top_logprobs=100)}, 400, "top_logprobs",
     None, []),
    ("completion-logprobs-too-many", "POST", COMPLETIONS, {"json": completion(logprobs=6)}, 400, "logprobs", None, []),
    ("n-zero", "POST", CHAT, {"json": chat(n=0)}, 400, "n", None, []),
    ("n-too-many", "POST", CHAT, {"json": chat(n=1000)}, 400, "n", None, []),
    ("stream-options-without-stream", "POST", CHAT, {"json": chat(stream_options={"include_usage": True})}, 400,
     "stream_options", None, ["stream"]),
    ("stream-options-without-stream-completions", "POST", COMPLETIONS,
     {"json": completion(stream=False, stream_options={"include_usage": True})}, 400, "stream_options", None, []),
    ("stream-options-unknown-key", "POST", CHAT, {"json": chat(stream=True, stream_options={"bogus": 1})}, 400,
     "stream_options.bogus", None, ["bogus"]),
    ("empty-stop-string", "POST", CHAT, {"json": chat(stop=[""])}, 400, "stop", None, []),
    ("too-many-stops", "POST", CHAT, {"json": chat(stop=["a"] * 17)}, 400, "stop", None, []),
    ("stop-token-id-out-of-vocab", "POST", CHAT, {"json": chat(stop_token_ids=[10**6])}, 400, "stop_token_ids",
     None, []),
    ("min-tokens-above-max-tokens", "POST", CHAT, {"json": chat(min_tokens=50, max_tokens=1)}, 400, "min_tokens",
     None, []),
    ("seed-above-uint64", "POST", CHAT, {"json": chat(seed=2**70)}, 400, "seed", None, []),
    ("continue-final-with-generation-prompt", "POST", CHAT,
     {"json": chat(messages=[{"role": "assistant", "content": "x"}], continue_final_message=True)}, 400,
     "continue_final_message", None, []),
    ("detokenize-out-of-range", "POST", "/detokenize", {"json": {"tokens": [10**7]}}, 400, "tokens", None, []),
    ("detokenize-negative", "POST", "/detokenize", {"json": {"tokens": [-1]}}, 400, "tokens[0]", None, []),
    ("detokenize-missing-tokens", "POST", "/detokenize", {"json": {}}, 400, "tokens", None, []),
    ("tokenize-neither-prompt-nor-messages", "POST", "/tokenize", {"json": {}}, 400, "prompt", None, []),
]


@pytest.mark.parametrize(
    ("method", "path", "kwargs", "status", "param", "code", "words"),
    [pytest.param(*case[1:], id=case[0]) for case in CASES],
)
def test_bad_request_is_a_400_in_openai_shape(
    client: httpx.Client, method: str, path: str, kwargs: dict, status: int, param: str | None,
    code: str | None, words: list[str],
) -> None:
    error = assert_openai_error(client.request(method, path, **kwargs), status, param, code)
    for word in words:
        assert word in error["message"], error


@pytest.mark.parametrize(
    ("path", "body"),
    [
        pytest.param(CHAT, chat(model="gpt-nope"), id="chat"),
        pytest.param(COMPLETIONS, completion(model="gpt-nope"), id="completions"),
        pytest.param("/tokenize", {"model": "gpt-nope", "prompt": "x"}, id="tokenize"),
        pytest.param("/detokenize", {"model": "gpt-nope", "tokens": [1]}, id="detokenize"),
    ],
)
def test_unknown_model_is_404_model_not_found(client: httpx.Client, path: str, body: dict) -> None:
    error = assert_openai_error(client.post(path, json=body), 404, "model", "model_not_found", "not_found_error")
    assert "gpt-nope" in error["message"]


def test_unknown_route_is_404(client: httpx.Client) -> None:
    for method, path in [("POST", "/v1/nope"), ("GET", "/v1/requests/abc/nothing"), ("GET", "/nope")]:
        error = assert_openai_error(client.request(method, path), 404, None, None, "not_found_error")
        assert path in error["message"]


def test_wrong_method_is_405_with_allow(client: httpx.Client) -> None:
    for method, path, allowed in [("GET", CHAT, "POST"), ("GET", COMPLETIONS, "POST"), ("DELETE", "/v1/models", "GET"),
                                  ("POST", "/health", "GET")]:
        response = client.request(method, path)
        assert_openai_error(response, 405, None, None)
        assert allowed in response.headers.get("allow", ""), response.headers


# --- bugs (see the report): these document what the server should do -----------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [("temperature", "0.5"), ("max_tokens", True), ("n", "2"), ("stream", "true"), ("logprobs", 1)],
)
def test_wrong_json_types_are_not_coerced(client: httpx.Client, field: str, value: Any) -> None:
    body = chat(max_tokens=1)
    body[field] = value
    assert_openai_error(client.post(CHAT, json=body), 400, field)


def test_max_seed_with_n_is_accepted_or_blamed_on_seed(client: httpx.Client) -> None:
    response = client.post(CHAT, json=chat(seed=2**64 - 1, n=2, max_tokens=1, temperature=1.0))
    if response.status_code != 200:
        error = assert_openai_error(response, 400, "seed")
        assert "long long" not in error["message"]


def test_bad_requests_leave_nothing_in_flight(server: Server) -> None:
    def settled() -> bool:
        m = server.metrics()
        return (
            m["tokenline_inflight_requests"] == 0
            and m["vllm:num_requests_running"] == 0
            and m["vllm:num_requests_waiting"] == 0
            and m["tokenline_kv_cache_free_blocks"] == m["tokenline_kv_cache_blocks"]
        )

    assert wait_until(settled, timeout=15), server.metrics()
    assert server.process.poll() is None
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
