"""Who may call what on a keyed server, and request ids scoped per tenant — against real servers.

With keys configured every endpoint needs a key except the probes (/health, /ping, /live);
/metrics needs an admin key by default and shows no tenant names unless the operator asks
(``--metrics-tenant-labels``); ``--metrics-auth key`` lets any tenant's key read it. Two tenants
may use the same X-Request-Id and each keeps its own trace; one tenant reusing an id that is still
in flight gets a 409 ``duplicate_request_id``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import Server, start_server, wait_until
from tokenline.gateway.keys import add_key

MODEL = "SmolLM2-135M-Instruct"
TENANTS = ("admin", "alice", "bob")


@dataclass
class Keyed:
    server: Server
    keys: dict[str, str]

    def request(self, method: str, path: str, tenant: str | None, json: Any = None,
                headers: dict[str, str] | None = None) -> httpx.Response:
        auth = {"Authorization": f"Bearer {self.keys[tenant]}"} if tenant is not None else {}
        return httpx.request(method, self.server.base_url + path, json=json, headers={**auth, **(headers or {})},
                             timeout=60)


def _keyed(tmp: Path, *flags: str) -> Iterator[Keyed]:
    keys_file = tmp / "keys.toml"
    keys = {name: add_key(keys_file, name, admin=name == "admin") for name in TENANTS}
    with start_server(tmp, "--keys", str(keys_file), *flags) as server:
        yield Keyed(server, keys)


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[Keyed]:
    yield from _keyed(tmp_path_factory.mktemp("access"))  # the defaults: admin-only /metrics, no tenant labels


@pytest.fixture(scope="module")
def labelled(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[Keyed]:
    yield from _keyed(tmp_path_factory.mktemp("access-labels"), "--metrics-auth", "key", "--metrics-tenant-labels")


def assert_error(response: httpx.Response, status: int, type_: str, code: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, (response.request.url, response.status_code, response.text)
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == type_, error
    if code is not None:
        assert error["code"] == code, error
    assert response.headers.get("x-request-id")
    return error


def completion(max_tokens: int = 2, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "Hello", "max_tokens": max_tokens, **extra}


# Every route the server has, with a request that succeeds when the key is right.
KEYED_ROUTES = [
    ("POST", "/tokenize", {"model": MODEL, "prompt": "Hello there"}),
    ("POST", "/tokenize", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}),
    ("POST", "/detokenize", {"model": MODEL, "tokens": [1, 2, 3]}),
    ("GET", "/version", None),
    ("GET", "/v1/models", None),
    ("GET", f"/v1/models/{MODEL}", None),
    ("POST", "/v1/completions", completion()),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                      "max_tokens": 2}),
    ("GET", "/openapi.json", None),
    ("GET", "/docs", None),
]


@pytest.mark.parametrize(("method", "path", "body"), KEYED_ROUTES, ids=[f"{m} {p}" for m, p, _ in KEYED_ROUTES])
def test_every_endpoint_but_the_probes_needs_a_key(keyed: Keyed, method: str, path: str, body: Any) -> None:
    assert_error(keyed.request(method, path, None, body), 401, "authentication_error", "invalid_api_key")
    wrong = httpx.request(method, keyed.server.base_url + path, json=body, timeout=30,
                          headers={"Authorization": "Bearer tl-wrong"})
    assert_error(wrong, 401, "authentication_error")
    ok = keyed.request(method, path, "alice", body)
    assert ok.status_code == 200, ok.text


def test_probes_need_no_key(keyed: Keyed) -> None:
    for method, path in (("GET", "/health"), ("GET", "/ready"), ("GET", "/ping"), ("POST", "/ping")):
        assert keyed.request(method, path, None).status_code == 200, path
    # /live is the liveness route (engine supervisor); whatever it answers, it is never gated.
    assert keyed.request("GET", "/live", None).status_code != 401


def test_metrics_need_an_admin_key_by_default_and_name_no_tenant(keyed: Keyed) -> None:
    done = keyed.request("POST", "/v1/completions", "bob", completion(max_tokens=3))
    assert done.status_code == 200, done.text
    assert_error(keyed.request("GET", "/metrics", None), 401, "authentication_error")
    assert_error(keyed.request("GET", "/metrics", "alice"), 403, "permission_error")
    scraped = keyed.request("GET", "/metrics", "admin")
    assert scraped.status_code == 200
    text = scraped.text
    assert "vllm:generation_tokens_total" in text
    # Spend is recorded (bob's request above) but summed over tenants: no tenant label, no name.
    assert f'tokenline_spend_usd_total{{model_name="{MODEL}"}}' in text, text
    assert "tenant=" not in text
    for name in TENANTS:
        assert name not in text, name


def test_metrics_auth_key_and_tenant_labels_when_asked(labelled: Keyed) -> None:
    assert labelled.request("POST", "/v1/completions", "alice", completion()).status_code == 200
    assert_error(labelled.request("GET", "/metrics", None), 401, "authentication_error")
    scraped = labelled.request("GET", "/metrics", "bob")  # any tenant's key
    assert scraped.status_code == 200
    assert f'tokenline_spend_usd_total{{model_name="{MODEL}",tenant="alice"}}' in scraped.text


def test_two_tenants_with_one_request_id_keep_their_own_traces(keyed: Keyed) -> None:
    request_id = "shared-id-1"
    tokens = {}
    for tenant, max_tokens in (("alice", 2), ("bob", 4)):
        response = keyed.request("POST", "/v1/completions", tenant, completion(max_tokens, ignore_eos=True),
                                 headers={"X-Request-Id": request_id})
        assert response.status_code == 200, response.text
        assert response.headers["x-request-id"] == request_id
        tokens[tenant] = response.json()["usage"]["completion_tokens"]
    path = f"/v1/requests/{request_id}/trace"
    for tenant in ("alice", "bob"):
        trace = keyed.request("GET", path, tenant)
        assert trace.status_code == 200, (tenant, trace.text)
        assert trace.json()["tenant"] == tenant
        assert trace.json()["completion_tokens"] == tokens[tenant]
    # An admin names the tenant whose request it means.
    for tenant in ("alice", "bob"):
        assert keyed.request("GET", f"{path}?tenant={tenant}", "admin").json()["tenant"] == tenant


def test_a_duplicate_request_id_in_flight_is_a_409(keyed: Keyed) -> None:
    request_id = "dup-in-flight"
    headers = {"Authorization": f"Bearer {keyed.keys['alice']}", "X-Request-Id": request_id}
    body = completion(max_tokens=500, ignore_eos=True, stream=True)
    with httpx.stream("POST", keyed.server.base_url + "/v1/completions", json=body, headers=headers,
                      timeout=120) as streaming:
        assert streaming.status_code == 200
        lines = streaming.iter_lines()  # kept: a closed line iterator would close the stream
        for line in lines:
            if line.startswith("data: "):
                break  # under way
        again = keyed.request("POST", "/v1/completions", "alice", completion(), headers={"X-Request-Id": request_id})
        error = assert_error(again, 409, "invalid_request_error", "duplicate_request_id")
        assert request_id in error["message"]
        # Another tenant's namespace is its own: the same id is free there.
        other = keyed.request("POST", "/v1/completions", "bob", completion(), headers={"X-Request-Id": request_id})
        assert other.status_code == 200, other.text
    # The first request ends (its client left); then its id may be used again.
    assert wait_until(lambda: keyed.request("POST", "/v1/completions", "alice", completion(max_tokens=1),
                                            headers={"X-Request-Id": request_id}).status_code == 200, timeout=60)
