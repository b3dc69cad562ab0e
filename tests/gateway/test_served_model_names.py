"""Several served model names (vLLM's `--served-model-name a b`) through the real app and a keys
file that restricts tenants by model name: each name is its own model card, the first is the name
responses report, and a tenant sees and uses only the names its keys entry lists."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from tests.gateway.fake_engine import FakeEngineClient
from tokenline.api.app import ServerSettings, build_app
from tokenline.frontend.tokenizer import Tokenizer

ALL_KEY, ALIAS_KEY = "tl-all", "tl-alias-only"


@pytest.fixture
def aliased(tmp_path: Path, default_model_dir: Path) -> Iterator[TestClient]:
    keys = tmp_path / "keys.toml"
    sha = {k: hashlib.sha256(k.encode()).hexdigest() for k in (ALL_KEY, ALIAS_KEY)}
    keys.write_text(f'[[tenant]]\nname = "all"\nkey_sha256 = "{sha[ALL_KEY]}"\n\n'
                    f'[[tenant]]\nname = "alias"\nkey_sha256 = "{sha[ALIAS_KEY]}"\nmodels = ["b"]\n')
    settings = ServerSettings(model=str(default_model_dir), served_model_name=["a", "b"], keys_file=str(keys),
                              usage_db=str(tmp_path / "usage.sqlite3"))
    engine = FakeEngineClient(Tokenizer.from_dir(default_model_dir).encode(" ok", add_special_tokens=False))
    with TestClient(build_app(settings, client=engine), raise_server_exceptions=False) as client:
        yield client


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def chat(client: TestClient, key: str, model: str) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    return client.post("/v1/chat/completions", json=body, headers=auth(key)).json()


def test_every_name_is_a_model_and_the_first_is_reported(aliased: TestClient) -> None:
    listed = aliased.get("/v1/models", headers=auth(ALL_KEY)).json()["data"]
    assert [m["id"] for m in listed] == ["a", "b"] and all(m["object"] == "model" for m in listed)
    for name in ("a", "b"):
        assert aliased.get(f"/v1/models/{name}", headers=auth(ALL_KEY)).json()["id"] == name
        assert chat(aliased, ALL_KEY, name)["model"] == "a"
    missing = aliased.get("/v1/models/c", headers=auth(ALL_KEY))
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert chat(aliased, ALL_KEY, "c")["error"]["code"] == "model_not_found"


def test_a_keys_file_restricts_each_name_on_its_own(aliased: TestClient) -> None:
    assert [m["id"] for m in aliased.get("/v1/models", headers=auth(ALIAS_KEY)).json()["data"]] == ["b"]
    assert aliased.get("/v1/models/a", headers=auth(ALIAS_KEY)).status_code == 404
    assert chat(aliased, ALIAS_KEY, "b")["model"] == "a"
    assert chat(aliased, ALIAS_KEY, "a")["error"]["code"] == "model_not_found"
