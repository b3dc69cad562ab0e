"""Readiness as vLLM has it, through the real app on an engine held in its loading state: until the
engine can serve, only /health, /live, /ping and /metrics answer (the probes saying so); every
other route, /v1/models first, is a 503 in the OpenAI error shape with Retry-After. Scripts that
wait for /v1/models therefore wait for the model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from tests.gateway.fake_engine import FakeEngineClient
from tokenline.api.app import ServerSettings, build_app
from tokenline.engine.messages import EngineReady

CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


class LoadingEngine(FakeEngineClient):
    """Started, but ready only when the test says so."""

    def start(self) -> None:
        self._started = True

    def finish_loading(self) -> None:
        self._set_ready(EngineReady(self.max_model_len, num_kv_blocks=64, block_size=16, dtype="none"))


@pytest.fixture
def loading(default_model_dir: Path, tmp_path: Path) -> Iterator[tuple[TestClient, LoadingEngine]]:
    engine = LoadingEngine([1, 2])
    settings = ServerSettings(model=str(default_model_dir), served_model_name="m", usage_db=str(tmp_path / "u.db"))
    with TestClient(build_app(settings, client=engine), raise_server_exceptions=False) as client:
        yield client, engine


def test_only_the_probes_and_metrics_answer_until_the_engine_is_ready(loading) -> None:
    client, engine = loading
    health = client.get("/health")
    assert health.status_code == 503 and health.json()["status"] == "loading"
    assert client.get("/live").status_code == 200
    assert client.get("/ping").status_code == 503  # /health's answer
    assert client.get("/metrics").status_code == 200
    refused = [
        client.get("/v1/models"), client.get("/v1/models/m"), client.get("/version"),
        client.post("/v1/chat/completions", json=CHAT),
        client.post("/v1/completions", json={"model": "m", "prompt": "Hi"}),
        client.post("/tokenize", json={"prompt": "Hi"}), client.post("/detokenize", json={"tokens": [1]}),
        client.get("/openapi.json"), client.get("/dashboard"),
    ]
    for response in refused:
        assert response.status_code == 503, (response.request.url, response.text)
        error = response.json()["error"]
        assert error["type"] == "service_unavailable" and "loading" in error["message"]
        assert int(response.headers["retry-after"]) >= 1 and response.headers["x-request-id"]
    assert engine.requests == []

    engine.finish_loading()
    assert client.get("/health").status_code == 200
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["m"]
    assert client.post("/tokenize", json={"prompt": "Hi"}).status_code == 200
    assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
