"""Through the real app (``build_app`` on a fake engine, keys configured): every route that answers
GET answers HEAD alike (status and headers, no body; a stream's handler is stopped once its head is
out), and a date that is no date (nan, inf, 1e30) is a 400 naming the parameter."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from starlette.routing import Route

from tests.gateway.fake_engine import FakeEngineClient
from tokenline.api.app import ServerSettings, build_app
from tokenline.gateway.keys import add_key

STREAMS = {"/v1/events"}  # a GET that never ends: only its head is compared
PARAMS = {"model_id": "fake-model", "response_id": "resp_none", "request_id": "req-none", "name": "dashboard.js"}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[tuple[TestClient, str]]:
    tmp = tmp_path_factory.mktemp("surface")
    admin = add_key(tmp / "keys.toml", "ops", admin=True)
    settings = ServerSettings(model=str(default_model_dir), served_model_name="fake-model",
                              keys_file=str(tmp / "keys.toml"), usage_db=str(tmp / "usage.sqlite3"))
    with TestClient(build_app(settings, client=FakeEngineClient([1, 2, 3])), raise_server_exceptions=False) as client:
        yield client, admin


def _routes(routes: list[Any]) -> Iterator[Any]:
    """Routes, those of included routers (FastAPI keeps each as one entry) among them."""
    for route in routes:
        included = getattr(route, "original_router", None)
        yield from _routes(included.routes) if included is not None else [route]


def get_paths(client: TestClient) -> list[str]:
    """Every route of the app that answers GET, its path parameters filled in."""
    paths = [r.path for r in _routes(client.app.routes) if isinstance(r, Route) and "GET" in (r.methods or ())]
    return [re.sub(r"\{(\w+)(:\w+)?\}", lambda m: PARAMS[m.group(1)], p) for p in paths]


def test_every_get_route_answers_head(served: tuple[TestClient, str]) -> None:
    client, admin = served
    headers = {"Authorization": f"Bearer {admin}"}
    paths = get_paths(client)
    assert {"/metrics", "/health", "/v1/models", "/admin/usage", "/v1/events", "/openapi.json"} <= set(paths)
    for path in paths:
        head = client.head(path, headers=headers)
        assert head.status_code != 405 and head.content == b"", (path, head.status_code)
        if path in STREAMS:
            assert head.status_code == 200 and head.headers["content-type"].startswith("text/event-stream")
            continue
        got = client.get(path, headers=headers)
        assert head.status_code == got.status_code, (path, head.status_code, got.status_code)
        assert head.headers.get("content-type") == got.headers.get("content-type"), path
        assert head.headers["x-request-id"]
    # Keys are checked as for GET, and a route without GET still refuses HEAD.
    assert client.head("/metrics").status_code == 401
    assert client.head("/tokenize", headers=headers).status_code == 405


def test_dates_that_are_no_dates_are_a_400(served: tuple[TestClient, str]) -> None:
    client, admin = served
    headers = {"Authorization": f"Bearer {admin}"}
    for param, value in (("since", "nan"), ("since", "inf"), ("until", "-inf"), ("until", "1e30"),
                         ("since", "253402300800")):
        response = client.get("/admin/usage", params={param: value}, headers=headers)
        assert response.status_code == 400, (param, value, response.text)
        error = response.json()["error"]
        assert error["param"] == param and "not a date" in error["message"], error
    ok = client.get("/admin/usage", params={"since": "0", "until": "2100-01-01"}, headers=headers)
    assert ok.status_code == 200 and ok.json()["data"] == []
