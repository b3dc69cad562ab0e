"""The edge against real servers, with raw httpx: tenant keys (401/403/404, reload by admin call
and by SIGHUP, no key text in logs or files), limits refused before any work (413, 400s),
per-tenant rate limits (TPM with its exact admission arithmetic, RPM, concurrency, daily quota,
refund of unused reservations), a TPM shared by two servers through a real Redis, and per-request
stage traces (with tenant isolation and prompt privacy in the log).

Servers (each start costs a few seconds): one keys server shared by the module, and, for the
Redis test, a redis-server plus two tokenline servers sharing it.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import Server, free_port, start_server, wait_healthy, wait_until
from tokenline.gateway.keys import add_key, hash_key

MODEL = "SmolLM2-135M-Instruct"

# The token-bucket admission arithmetic: every request of the burst costs PROMPT + MAX_TOKENS at
# admission (ignore_eos: it then uses all of them, so settlement refunds nothing).
PROMPT_IDS = list(range(1000, 1010))
P, M = len(PROMPT_IDS), 20
TPM = 100  # floor(100 / 30) = 3 admitted; the 10 left over need 12 s of refill (100/60 per s) to reach 30
BURST = 12

MAX_REQUEST_BYTES = 4096
MAX_MESSAGES = 4
MAX_TOKENS_CAP = 256
SECRET_PROMPT = "zebra-quokka-7781 please say hello"


# --- helpers --------------------------------------------------------------------------------


def auth(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key is not None else {}


def completion_body(max_tokens: int = M, prompt: Any = None, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": PROMPT_IDS if prompt is None else prompt, "max_tokens": max_tokens,
            "ignore_eos": True, **extra}


def chat_body(content: str = "Hi", **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4, **extra}


def assert_openai_error(response: httpx.Response, status: int, type_: str, code: str | None = None,
                        param: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, (response.status_code, response.text)
    body = response.json()
    assert list(body) == ["error"], body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["type"] == type_, error
    assert isinstance(error["message"], str) and error["message"], error
    if code is not None:
        assert error["code"] == code, error
    if param is not None:
        assert error["param"] == param, error
    assert response.headers.get("x-request-id"), response.headers
    return error


def burst(send: Callable[[int], httpx.Response], count: int) -> list[httpx.Response]:
    """``count`` requests released together (a barrier), each on its own connection."""
    gate = threading.Barrier(count, timeout=30)

    def one(i: int) -> httpx.Response:
        gate.wait()
        return send(i)

    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(one, range(count)))


def ratelimit_headers(response: httpx.Response) -> dict[str, list[str]]:
    return {name: response.headers.get_list(name) for name in response.headers if name.startswith("x-ratelimit-")}


def header(response: httpx.Response, name: str) -> str:
    """A header that must appear exactly once."""
    values = response.headers.get_list(name)
    assert len(values) == 1, (name, response.headers)
    return values[0]


def finished_log_lines(log: str) -> list[dict[str, Any]]:
    """The structured ``request {...}`` lines the server logs when a request's receipt is written."""
    lines = []
    for line in log.splitlines():
        at = line.find('request {"event": "request_finished"')
        if at >= 0:
            lines.append(json.loads(line[at + len("request "):]))
    return lines


# --- the keys server --------------------------------------------------------------------------


@dataclass
class KeysServer:
    server: Server
    keys_file: Path
    keys: dict[str, str]  # tenant name -> key

    def url(self, path: str) -> str:
        return f"{self.server.base_url}{path}"

    def post(self, tenant: str | None, path: str, body: dict[str, Any], **kwargs: Any) -> httpx.Response:
        key = self.keys[tenant] if tenant is not None else None
        return httpx.post(self.url(path), json=body, headers={**auth(key), **kwargs.pop("headers", {})},
                          timeout=kwargs.pop("timeout", 60), **kwargs)

    def get(self, tenant: str | None, path: str, **kwargs: Any) -> httpx.Response:
        key = self.keys[tenant] if tenant is not None else None
        return httpx.get(self.url(path), headers=auth(key), timeout=30, **kwargs)


