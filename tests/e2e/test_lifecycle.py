"""Start-up as a load balancer sees it: /health is 503 while the engine loads, then 200."""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from tests.e2e.conftest import STARTUP_TIMEOUT_S, start_server


def test_health_is_503_while_loading_then_200(tmp_path: Path) -> None:
    with start_server(tmp_path, wait_ready=False) as server:
        seen: list[tuple[int, str]] = []
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            assert server.process.poll() is None, server.log()
            try:
                response = httpx.get(f"{server.base_url}/health", timeout=2)
            except httpx.TransportError:
                time.sleep(0.02)  # not listening yet
                continue
            seen.append((response.status_code, response.json().get("status")))
            if response.status_code == 200:
                break
            # While loading, generation requests are refused clearly, not queued into a void.
            early = httpx.post(
                f"{server.api_url}/completions",
                json={"model": "SmolLM2-135M-Instruct", "prompt": "hi", "max_tokens": 2},
                timeout=5,
            )
            if early.status_code != 200:  # the engine may have become ready in between
                assert early.status_code == 503, early.text
                assert early.json()["error"]["type"]
            time.sleep(0.02)
        assert seen and seen[-1] == (200, "ok")
        # The engine process imports torch and loads weights after the API is listening.
        assert (503, "loading") in seen, seen
