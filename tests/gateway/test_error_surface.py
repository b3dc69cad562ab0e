"""What errors look like from outside, through the real app (``build_app`` on a fake engine): an
unexpected 500 still carries the request id, invalid Unicode is a 400 naming the field, echoed
values are shortened, and /openapi.json documents the responses really sent."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from tests.gateway.fake_engine import FakeEngineClient
from tokenline.api.app import ServerSettings, build_app
from tokenline.api.body_check import invalid_unicode_path
from tokenline.gateway.errors import APIError, shorten


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[TestClient]:
    usage = tmp_path_factory.mktemp("errors") / "usage.sqlite3"
    app = build_app(
        ServerSettings(model=str(default_model_dir), served_model_name="fake-model", usage_db=str(usage)),
        client=FakeEngineClient([1, 2, 3]),
    )

    async def broken() -> None:
        raise RuntimeError("a bug")

    app.add_api_route("/broken", broken)
    with TestClient(app, raise_server_exceptions=False) as test_client:
        yield test_client


def test_an_unexpected_500_carries_the_request_id(client: TestClient) -> None:
    response = client.get("/broken", headers={"X-Request-Id": "trace-me-500"})
    assert response.status_code == 500
    assert response.headers["x-request-id"] == "trace-me-500"
    assert response.json() == APIError.server_error().to_dict()  # nothing about our internals


def test_invalid_unicode_is_a_400_naming_the_field(client: TestClient) -> None:
    body = '{"model": "fake-model", "messages": [{"role": "user", "content": [{"type": "text", "text": "a\\udc00"}]}]}'
    response = client.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "messages[0].content[0].text"
    assert response.headers["x-request-id"]
    # A valid surrogate pair is one character (an emoji), not an error.
    ok = client.post("/tokenize", content='{"prompt": "\\ud83d\\ude00"}', headers={"Content-Type": "application/json"})
    assert ok.status_code == 200 and ok.json()["count"] >= 1


def test_invalid_unicode_path() -> None:
    assert invalid_unicode_path({"a": ["ok", {"b": "x\ud800"}]}) == "a[1].b"
    assert invalid_unicode_path({"tools": [{"function": {"descr\udfff": 1}}]}) == "tools[0].function"
    assert invalid_unicode_path(["\U0001f600", 1, None, {"k": "v"}]) is None


def test_echoed_values_are_shortened(client: TestClient) -> None:
    assert shorten("x" * 10) == "x" * 10
    assert shorten("y" * 100_000) == "y" * 64 + "…"
    for response in (
        client.get("/v1/models/" + "m" * 10_000),
        client.post("/v1/chat/completions", json={"model": "m" * 100_000, "messages": [{"role": "user", "content": "hi"}]}),
        client.post("/v1/chat/completions", json={"model": "fake-model", "messages": [], "k" * 100_000: 1}),
    ):
        assert response.status_code in (400, 404), response.text[:200]
        assert len(response.text) < 1_000


def test_openapi_lists_the_responses_really_sent(client: TestClient) -> None:
    doc = client.get("/openapi.json").json()
    schemas = doc["components"]["schemas"]
    assert schemas["ErrorResponse"]["required"] == ["error"]
    assert set(schemas["ErrorDetail"]["required"]) == {"message", "type", "param", "code"}
    assert "HTTPValidationError" not in schemas  # validation errors are 400s in the OpenAI shape
    chat = doc["paths"]["/v1/chat/completions"]["post"]["responses"]
    for status in ("400", "401", "404", "413", "429", "500", "503"):
        assert chat[status]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorResponse"}
    assert "422" not in chat
    assert chat["200"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ChatCompletionResponse"}
    assert "text/event-stream" in chat["200"]["content"]
    assert "text/plain" in doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    health = doc["paths"]["/health"]["get"]["responses"]["503"]["content"]["application/json"]["schema"]
    assert health == {"$ref": "#/components/schemas/HealthStatus"}
    # What a refused request really carries matches the documented error schema.
    sent = client.post("/v1/completions", json={"model": "fake-model", "prompt": "hi", "n": 0}).json()
    assert set(sent) == {"error"} and set(sent["error"]) == set(schemas["ErrorDetail"]["properties"])