@pytest.fixture(scope="module")
def edge(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[KeysServer]:
    tmp = tmp_path_factory.mktemp("edge")
    keys_file = tmp / "keys.toml"
    keys = {
        "admin": add_key(keys_file, "admin", admin=True),
        "alice": add_key(keys_file, "alice"),
        "bob": add_key(keys_file, "bob"),
        "restricted": add_key(keys_file, "restricted", models=["some-other-model"]),
        "tpm": add_key(keys_file, "tpm", tokens_per_minute=TPM),
        "rpm": add_key(keys_file, "rpm", requests_per_minute=3),
        "conc": add_key(keys_file, "conc", max_concurrent=1),
        "daily": add_key(keys_file, "daily", daily_tokens=50),
        "refund": add_key(keys_file, "refund", tokens_per_minute=300),
    }
    with start_server(tmp, "--keys", str(keys_file), "--max-request-bytes", str(MAX_REQUEST_BYTES),
                      "--max-messages", str(MAX_MESSAGES), "--max-tokens-cap", str(MAX_TOKENS_CAP)) as server:
        yield KeysServer(server, keys_file, keys)


# --- 1. keys ----------------------------------------------------------------------------------


def test_missing_or_wrong_key_is_401_in_openai_shape(edge: KeysServer) -> None:
    for headers in ({}, {"Authorization": "Bearer tl-not-a-key"}, {"Authorization": "Basic abc"},
                    {"Authorization": f"Bearer {edge.keys['alice']}x"}):
        for method, path, body in (("POST", "/v1/chat/completions", chat_body()), ("GET", "/v1/models", None),
                                   ("GET", "/admin/usage", None)):
            response = httpx.request(method, edge.url(path), json=body, headers=headers, timeout=30)
            assert_openai_error(response, 401, "authentication_error", code="invalid_api_key")
            assert response.headers.get("www-authenticate") == "Bearer"
    # Health stays open (probes carry no key); /metrics needs an admin key by default.
    assert httpx.get(edge.url("/health"), timeout=10).status_code == 200
    assert_openai_error(httpx.get(edge.url("/metrics"), timeout=10), 401, "authentication_error")


def test_a_valid_key_works(edge: KeysServer) -> None:
    response = edge.post("alice", "/v1/chat/completions", chat_body())
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] >= 1
    models = edge.get("alice", "/v1/models")
    assert [m["id"] for m in models.json()["data"]] == [MODEL]


def test_tenant_without_the_model_gets_404_and_sees_no_models(edge: KeysServer) -> None:
    response = edge.post("restricted", "/v1/chat/completions", chat_body())
    assert_openai_error(response, 404, "not_found_error", code="model_not_found", param="model")
    response = edge.post("restricted", "/v1/completions", completion_body(max_tokens=1))
    assert_openai_error(response, 404, "not_found_error", code="model_not_found", param="model")
    models = edge.get("restricted", "/v1/models")
    assert models.status_code == 200
    assert models.json() == {"object": "list", "data": []}


def test_non_admin_key_gets_403_on_admin_endpoints(edge: KeysServer) -> None:
    for tenant in ("alice", "tpm"):
        assert_openai_error(edge.get(tenant, "/admin/usage"), 403, "permission_error")
        assert_openai_error(edge.post(tenant, "/admin/keys/reload", {}), 403, "permission_error")
    assert edge.get("admin", "/admin/usage").status_code == 200


