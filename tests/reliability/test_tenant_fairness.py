"""One tenant's bulk work or refused requests cost other tenants nothing — against real servers.

- Twelve 4 MB ``/tokenize`` bodies from one tenant (each ~3 s of tokenizing here) used to queue in
  front of another tenant's 5,000-character chat on the two text threads (0.52 s → 17.3 s in the
  issue); the text pool now serves tenants in turn and keeps a lane for small work, so the chat
  answers about as fast as on an idle server.
- A flood of refused requests (404 for an unknown model: never admitted, never counted against
  RPM) from one tenant used to evict other tenants' traces from the shared store; traces are now
  kept per tenant, and refusals only in a small ring of their own.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import Server, start_server
from tests.reliability.conftest import MODEL, async_client
from tokenline.gateway.keys import add_key

pytestmark = pytest.mark.reliability

BULK_BODIES = 12
BULK_CHARS = 4_000_000
CHAT_CHARS = 5_000
# The chat's wait for the text threads (its trace's "tokenized" stage: ~3 ms of tokenizing). Behind
# even one 4 MB body it would be ~3 s here, behind all twelve ~17 s. The engine's own time is left
# out: on a shared machine it varies far more than this bound.
TEXT_STAGE_LIMIT_S = 1.0
TRACES_PER_TENANT = 50


def _keys(tmp: Path, *names: str) -> dict[str, str]:
    return {name: add_key(tmp / "keys.toml", name) for name in names}


@pytest.fixture
def fair_server(tmp_path: Path, default_model_dir: Path) -> Iterator[tuple[Server, dict[str, str]]]:
    keys = _keys(tmp_path, "bulk", "chat")
    # Tokenize bodies as large as chat bodies (4 MiB), so this measures the queue, not the cap.
    with start_server(tmp_path, "--keys", str(tmp_path / "keys.toml"),
                      "--max-tokenize-bytes", str(4 * 1024 * 1024)) as server:
        yield server, keys


def _chat(client: httpx.Client, server: Server, key: str, i: int) -> tuple[float, float]:
    """A 5,000-character chat: its latency, and its trace's time from arrival to tokenized."""
    # Distinct text each time: the prefix cache must not make the loaded chats cheaper.
    content = (f"Note {i}: " + "the quick brown fox jumps over the lazy dog " * 200)[:CHAT_CHARS]
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 2, "temperature": 0}
    headers = {"Authorization": f"Bearer {key}", "X-Request-Id": f"fair-chat-{i}"}
    started = time.monotonic()
    response = client.post(f"{server.api_url}/chat/completions", json=body, headers=headers)
    assert response.status_code == 200, response.text
    latency = time.monotonic() - started
    trace = client.get(f"{server.api_url}/requests/fair-chat-{i}/trace", headers=headers).json()
    return latency, trace["stages_s"]["tokenized"]


def test_large_tokenize_bodies_do_not_delay_another_tenants_chat(fair_server: tuple[Server, dict[str, str]]) -> None:
    server, keys = fair_server
    with httpx.Client(timeout=300) as client:
        _chat(client, server, keys["chat"], 0)  # warm-up
        idle = _chat(client, server, keys["chat"], 1)

    text = ("alpha beta gamma delta " * (BULK_CHARS // 23 + 1))[:BULK_CHARS]

    async def bulk(http: httpx.AsyncClient, i: int) -> int:
        response = await http.post(f"{server.base_url}/tokenize", json={"model": MODEL, "prompt": f"{i} {text}"},
                                   headers={"Authorization": f"Bearer {keys['bulk']}"})
        return response.status_code

    async def main() -> tuple[list[tuple[float, float]], int]:
        async with async_client(BULK_BODIES) as http:
            tasks = [asyncio.create_task(bulk(http, i)) for i in range(BULK_BODIES)]
            await asyncio.sleep(2.0)  # every body sent, queued or being tokenized
            with httpx.Client(timeout=300) as client:
                loaded = [await asyncio.to_thread(_chat, client, server, keys["chat"], 2)]
                done = sum(t.done() for t in tasks)  # the first chat ran under the whole load
                loaded.append(await asyncio.to_thread(_chat, client, server, keys["chat"], 3))
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            return loaded, done

    loaded, bulk_done = asyncio.run(main())
    print(f"\n5,000-character chat, idle: {idle[0]:.2f} s (tokenized at {idle[1] * 1000:.0f} ms); under "
          f"{BULK_BODIES} x 4 MB /tokenize of another tenant: "
          + ", ".join(f"{total:.2f} s (tokenized at {text_s * 1000:.0f} ms)" for total, text_s in loaded)
          + f"; {bulk_done} of {BULK_BODIES} tokenizations done after the first")
    assert all(text_s < TEXT_STAGE_LIMIT_S for _, text_s in loaded), loaded
    assert bulk_done < BULK_BODIES, "the tokenize load ended before the first chat: nothing was measured"


@pytest.fixture
def traced_server(tmp_path: Path, default_model_dir: Path) -> Iterator[tuple[Server, dict[str, str]]]:
    keys = _keys(tmp_path, "alice", "mallory")
    with start_server(tmp_path, "--keys", str(tmp_path / "keys.toml"),
                      "--traces-per-tenant", str(TRACES_PER_TENANT)) as server:
        yield server, keys


def test_refused_requests_evict_no_trace(traced_server: tuple[Server, dict[str, str]]) -> None:
    server, keys = traced_server

    def trace(tenant: str, request_id: str) -> int:
        return client.get(f"{server.api_url}/requests/{request_id}/trace",
                          headers={"Authorization": f"Bearer {keys[tenant]}"}).status_code

    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    with httpx.Client(timeout=60) as client:
        for tenant in ("alice", "mallory"):
            response = client.post(f"{server.api_url}/chat/completions", json=body,
                                   headers={"Authorization": f"Bearer {keys[tenant]}", "X-Request-Id": f"{tenant}-1"})
            assert response.status_code == 200, response.text
        # Far more refusals than the store keeps per tenant (the case: 10,050 against 10,000).
        refused = 4 * TRACES_PER_TENANT
        started = time.monotonic()
        for i in range(refused):
            response = client.post(f"{server.api_url}/chat/completions", json={**body, "model": "no-such-model"},
                                   headers={"Authorization": f"Bearer {keys['mallory']}", "X-Request-Id": f"m-404-{i}"})
            assert response.status_code == 404, response.text
        print(f"\n{refused} refused requests in {time.monotonic() - started:.1f} s")
        assert trace("alice", "alice-1") == 200
        assert trace("mallory", "mallory-1") == 200  # a tenant's own refusals do not evict its admitted traces
        assert trace("mallory", f"m-404-{refused - 1}") == 200  # the latest refusals are still shown
        assert trace("mallory", "m-404-0") == 404  # the oldest refusals made room in their own ring
