"""A real server started with vLLM's ``--kv-events-config`` publishes its KV cache events over ZMQ;
a subscriber in another process (this test) rebuilds which prompt prefixes the server holds from
the token ids alone — what a prefix-aware router needs."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx

from tests.e2e.conftest import free_port, start_server
from tokenline.engine.block_pool import hash_block
from tokenline.engine.kv_events import BlockStored, CachedBlockIndex
from tokenline.engine.kv_events_zmq import KVEventSubscriber

BLOCK = 16


def chain(token_ids: list[int]) -> list[bytes]:
    """The hashes of a prompt's full blocks, as the engine computes them."""
    hashes: list[bytes] = []
    for start in range(0, len(token_ids) - BLOCK + 1, BLOCK):
        hashes.append(hash_block(hashes[-1] if hashes else None, token_ids[start : start + BLOCK]))
    return hashes


def test_a_subscriber_sees_the_prefixes_a_server_caches(tmp_path: Path) -> None:
    endpoint, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "replay_endpoint": replay,
              "topic": "kv"}
    prompt = [1000 + i for i in range(2 * BLOCK + 5)]  # two full blocks and a partial one
    with start_server(tmp_path, "--kv-events-config", json.dumps(config)) as server:
        subscriber = KVEventSubscriber(endpoint, replay, topic="kv")
        try:
            body = {"model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": 2, "temperature": 0}
            response = httpx.post(f"{server.api_url}/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
            # Whatever PUB dropped before the subscription settled, the replay socket resends.
            index = CachedBlockIndex()
            events = [event for _, batch in subscriber.replay(0) for event in batch.events]
            index.apply(events)
            deadline = time.monotonic() + 10
            while not set(chain(prompt)) <= index.hashes and time.monotonic() < deadline:
                for _, batch in subscriber.receive(timeout_ms=200):
                    index.apply(batch.events)
        finally:
            subscriber.close()
    assert set(chain(prompt)) <= index.hashes
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert stored and all(e.block_size == BLOCK for e in stored)
    first = next(e for e in stored if chain(prompt)[0] in e.block_hashes)
    assert first.parent_block_hash is None and first.token_ids[:BLOCK] == prompt[:BLOCK]