def test_reload_by_admin_call_and_by_sighup(edge: KeysServer) -> None:
    late = add_key(edge.keys_file, "late")
    edge.keys["late"] = late
    # Not known until the server re-reads the file.
    assert_openai_error(edge.get("late", "/v1/models"), 401, "authentication_error")
    response = edge.post("admin", "/admin/keys/reload", {})
    assert response.status_code == 200, response.text
    assert response.json() == {"tenants": len(edge.keys)}
    assert edge.get("late", "/v1/models").status_code == 200
    ok = edge.post("late", "/v1/completions", completion_body(max_tokens=2))
    assert ok.status_code == 200, ok.text

    hup = add_key(edge.keys_file, "hup")
    edge.keys["hup"] = hup
    assert edge.get("hup", "/v1/models").status_code == 401
    os.kill(edge.server.process.pid, signal.SIGHUP)
    assert wait_until(lambda: edge.get("hup", "/v1/models").status_code == 200, timeout=10)
    assert edge.server.process.poll() is None  # SIGHUP reloads; it does not stop the server
    assert edge.get("alice", "/v1/models").status_code == 200


def test_reload_of_a_broken_file_keeps_the_tenants(edge: KeysServer) -> None:
    good = edge.keys_file.read_text()
    try:
        edge.keys_file.write_text(good + "\n[[tenant]]\nname = \"broken\"\n")  # no key_sha256
        response = edge.post("admin", "/admin/keys/reload", {})
        assert_openai_error(response, 400, "invalid_request_error")
        os.kill(edge.server.process.pid, signal.SIGHUP)  # the signal path must survive it as well
        time.sleep(0.5)
        assert edge.server.process.poll() is None
        assert edge.get("alice", "/v1/models").status_code == 200
    finally:
        edge.keys_file.write_text(good)
    assert edge.post("admin", "/admin/keys/reload", {}).status_code == 200


def test_key_text_is_in_neither_the_log_nor_the_keys_file(edge: KeysServer) -> None:
    # Make sure every key has been presented at least once (also as a wrong key, which is logged
    # most easily by careless code).
    for tenant in edge.keys:
        edge.get(tenant, "/v1/models")
    httpx.get(edge.url("/v1/models"), headers=auth("tl-wrong-" + edge.keys["alice"][3:]), timeout=10)
    log = edge.server.log()
    text = edge.keys_file.read_text()
    for tenant, key in edge.keys.items():
        assert key not in log, tenant
        assert key[3:] not in log, tenant  # not even without its prefix
        assert key not in text, tenant
        assert hash_key(key) in text, tenant  # only the hash is stored
    assert "tl-wrong-" not in log


# --- 2. limits refused before any work --------------------------------------------------------


def test_body_above_the_limit_is_413(edge: KeysServer) -> None:
    big = chat_body("x" * (MAX_REQUEST_BYTES + 100))
    response = edge.post("alice", "/v1/chat/completions", big)
    error = assert_openai_error(response, 413, "invalid_request_error", code="payload_too_large")
    assert str(MAX_REQUEST_BYTES) in error["message"]
    # Before authentication too: an oversized body is refused unread whoever sends it.
    response = edge.post(None, "/v1/chat/completions", big)
    assert_openai_error(response, 413, "invalid_request_error", code="payload_too_large")
    # Just under the limit is read and served.
    small = chat_body("x" * 100)
    assert edge.post("alice", "/v1/chat/completions", small).status_code == 200


def test_chunked_body_above_the_limit_is_413(edge: KeysServer) -> None:
    """Regression: this was a 400 "There was an error parsing the body" (the limit was enforced
    inside FastAPI's body reading, which turns any exception into that 400)."""
    payload = json.dumps(chat_body("x" * (MAX_REQUEST_BYTES + 100))).encode()

    def chunks() -> Iterator[bytes]:
        for i in range(0, len(payload), 512):
            yield payload[i:i + 512]

    response = httpx.post(edge.url("/v1/chat/completions"), content=chunks(),
                          headers={**auth(edge.keys["alice"]), "Content-Type": "application/json"}, timeout=30)
    assert response.request.headers.get("transfer-encoding") == "chunked"
    assert "content-length" not in response.request.headers
    assert_openai_error(response, 413, "invalid_request_error", code="payload_too_large")


def test_chunked_body_under_the_limit_is_served(edge: KeysServer) -> None:
    payload = json.dumps(chat_body("hello")).encode()
    response = httpx.post(edge.url("/v1/chat/completions"), content=iter([payload[:10], payload[10:]]),
                          headers={**auth(edge.keys["alice"]), "Content-Type": "application/json"}, timeout=30)
    assert response.request.headers.get("transfer-encoding") == "chunked"
    assert response.status_code == 200, response.text


