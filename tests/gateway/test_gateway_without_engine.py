"""The gateway and the request processor in front of an engine that is not a local model: keys,
limits, the ledger, metrics, traces and the ids that join them, all working through the real app
(``build_app`` with an injected ``EngineClient``) and the official ``openai`` client."""

from __future__ import annotations

import hashlib
import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from tests.gateway.fake_engine import FakeEngineClient
from tokenline.api.app import ServerSettings, build_app
from tokenline.frontend.tokenizer import Tokenizer
from tokenline.gateway.connection_budget import Admission, Phase

ADMIN_KEY = "tl-admin"
LIMITED_KEY = "tl-limited"
REPLY = " The sky is blue."


def _sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@pytest.fixture
def gateway_app(tmp_path: Path, default_model_dir: Path) -> Iterator[tuple[TestClient, FakeEngineClient, Path]]:
    keys = tmp_path / "keys.toml"
    keys.write_text(f"""
[[tenant]]
name = "ops"
key_sha256 = "{_sha(ADMIN_KEY)}"
admin = true

[[tenant]]
name = "small"
key_sha256 = "{_sha(LIMITED_KEY)}"
requests_per_minute = 2
""")
    prices = tmp_path / "prices.toml"
    prices.write_text('[models."fake-model"]\ninput = 1000000.0\noutput = 2000000.0\n')  # $1 / $2 per token
    ledger = tmp_path / "usage.sqlite3"
    settings = ServerSettings(
        model=str(default_model_dir), served_model_name="fake-model", keys_file=str(keys),
        prices_file=str(prices), usage_db=str(ledger), max_tokens_cap=64,
        metrics_auth="none", metrics_tenant_labels=True,  # the operator opts in to both
    )
    reply_ids = Tokenizer.from_dir(default_model_dir).encode(REPLY, add_special_tokens=False)
    engine = FakeEngineClient(reply_ids)
    with TestClient(build_app(settings, client=engine), raise_server_exceptions=False) as client:
        yield client, engine, ledger


def _chat(client: TestClient, key: str, **extra: object) -> httpx.Response:
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "What colour is the sky?"}], **extra}
    return client.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}",
                                                                   "X-Request-Id": "join-me-1"})


def test_keys_are_checked_before_the_engine_sees_anything(gateway_app) -> None:
    client, engine, _ = gateway_app
    assert client.post("/v1/chat/completions", json={}).status_code == 401
    assert _chat(client, "wrong").status_code == 401
    assert engine.requests == []


def test_a_request_through_the_gateway_is_answered_billed_and_traced(gateway_app) -> None:
    client, engine, ledger = gateway_app
    response = _chat(client, ADMIN_KEY, max_tokens=32)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["choices"][0]["message"]["content"] == REPLY
    assert response.headers["x-request-id"] == "join-me-1"
    # The id rides into the engine request; engine ids derive from the response id.
    (sent,) = engine.requests
    assert sent.client_request_id == "join-me-1"
    assert sent.request_id == f"{body['id']}-0"
    usage = body["usage"]
    assert usage["completion_tokens"] == len(engine.reply_ids)
    # The ledger row is committed before the response ends, and joins to the response id.
    with sqlite3.connect(ledger) as db:
        rows = db.execute(
            "SELECT request_id, response_id, tenant, prompt_tokens, completion_tokens, cost_usd FROM usage"
        ).fetchall()
    expected_cost = usage["prompt_tokens"] * 1.0 + usage["completion_tokens"] * 2.0
    assert rows == [("join-me-1", body["id"], "ops", usage["prompt_tokens"], usage["completion_tokens"],
                     pytest.approx(expected_cost))]
    trace = client.get("/v1/requests/join-me-1/trace", headers={"Authorization": f"Bearer {ADMIN_KEY}"}).json()
    assert trace["response_id"] == body["id"] and trace["engine_request_ids"] == [sent.request_id]
    assert trace["status"] == "finished" and trace["completion_tokens"] == usage["completion_tokens"]
    assert {"queued", "first_token", "finished"} <= set(trace["stages_s"])
    # Metrics: the engine series come from the client's stats, the request series from the gateway.
    metrics = client.get("/metrics").text
    assert 'vllm:kv_cache_usage_perc{model_name="fake-model"} 0.25' in metrics
    assert f'vllm:generation_tokens_total{{model_name="fake-model"}} {float(usage["completion_tokens"])}' in metrics
    assert 'vllm:request_success_total{finished_reason="stop",model_name="fake-model"} 1.0' in metrics
    assert 'tokenline_spend_usd_total{model_name="fake-model",tenant="ops"}' in metrics


