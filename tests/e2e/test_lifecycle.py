"""Start-up as a load balancer and vLLM's scripts see it: /health is 503 while the engine loads,
then 200, and no other route answers 200 before the engine can serve (scripts wait for
/v1/models to answer)."""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from tests.e2e.conftest import STARTUP_TIMEOUT_S, start_server


def test_health_is_503_while_loading_then_200_and_models_waits_for_it(tmp_path: Path) -> None:
    with start_server(tmp_path, wait_ready=False) as server:
        seen: list[tuple[int, str]] = []
        models_seen: list[int] = []
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            assert server.process.poll() is None, server.log()
            try:
                models = httpx.get(f"{server.api_url}/models", timeout=2)
                response = httpx.get(f"{server.base_url}/health", timeout=2)
            except httpx.TransportError:
                time.sleep(0.02)  # not listening yet
                continue
            models_seen.append(models.status_code)
            if models.status_code == 200:
                # Asked before /health, so the engine was ready then and still is.
                assert response.status_code == 200, (models.text, response.text)
            else:
                assert models.status_code == 503, models.text
                assert models.json()["error"]["type"] == "service_unavailable" and models.headers["retry-after"]
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
        assert 503 in models_seen, models_seen
        assert httpx.get(f"{server.api_url}/models", timeout=5).status_code == 200