def test_too_many_messages_is_400(edge: KeysServer) -> None:
    messages = [{"role": "user", "content": f"m{i}"} for i in range(MAX_MESSAGES + 1)]
    response = edge.post("alice", "/v1/chat/completions", {**chat_body(), "messages": messages})
    error = assert_openai_error(response, 400, "invalid_request_error", param="messages")
    assert str(MAX_MESSAGES) in error["message"]
    ok = edge.post("alice", "/v1/chat/completions", {**chat_body(), "messages": messages[:MAX_MESSAGES]})
    assert ok.status_code == 200, ok.text


def test_max_tokens_above_the_cap_is_400(edge: KeysServer) -> None:
    cases = (
        ("/v1/completions", completion_body(max_tokens=MAX_TOKENS_CAP + 1), "max_tokens"),
        ("/v1/chat/completions", chat_body(max_tokens=MAX_TOKENS_CAP + 1), "max_tokens"),
        ("/v1/chat/completions", {**chat_body(), "max_completion_tokens": MAX_TOKENS_CAP + 1}, "max_completion_tokens"),
    )
    for path, body, param in cases:
        error = assert_openai_error(edge.post("alice", path, body), 400, "invalid_request_error", param=param)
        assert str(MAX_TOKENS_CAP) in error["message"]
    # The cap itself is allowed (a 2-token prompt + 256 fits the context).
    ok = edge.post("alice", "/v1/completions", {**completion_body(max_tokens=MAX_TOKENS_CAP), "ignore_eos": False,
                                                "stop": [" "], "prompt": "Hello"})
    assert ok.status_code == 200, ok.text


# --- 3. rate limits ---------------------------------------------------------------------------


def test_tpm_burst_admits_exactly_what_the_bucket_holds(edge: KeysServer) -> None:
    def send(i: int) -> httpx.Response:
        return edge.post("tpm", "/v1/completions", completion_body(), headers={"X-Request-Id": f"tpm-burst-{i}"})

    responses = burst(send, BURST)
    admitted = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code == 429]
    assert len(admitted) + len(refused) == BURST, [(r.status_code, r.text) for r in responses]
    assert len(admitted) == TPM // (P + M)
    assert sum(r.json()["usage"]["prompt_tokens"] + M for r in admitted) <= TPM
    for r in admitted:
        assert r.json()["usage"] == {"prompt_tokens": P, "completion_tokens": M, "total_tokens": P + M,
                                     "prompt_tokens_details": {"cached_tokens": r.json()["usage"]
                                                               ["prompt_tokens_details"]["cached_tokens"]}}
        assert r.headers["x-ratelimit-limit-tokens"] == str(TPM)
        assert 0 <= int(r.headers["x-ratelimit-remaining-tokens"]) < TPM
        assert re.fullmatch(r"(\d+ms|[\dhm.]+s)", r.headers["x-ratelimit-reset-tokens"])
    for r in refused:
        error = assert_openai_error(r, 429, "rate_limit_error", code="rate_limit_exceeded")
        assert "tokens per minute" in error["message"]
        assert header(r, "x-ratelimit-limit-tokens") == str(TPM)
        # Fewer than one request's worth was left (what refused it).
        remaining = int(header(r, "x-ratelimit-remaining-tokens"))
        assert remaining < P + M
        assert header(r, "x-ratelimit-reset-tokens")
        # Retry-After is when the bucket will hold P + M again (refill TPM/60 per s), never earlier.
        retry_after = int(r.headers["retry-after"])
        assert retry_after >= 1
        assert math.ceil((P + M - 1 - remaining) * 60 / TPM) <= retry_after <= math.ceil((P + M - remaining) * 60 / TPM)