def test_streaming_and_n_fan_out_through_a_remote_shaped_engine(gateway_app) -> None:
    client, engine, _ = gateway_app
    with client.stream("POST", "/v1/chat/completions", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, json={
        "model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "n": 2, "stream": True,
        "stream_options": {"include_usage": True},
    }) as response:
        assert response.status_code == 200
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    text = {0: "", 1: ""}
    for event in events:
        for choice in event["choices"]:
            text[choice["index"]] += choice["delta"].get("content") or ""
    assert text == {0: REPLY, 1: REPLY}
    assert events[-1]["usage"]["completion_tokens"] == 2 * len(engine.reply_ids)
    assert len(engine.requests) == 2 and engine.requests[0].sampling.n == 1
    # Each of the n sequences is one engine request in the per-request series, TTFT included.
    metrics = client.get("/metrics").text
    assert 'vllm:time_to_first_token_seconds_count{model_name="fake-model"} 2.0' in metrics
    assert 'vllm:e2e_request_latency_seconds_count{model_name="fake-model"} 2.0' in metrics


def test_limits_hold_without_a_local_engine(gateway_app) -> None:
    client, engine, _ = gateway_app
    # The max_tokens cap and the message limit refuse before the engine is asked.
    capped = _chat(client, ADMIN_KEY, max_tokens=65)
    assert capped.status_code == 400 and capped.json()["error"]["param"] == "max_tokens"
    assert engine.requests == []
    # Requests per minute: the third request of the minute gets a 429 with Retry-After.
    assert _chat(client, LIMITED_KEY, max_tokens=2).status_code == 200
    assert _chat(client, LIMITED_KEY, max_tokens=2).status_code == 200
    refused = _chat(client, LIMITED_KEY, max_tokens=2)
    assert refused.status_code == 429 and "retry-after" in refused.headers
    assert len(engine.requests) == 2
    assert 'tokenline_rate_limited_requests_total{limit=' in client.get("/metrics").text


def test_the_official_client_talks_to_the_gateway(gateway_app) -> None:
    client, _, _ = gateway_app
    sdk = openai.OpenAI(base_url="http://testserver/v1", api_key=ADMIN_KEY, http_client=client)
    completion = sdk.chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert completion.choices[0].finish_reason == "length" and completion.usage.completion_tokens == 3


def test_ready_says_saturated_while_every_admitted_connection_is_at_work(gateway_app) -> None:
    """/ready is /health's answer plus the admitted pool (here filled by hand: the test client has no
    connections of its own); /health itself stays the engine's readiness."""
    client, _, _ = gateway_app
    assert client.get("/ready").json()["status"] == "ok"
    budget = client.app.state.connections
    at_work = [object() for _ in range(budget.limits.max_admitted)]
    for conn in at_work:
        budget.opened(conn, "203.0.113.9")
        assert budget.admit(conn, Phase.WORKING) is Admission.ADMITTED
    saturated = client.get("/ready")
    assert saturated.status_code == 503 and saturated.json()["status"] == "saturated"
    assert saturated.headers["retry-after"] == "1" and client.get("/health").status_code == 200
    budget.update(at_work[0], Phase.AWAITING_HEAD)  # kept alive between requests: it would make way
    assert client.get("/ready").status_code == 200
    metrics = client.get("/metrics").text
    assert f'tokenline_open_connections{{pool="admitted"}} {float(len(at_work))}' in metrics


def test_ping_model_card_and_metrics_at_zero_on_a_fresh_server(gateway_app) -> None:
    client, _, _ = gateway_app
    assert client.get("/ping").status_code == 200 and client.post("/ping").status_code == 200
    auth = {"Authorization": f"Bearer {ADMIN_KEY}"}
    card = client.get("/v1/models/fake-model", headers=auth).json()
    assert card["id"] == "fake-model" and card["object"] == "model" and card["created"] > 1_700_000_000
    assert client.get("/v1/models", headers=auth).json()["data"] == [card]
    missing = client.get("/v1/models/other", headers=auth)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    # Before any request, every per-request series is there at zero (dashboards show 0, not "no data").
    metrics = client.get("/metrics").text
    for series in ('vllm:prompt_tokens_total{model_name="fake-model"} 0.0',
                   'vllm:generation_tokens_total{model_name="fake-model"} 0.0',
                   'vllm:time_to_first_token_seconds_count{model_name="fake-model"} 0.0',
                   'vllm:request_success_total{finished_reason="stop",model_name="fake-model"} 0.0',
                   'vllm:e2e_request_latency_seconds_count{model_name="fake-model"} 0.0'):
        assert series in metrics, series
