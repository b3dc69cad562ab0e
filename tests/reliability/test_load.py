"""Load against one real server on the default model: 100 streams dropped at once, then rounds of
256 concurrent streams. Afterwards the engine holds nothing, the ledger has exactly one row per
request, every stream is whole, and the API process's memory stays flat.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import Server, start_server, wait_until
from tests.reliability.conftest import (
    async_client,
    chat_body,
    ledger_rows,
    rss_kib,
    run_streams,
    usage_db,
)

pytestmark = pytest.mark.reliability

DROPPED = 100
CONCURRENT = 256
ROUNDS = 3
# After the first round has warmed every pool and cache, later rounds may add at most this much
# resident memory to the API process (a leak of ~1 KiB per request would show as 256+ KiB a round,
# one of a stream's body as far more).
RSS_GROWTH_LIMIT_KIB = 24 * 1024
SETTLE_S = 20.0


@pytest.fixture(scope="module")
def load_server(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[Server]:
    # 1 GiB of KV cache: 100 streams of a few hundred tokens fit without preemption.
    with start_server(tmp_path_factory.mktemp("load"), "--kv-cache-memory", "1") as running:
        yield running


def engine_idle(server: Server) -> bool:
    m = server.metrics()
    return (m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
            and m["vllm:kv_cache_usage_perc"] == 0)


async def hold_until_first_token(client: httpx.AsyncClient, server: Server, request_id: str,
                                 arrived: list[str], drop: asyncio.Event) -> None:
    """Stream one chat request, read up to its first content token, then wait for the drop."""
    body = chat_body(f"Tell a long story about ship {request_id}.", 1000, stream=True, ignore_eos=True)
    async with client.stream("POST", f"{server.api_url}/chat/completions", json=body,
                             headers={"X-Request-Id": request_id}) as response:
        assert response.status_code == 200, await response.aread()
        # Hold the line iterator until the drop: an abandoned one is finalized by the event loop,
        # and httpx then closes the connection — the client would leave early, at a random time.
        lines = response.aiter_lines()
        async for line in lines:
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                break
        arrived.append(request_id)
        await drop.wait()
    # Leaving the block closes the connection with the body unread: the client is gone.


def test_hundred_streams_dropped_at_once(load_server: Server) -> None:
    assert wait_until(lambda: engine_idle(load_server), timeout=SETTLE_S)
    ids = [f"rel-drop-{i}" for i in range(DROPPED)]

    async def main() -> tuple[list[str], float]:
        arrived: list[str] = []
        drop = asyncio.Event()
        async with async_client(DROPPED) as client:
            tasks = [asyncio.create_task(hold_until_first_token(client, load_server, i, arrived, drop)) for i in ids]
            deadline = time.monotonic() + 120
            while len(arrived) < DROPPED and time.monotonic() < deadline and not any(t.done() for t in tasks):
                await asyncio.sleep(0.05)
            running = load_server.metrics()["vllm:num_requests_running"]
            drop.set()  # every stream closes now, at once
            await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)
        return arrived, running

    arrived, running = asyncio.run(main())
    assert len(arrived) == DROPPED, f"only {len(arrived)} streams got a first token"
    # Every held stream was still decoding when the drop came (none left early, none finished).
    assert running == DROPPED

    # Nothing left in the engine: no running or waiting request, every KV block back in the pool.
    assert wait_until(lambda: engine_idle(load_server), timeout=SETTLE_S), load_server.metrics()
    m = load_server.metrics()
    assert m["tokenline_kv_cache_free_blocks"] == m["tokenline_kv_cache_blocks"], m
    # Exactly one ledger row per dropped request, each billing the tokens produced before the drop.
    db = usage_db(load_server)
    assert wait_until(lambda: len(ledger_rows(db, "rel-drop-%")) >= DROPPED, timeout=SETTLE_S)
    time.sleep(1)  # a duplicate would be written by now
    rows = ledger_rows(db, "rel-drop-%")
    assert sorted(r["request_id"] for r in rows) == sorted(ids)
    assert all(r["completion_tokens"] > 0 for r in rows), [r for r in rows if not r["completion_tokens"]][:3]
    assert all(r["status"] == "cancelled" for r in rows), {r["status"] for r in rows}


def test_concurrent_streams_complete_whole_with_flat_memory(load_server: Server) -> None:
    pid = load_server.process.pid
    url = f"{load_server.api_url}/chat/completions"
    rss = []
    for round_ in range(ROUNDS):
        # Prompts that invite non-ASCII output, so that multi-byte characters split across tokens
        # are part of what must arrive as valid UTF-8.
        bodies = {
            f"rel-load-{round_}-{i}": chat_body(f"Écris {i} mots en japonais et un emoji 🎉.", 16, stream=True,
                                                stream_options={"include_usage": True})
            for i in range(CONCURRENT)
        }
        started = time.monotonic()
        results = run_streams(url, bodies)
        elapsed = time.monotonic() - started
        failures = [(r.request_id, r.status, repr(r.error)) for r in results if r.error or r.status != 200]
        assert not failures, failures[:5]
        for result in results:
            result.parse()  # strict UTF-8
            assert result.events[-1] == "[DONE]", (result.request_id, result.events[-3:])
            chunks = [json.loads(e) for e in result.events[:-1]]
            assert not any("error" in c for c in chunks), (result.request_id, chunks[-2:])
            assert chunks[-1]["usage"]["completion_tokens"] > 0
        assert wait_until(lambda: engine_idle(load_server), timeout=SETTLE_S), load_server.metrics()
        rss.append(rss_kib(pid))
        print(f"round {round_}: {CONCURRENT} streams in {elapsed:.1f} s, API RSS {rss[-1] / 1024:.1f} MiB")
    growth = rss[-1] - rss[0]
    assert growth < RSS_GROWTH_LIMIT_KIB, f"API process RSS per round (KiB): {rss}"