def test_a_refusal_carries_each_ratelimit_header_once(edge: KeysServer) -> None:
    """Regression: a refusal carried its own x-ratelimit-* headers and the door's peeked ones again."""
    # A request larger than the whole TPM can never fit: a 400 without Retry-After (not a 429).
    response = edge.post("tpm", "/v1/completions", completion_body(max_tokens=TPM))
    assert_openai_error(response, 400, "invalid_request_error", code="rate_limit_exceeds_capacity")
    assert "retry-after" not in response.headers
    headers = ratelimit_headers(response)
    assert headers, response.headers
    assert all(len(values) == 1 for values in headers.values()), headers


def test_successful_responses_carry_each_ratelimit_header_once(edge: KeysServer) -> None:
    response = edge.post("refund", "/v1/completions", completion_body(max_tokens=1))
    assert response.status_code == 200, response.text
    headers = ratelimit_headers(response)
    assert set(headers) == {"x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens"}
    assert all(len(values) == 1 for values in headers.values()), headers


def test_requests_per_minute(edge: KeysServer) -> None:
    statuses = []
    for i in range(4):
        response = edge.post("rpm", "/v1/completions", completion_body(max_tokens=1))
        statuses.append(response.status_code)
        if i < 3:
            assert response.status_code == 200, response.text
            assert response.headers["x-ratelimit-limit-requests"] == "3"
            assert response.headers["x-ratelimit-remaining-requests"] == str(2 - i)
            assert "x-ratelimit-limit-tokens" not in response.headers  # no TPM on this tenant
    assert statuses == [200, 200, 200, 429]
    error = assert_openai_error(response, 429, "rate_limit_error", code="rate_limit_exceeded")
    assert "requests per minute" in error["message"]
    assert 1 <= int(response.headers["retry-after"]) <= 20  # one request refills in 60 / 3 s
    assert response.headers.get_list("x-ratelimit-remaining-requests")[0] == "0"


def test_max_concurrent_refuses_a_second_request_while_the_first_streams(edge: KeysServer) -> None:
    body = completion_body(max_tokens=MAX_TOKENS_CAP, stream=True)
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", edge.url("/v1/completions"), json=body, headers=auth(edge.keys["conc"])) as first:
            assert first.status_code == 200
            lines = first.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))  # it is generating now
            second = edge.post("conc", "/v1/completions", completion_body(max_tokens=1))
            error = assert_openai_error(second, 429, "rate_limit_error", code="rate_limit_exceeded")
            assert "concurrent" in error["message"]
            assert int(second.headers["retry-after"]) >= 1
    # The first stream was dropped: once its receipt is written, its slot is free again.
    assert wait_until(
        lambda: edge.post("conc", "/v1/completions", completion_body(max_tokens=1)).status_code == 200, timeout=15
    )
    # And a finished request frees its slot before its response is sent: back to back both pass.
    for _ in range(2):
        assert edge.post("conc", "/v1/completions", completion_body(max_tokens=1)).status_code == 200


def test_daily_token_quota(edge: KeysServer) -> None:
    first = edge.post("daily", "/v1/completions", completion_body())  # charges and uses P + M = 30 of 50
    assert first.status_code == 200, first.text
    second = edge.post("daily", "/v1/completions", completion_body())
    error = assert_openai_error(second, 429, "rate_limit_error", code="insufficient_quota")
    assert "quota" in error["message"].lower()
    assert int(second.headers["retry-after"]) >= 1
    # A single request above the whole quota can never pass: a 400 without a retry hint.
    huge = edge.post("daily", "/v1/completions", completion_body(max_tokens=60))
    assert_openai_error(huge, 400, "invalid_request_error", code="rate_limit_exceeds_capacity")
    assert "retry-after" not in huge.headers
    # What is left (20) still admits a request that fits.
    fits = edge.post("daily", "/v1/completions", completion_body(max_tokens=50 - 30 - P))
    assert fits.status_code == 200, fits.text


