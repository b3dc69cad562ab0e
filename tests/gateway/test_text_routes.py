"""``/tokenize`` and ``/detokenize`` are requests like any other, through the real app (``build_app``
on a fake engine): a key limited to other models gets the 404 a chat gets, each call counts against
the tenant's RPM, and their bodies have a cap of their own (``--max-tokenize-bytes``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from tests.gateway.fake_engine import FakeEngineClient
from tokenline.api.app import ServerSettings, build_app
from tokenline.gateway.keys import add_key

MODEL = "fake-model"
TOKENIZE_CAP = 4096


@pytest.fixture
def served(tmp_path: Path, default_model_dir: Path) -> Iterator[tuple[TestClient, dict[str, str]]]:
    keys_file = tmp_path / "keys.toml"
    keys = {
        "free": add_key(keys_file, "free"),
        "limited": add_key(keys_file, "limited", requests_per_minute=3),
        "narrow": add_key(keys_file, "narrow", models=["other-model"]),
        "alias": add_key(keys_file, "alias", models=["fake-alias"]),
    }
    settings = ServerSettings(model=str(default_model_dir), served_model_name=[MODEL, "fake-alias"],
                              keys_file=str(keys_file), usage_db=str(tmp_path / "usage.sqlite3"),
                              max_tokenize_bytes=TOKENIZE_CAP)
    with TestClient(build_app(settings, client=FakeEngineClient([1, 2, 3])), raise_server_exceptions=False) as client:
        yield client, keys


def _post(client: TestClient, key: str, path: str, body: dict[str, object]) -> tuple[int, dict]:
    response = client.post(path, json=body, headers={"Authorization": f"Bearer {key}"})
    return response.status_code, response.json()


def test_model_restrictions_hold_for_tokenize_and_detokenize(served: tuple[TestClient, dict[str, str]]) -> None:
    client, keys = served
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    status, chat_error = _post(client, keys["narrow"], "/v1/chat/completions", chat)
    assert status == 404
    for path, body in (("/tokenize", {"prompt": "Hi"}), ("/detokenize", {"tokens": [1, 2]})):
        for model in ({"model": MODEL}, {}):  # named, or left to the server's default
            status, error = _post(client, keys["narrow"], path, {**body, **model})
            assert status == 404, (path, model, error)
            assert (error["error"]["code"], error["error"]["param"]) == ("model_not_found", "model")
        assert _post(client, keys["free"], path, body)[0] == 200
        # A key limited to an alias of the served model may use it, named or not.
        assert _post(client, keys["alias"], path, body)[0] == 200
        assert _post(client, keys["alias"], path, {**body, "model": "fake-alias"})[0] == 200
        assert _post(client, keys["alias"], path, {**body, "model": MODEL})[0] == 404
    assert chat_error["error"]["code"] == "model_not_found"


def test_tokenize_and_detokenize_count_against_rpm(served: tuple[TestClient, dict[str, str]]) -> None:
    client, keys = served
    headers = {"Authorization": f"Bearer {keys['limited']}"}
    assert client.post("/tokenize", json={"prompt": "one"}, headers=headers).status_code == 200
    second = client.post("/detokenize", json={"tokens": [1]}, headers=headers)
    assert second.status_code == 200 and second.headers["x-ratelimit-remaining-requests"] == "1"
    assert client.post("/tokenize", json={"prompt": "three"}, headers=headers).status_code == 200
    refused = client.post("/tokenize", json={"prompt": "four"}, headers=headers)
    assert refused.status_code == 429 and "retry-after" in refused.headers
    assert "requests per minute" in refused.json()["error"]["message"]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    assert client.post("/v1/chat/completions", json=chat, headers=headers).status_code == 429  # one budget
    # Bad requests and unknown models are refused before they count, as chats are.
    assert _post(client, keys["limited"], "/tokenize", {"prompt": "x", "model": "nope"})[0] == 404


def test_tokenize_bodies_have_their_own_cap(served: tuple[TestClient, dict[str, str]]) -> None:
    client, keys = served
    big = "word " * (TOKENIZE_CAP // 5 + 10)
    for path, body in (("/tokenize", {"prompt": big}), ("/detokenize", {"tokens": [1] * TOKENIZE_CAP})):
        status, error = _post(client, keys["free"], path, body)
        assert status == 413 and error["error"]["code"] == "payload_too_large", (path, error)
        assert str(TOKENIZE_CAP) in error["error"]["message"]
    chunked = client.post("/tokenize", content=iter([b'{"prompt": "', big.encode(), b'"}']),
                          headers={"Authorization": f"Bearer {keys['free']}", "Content-Type": "application/json"})
    assert chunked.status_code == 413  # a body without a length is read up to the cap, no further
    # A chat of that size is under the chat's own cap (--max-request-bytes).
    chat = {"model": MODEL, "messages": [{"role": "user", "content": big}], "max_tokens": 2}
    assert _post(client, keys["free"], "/v1/chat/completions", chat)[0] == 200
    assert _post(client, keys["free"], "/tokenize", {"prompt": big[: TOKENIZE_CAP // 2]})[0] == 200
