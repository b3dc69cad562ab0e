"""What the server builds at start so its first chat does not: the tokenizer's user-text copy and
the chat templates compiled (``Tokenizer.warm_up``, called from the app's lifespan while the engine
loads). A template that does not compile is reported at start; the server still serves the rest."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from tests.gateway.fake_engine import FakeEngineClient
from tokenline.api.app import ServerSettings, build_app
from tokenline.frontend.chat_template import compile_template
from tokenline.frontend.tokenizer import Tokenizer

CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


def _app(default_model_dir: Path, tmp_path: Path, **settings: object) -> tuple[object, FakeEngineClient]:
    reply = Tokenizer.from_dir(default_model_dir).encode(" Hello there", add_special_tokens=False)
    engine = FakeEngineClient(reply)
    config = ServerSettings(model=str(default_model_dir), served_model_name="m", usage_db=str(tmp_path / "u.db"),
                            **settings)
    return build_app(config, client=engine), engine


def test_the_first_chat_finds_the_tokenizer_copy_and_the_template_built(default_model_dir: Path,
                                                                       tmp_path: Path) -> None:
    app, engine = _app(default_model_dir, tmp_path)
    tokenizer = app.state.serving.processor.tokenizer
    assert "guard" not in tokenizer.__dict__  # a cached_property: nothing built before the start
    compile_template.cache_clear()
    with TestClient(app) as client:
        assert "guard" in tokenizer.__dict__ and engine.requests == []
        hits = compile_template.cache_info().hits
        assert compile_template.cache_info().currsize >= 1
        response = client.post("/v1/chat/completions", json=CHAT)
        assert response.status_code == 200, response.text
        assert compile_template.cache_info().hits > hits  # the request rendered with the compiled one


def test_a_template_that_does_not_compile_is_reported_at_start(default_model_dir: Path, tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    app, _ = _app(default_model_dir, tmp_path, chat_template="{% if messages %}unclosed")
    with caplog.at_level(logging.WARNING, logger="tokenline"), TestClient(app) as client:
        warned = [r.getMessage() for r in caplog.records if "chat template 'default'" in r.getMessage()]
        assert warned and "does not compile" in warned[0], [r.getMessage() for r in caplog.records]
        chat = client.post("/v1/chat/completions", json=CHAT)
        assert chat.status_code == 400, chat.text
        assert chat.json()["error"]["param"] == "messages"
        completion = client.post("/v1/completions", json={"model": "m", "prompt": "Hi", "max_tokens": 2})
        assert completion.status_code == 200, completion.text