def test_unused_reserved_tokens_are_refunded(edge: KeysServer) -> None:
    max_tokens = 120
    start = time.monotonic()
    response = edge.post("refund", "/v1/chat/completions", {
        **chat_body("Reply with the single word OK."), "max_tokens": max_tokens, "temperature": 0, "stop": [" "],
    })
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert response.json()["choices"][0]["finish_reason"] == "stop"
    assert usage["completion_tokens"] < max_tokens  # precondition: it ended early
    after_charge = int(response.headers["x-ratelimit-remaining-tokens"])
    limit = int(response.headers["x-ratelimit-limit-tokens"])
    # Any later response shows the level after the refund (GET /v1/models charges nothing).
    later = edge.get("refund", "/v1/models")
    elapsed = time.monotonic() - start
    now = int(later.headers["x-ratelimit-remaining-tokens"])
    produced = usage["completion_tokens"]  # what was billed (the engine may run a token past the stop)
    assert now >= after_charge + (max_tokens - produced), (after_charge, now, usage)
    assert now <= min(limit, after_charge + (max_tokens - produced) + limit / 60 * elapsed + 1), (after_charge, now)


# --- 4. one limit shared by two servers through Redis -----------------------------------------


# Short requests here: two engines sharing two cores slow each other down a lot. 40 // (10 + 2) = 3
# admitted; the 4 tokens left need 12 s of refill (40/60 per s) to reach 12.
SHARED_TPM, SHARED_M = 40, 2


@dataclass
class SharedPair:
    redis_url: str
    redis: subprocess.Popen
    servers: list[Server]
    key: str

    def post(self, i: int, max_tokens: int = SHARED_M) -> httpx.Response:
        return httpx.post(f"{self.servers[i % 2].api_url}/completions", json=completion_body(max_tokens),
                          headers=auth(self.key), timeout=60)


