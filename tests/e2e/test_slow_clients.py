"""Clients that hold the server's resources, against a real server: request heads sent slowly
(slowloris), large tokenize bodies, and /metrics on its own listener. The connection budgets have
their own tests (test_connection_budget.py).

One server: ``--api-key``, ``--header-timeout 4``, no pending-connection budgets (so that the head
timeout alone closes the slow heads here), ``--metrics-port``. Every loop here is bounded in count
and time.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import Server, free_port, start_server

MODEL = "SmolLM2-135M-Instruct"
KEY = "slow-clients-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
HEADER_TIMEOUT_S = 4.0
SLOW_SOCKETS = 50
HEALTH_BOUND_S = 1.5  # /health answers within this while slow clients hold the server


@dataclass
class Guarded:
    server: Server
    metrics_url: str

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.server.base_url.removeprefix("http://").split(":")
        return host, int(port)


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[Guarded]:
    metrics_port = free_port()
    with start_server(tmp_path_factory.mktemp("slow-clients"), "--api-key", KEY,
                      "--header-timeout", str(HEADER_TIMEOUT_S), "--max-pending-connections", "0",
                      "--max-pending-per-address", "0",
                      "--metrics-port", str(metrics_port),
                      "--max-tokenize-bytes", str(4 * 1024 * 1024)) as server:  # the 3.8 MB bodies below
        yield Guarded(server, f"http://127.0.0.1:{metrics_port}/metrics")


def timed_health(server: Server) -> float:
    """Seconds /health took on a fresh connection; it must answer 200."""
    start = time.monotonic()
    response = httpx.get(f"{server.base_url}/health", timeout=HEALTH_BOUND_S * 4)
    assert response.status_code == 200, response.text
    return time.monotonic() - start


def test_metrics_are_served_on_their_own_listener_only(guarded: Guarded) -> None:
    scraped = httpx.get(guarded.metrics_url, timeout=10)  # no key: that address is the operator's to guard
    assert scraped.status_code == 200 and "vllm:num_requests_running" in scraped.text
    main = httpx.get(f"{guarded.server.base_url}/metrics", headers=AUTH, timeout=10)
    assert main.status_code == 404 and main.json()["error"]["type"] == "not_found_error"
    # The metrics listener serves nothing else.
    base = guarded.metrics_url.removesuffix("/metrics")
    assert httpx.get(f"{base}/v1/models", headers=AUTH, timeout=10).status_code == 404
    assert httpx.get(f"{base}/health", timeout=10).status_code == 404


def test_slow_request_heads_are_cut_off_while_health_answers(guarded: Guarded) -> None:
    """Each socket sends part of a request head and then a byte every 0.3 s, never finishing it;
    the trickle does not reset the timeout. One more socket completes a request on a kept-alive
    connection and then dribbles its next head: that one is cut off too."""
    host, port = guarded.address
    head = b"GET /health HTTP/1.1\r\nHost: " + host.encode() + b"\r\nX-Slow: " + b"a" * 100
    sockets, opened, closed_after = [], [], {}
    keep_alive = socket.create_connection((host, port), timeout=10)
    keep_alive.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert keep_alive.recv(4096).startswith(b"HTTP/1.1 200")
    latencies = []
    try:
        for _ in range(SLOW_SOCKETS):
            sock = socket.create_connection((host, port), timeout=10)
            sock.setblocking(False)
            sockets.append(sock)
            opened.append(time.monotonic())
        keep_alive.setblocking(False)
        sockets.append(keep_alive)
        opened.append(time.monotonic())
        sent = 0
        deadline = time.monotonic() + HEADER_TIMEOUT_S + 6
        while len(closed_after) < len(sockets) and time.monotonic() < deadline:
            for n, sock in enumerate(sockets):
                if n in closed_after:
                    continue
                try:
                    if sock.recv(1024) == b"":
                        closed_after[n] = time.monotonic() - opened[n]
                        continue
                except BlockingIOError:
                    pass
                except OSError:
                    closed_after[n] = time.monotonic() - opened[n]
                    continue
                try:
                    sock.send(head[sent:sent + 1])
                except OSError:
                    closed_after[n] = time.monotonic() - opened[n]
            sent = min(sent + 1, len(head) - 1)  # never the blank line that ends a head
            latencies.append(timed_health(guarded.server))
            time.sleep(0.3)
    finally:
        for sock in sockets:
            sock.close()
    assert len(closed_after) == len(sockets), f"{len(sockets) - len(closed_after)} slow sockets still open"
    # Cut off by the head timeout: not before it (they were sending), and not long after.
    assert min(closed_after.values()) >= HEADER_TIMEOUT_S - 0.5, sorted(closed_after.values())[:5]
    assert max(closed_after.values()) <= HEADER_TIMEOUT_S + 4, sorted(closed_after.values())[-5:]
    assert max(latencies) < HEALTH_BOUND_S, latencies
    metrics = httpx.get(guarded.metrics_url, timeout=10).text
    assert f'tokenline_rejected_requests_total{{reason="header_timeout"}} {float(len(sockets))}' in metrics


def test_large_tokenize_bodies_do_not_stall_health(guarded: Guarded) -> None:
    """Two ~3.8 MB prompts to /tokenize at once (seconds of tokenizer work each, one a core): /health
    keeps answering while they run, because tokenizing happens off the event loop."""
    prompt = "hello world, this is some text. " * 118_000
    body = {"model": MODEL, "prompt": prompt}
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(httpx.post, f"{guarded.server.base_url}/tokenize", json=body, headers=AUTH,
                               timeout=300) for _ in range(2)]
        time.sleep(0.5)
        latencies = []
        while not all(f.done() for f in futures) and len(latencies) < 200:
            latencies.append(timed_health(guarded.server))
            time.sleep(0.1)
        results = [f.result() for f in futures]
    for response in results:
        assert response.status_code == 200, response.text[:200]
        assert response.json()["count"] > 500_000
    # Every probe started while some tokenizing was still under way.
    assert len(latencies) >= 3, latencies
    assert max(latencies) < HEALTH_BOUND_S, latencies