@pytest.fixture(scope="module")
def shared_pair(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[SharedPair]:
    """A real redis-server (no persistence) and two tokenline servers whose limits live in it."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed")
    tmp = tmp_path_factory.mktemp("redis")
    port = free_port()
    keys_file = tmp / "keys.toml"
    key = add_key(keys_file, "shared", tokens_per_minute=SHARED_TPM)
    with open(tmp / "redis.log", "wb") as log:
        redis_process = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(tmp)],
            stdout=log, stderr=subprocess.STDOUT,
        )
    try:
        import redis

        client = redis.Redis(host="127.0.0.1", port=port)

        def up() -> bool:
            try:
                return bool(client.ping())
            except redis.RedisError:
                return False

        assert wait_until(up, timeout=10), (tmp / "redis.log").read_text()
        client.close()
        url = f"redis://127.0.0.1:{port}/0"
        with ExitStack() as stack:
            flags = ("--keys", str(keys_file), "--redis-url", url)
            servers = [stack.enter_context(start_server(tmp, *flags, wait_ready=False)) for _ in range(2)]
            for server in servers:
                wait_healthy(server)
            yield SharedPair(url, redis_process, servers, key)
    finally:
        if redis_process.poll() is None:
            redis_process.terminate()
            try:
                redis_process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                redis_process.kill()
                redis_process.wait(timeout=10)


def test_tpm_shared_through_redis_by_two_servers(shared_pair: SharedPair) -> None:
    responses = burst(shared_pair.post, BURST)  # alternating between the two servers
    statuses = [r.status_code for r in responses]
    assert sorted(set(statuses)) == [200, 429], [(r.status_code, r.text) for r in responses]
    assert statuses.count(200) == SHARED_TPM // (P + SHARED_M), statuses
    # Together the two servers admitted no more than the one bucket holds.
    assert sum(P + SHARED_M for s in statuses if s == 200) <= SHARED_TPM
    for r in responses:
        if r.status_code == 429:
            assert_openai_error(r, 429, "rate_limit_error", code="rate_limit_exceeded")
            assert int(r.headers["retry-after"]) >= 1
        else:
            assert r.json()["usage"]["completion_tokens"] == SHARED_M
    # Both servers see the same (drained) bucket: a fresh request is refused by either.
    for i in range(2):
        assert shared_pair.post(i).status_code == 429
    # The state lives in Redis under the tenant's keys.
    import redis

    client = redis.Redis.from_url(shared_pair.redis_url)
    try:
        assert client.exists("tokenline:rl:{shared}:tpm")
        assert client.zcard("tokenline:rl:{shared}:inflight") == 0  # every admitted request settled
    finally:
        client.close()


def test_redis_down_refuses_with_503(shared_pair: SharedPair) -> None:
    """Regression: the door's header peek let the limiter's 503 escape as an unhandled 500."""
    # Without Redis the limit cannot be checked: refuse (503, retry later), never admit unlimited.
    shared_pair.redis.terminate()
    shared_pair.redis.wait(timeout=10)
    for i in range(2):
        response = shared_pair.post(i, max_tokens=1)
        assert response.status_code != 200, response.text
        assert_openai_error(response, 503, "service_unavailable")
        assert int(response.headers["retry-after"]) >= 1


# --- 8. traces --------------------------------------------------------------------------------


def test_trace_of_a_request(edge: KeysServer) -> None:
    request_id = "edge-trace-1"
    response = edge.post("alice", "/v1/chat/completions", chat_body(SECRET_PROMPT, max_tokens=6),
                         headers={"X-Request-Id": request_id})
    assert response.status_code == 200, response.text
    assert response.headers["x-request-id"] == request_id
    usage = response.json()["usage"]

    trace_path = f"/v1/requests/{request_id}/trace"
    trace = edge.get("alice", trace_path)
    assert trace.status_code == 200, trace.text
    trace = trace.json()
    stages = ["arrived", "authenticated", "rendered", "tokenized", "queued", "first_scheduled", "first_token",
              "last_token", "finished"]
    assert list(trace["stages_s"]) == stages, trace
    times = [trace["stages_s"][s] for s in stages]
    assert times[0] == 0
    assert times == sorted(times), trace["stages_s"]
    assert trace["request_id"] == request_id
    assert trace["tenant"] == "alice"
    assert trace["model"] == MODEL
    assert trace["status"] == "finished"
    assert trace["num_steps"] >= 1
    assert trace["prompt_tokens"] == usage["prompt_tokens"]
    assert trace["completion_tokens"] == usage["completion_tokens"]
    assert abs(trace["arrived_at"] - time.time()) < 60

    # Another tenant cannot see it (nor learn that it exists); an admin can; no key is a 401.
    assert_openai_error(edge.get("bob", trace_path), 404, "not_found_error")
    assert edge.get("admin", trace_path).status_code == 200
    assert_openai_error(edge.get(None, trace_path), 401, "authentication_error")
    assert_openai_error(edge.get("alice", "/v1/requests/no-such-request/trace"), 404, "not_found_error")

    # The server logged one structured line for it, without the user's text.
    def logged() -> list[dict[str, Any]]:
        return [line for line in finished_log_lines(edge.server.log()) if line["request_id"] == request_id]

    assert wait_until(lambda: len(logged()) == 1, timeout=5)
    line = logged()[0]
    assert line["tenant"] == "alice" and line["status"] == "finished"
    assert line["completion_tokens"] == usage["completion_tokens"]
    assert "prompts" not in line and "completions" not in line
    assert "zebra-quokka" not in edge.server.log()


def test_trace_of_a_streamed_completion_and_header_echo(edge: KeysServer) -> None:
    request_id = "edge-trace-stream"
    with httpx.stream("POST", edge.url("/v1/completions"), json=completion_body(max_tokens=5, stream=True),
                      headers={**auth(edge.keys["bob"]), "X-Request-Id": request_id}, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["x-request-id"] == request_id
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    trace = edge.get("bob", f"/v1/requests/{request_id}/trace").json()
    assert trace["status"] == "finished"
    assert trace["completion_tokens"] == 5 and trace["prompt_tokens"] == P
    times = list(trace["stages_s"].values())
    assert times == sorted(times) and len(times) == 9, trace
    assert edge.get("alice", f"/v1/requests/{request_id}/trace").status_code == 404
