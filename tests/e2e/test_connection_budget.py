"""Connection budgets against a real server, with small settings: strangers' slow request heads take
nothing from tenants and the oldest of them go once over budget, a burst of honest connections is
not cut, a full admitted pool makes way for a tenant (closing a slow upload with a 408) or refuses
with a 503 while /ready says so, and a body sent a byte a second gets a 408.

One server: ``--api-key``, ``--max-connections 4``, ``--max-pending-connections 8``,
``--max-pending-per-address 4``, a 30 s head timeout (so that only the budgets close slow heads
here), ``--metrics-port`` (its scrapes never take an admitted connection). Every loop is bounded.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import Server, free_port, scrape_metrics, start_server, wait_until
from tokenline.api.http_protocol import BODY_RATE_GRACE_S
from tokenline.gateway.connection_budget import PENDING_GRACE_S

KEY = "budget-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_CONNECTIONS = 4
MAX_PENDING = 8
MAX_PENDING_PER_ADDRESS = 4
SLOW_HEAD = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n"  # never the blank line that ends it


@dataclass
class Budgeted:
    server: Server
    metrics_url: str

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.server.base_url.removeprefix("http://").split(":")
        return host, int(port)

    def connect(self, data: bytes = b"") -> socket.socket:
        sock = socket.create_connection(self.address, timeout=10)
        if data:
            sock.sendall(data)
        return sock

    def metric(self, sample: str) -> float:
        return scrape_metrics(self.metrics_url).get(sample, 0.0)


@pytest.fixture(scope="module")
def budgeted(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[Budgeted]:
    metrics_port = free_port()
    with start_server(tmp_path_factory.mktemp("budget"), "--api-key", KEY, "--header-timeout", "30",
                      "--max-connections", str(MAX_CONNECTIONS), "--max-pending-connections", str(MAX_PENDING),
                      "--max-pending-per-address", str(MAX_PENDING_PER_ADDRESS),
                      "--metrics-port", str(metrics_port)) as server:
        yield Budgeted(server, f"http://127.0.0.1:{metrics_port}/metrics")


def closed_by_server(sock: socket.socket, wait_s: float = 0.3) -> bool:
    """Whether the server has closed ``sock`` (EOF or reset), waiting up to ``wait_s`` for it."""
    sock.settimeout(wait_s)
    try:
        return sock.recv(4096) == b""
    except TimeoutError:
        return False
    except OSError:
        return True


def response_of(sock: socket.socket, timeout_s: float = 10) -> tuple[int, dict[str, str], bytes]:
    """Status, headers and body of the one response on ``sock`` (its Content-Length says the end)."""
    sock.settimeout(timeout_s)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        assert chunk, f"closed before a response: {data!r}"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    while len(body) < int(headers.get("content-length", 0)):
        chunk = sock.recv(4096)
        if not chunk:
            break
        body += chunk
    return int(lines[0].split()[1]), headers, body


def event_stream(budgeted: Budgeted) -> socket.socket:
    """A tenant's live-events stream: an admitted connection whose request is at work until closed."""
    sock = budgeted.connect(b"GET /v1/events HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
                            + b"\r\n\r\n")
    sock.settimeout(10)
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(4096)
    assert head.startswith(b"HTTP/1.1 200"), head[:200]
    return sock


def test_strangers_slow_heads_take_no_tenant_connection_and_the_oldest_go(budgeted: Budgeted) -> None:
    """Three times --max-connections sockets send part of a head: a tenant is still answered (these
    counted toward --max-connections before: 503). Past their grace, the oldest are closed down to
    the address's budget, and a newcomer from that address closes one more."""
    strangers = [budgeted.connect(SLOW_HEAD) for _ in range(3 * MAX_CONNECTIONS)]
    newcomer = None
    try:
        time.sleep(0.2)
        answer = httpx.get(f"{budgeted.server.base_url}/v1/models", headers=AUTH, timeout=10)
        assert answer.status_code == 200, answer.text
        assert httpx.get(f"{budgeted.server.base_url}/health", timeout=10).status_code == 200
        time.sleep(PENDING_GRACE_S + 0.5)
        kept = MAX_PENDING_PER_ADDRESS
        closed = [closed_by_server(s, 0.05) for s in strangers]
        assert closed == [True] * (len(strangers) - kept) + [False] * kept, closed
        newcomer = budgeted.connect(SLOW_HEAD)
        time.sleep(0.3)
        assert closed_by_server(strangers[-kept], 1) and not closed_by_server(newcomer, 0.05)
        assert not any(closed_by_server(s, 0.05) for s in strangers[-kept + 1:])
    finally:
        for sock in [*strangers, *([newcomer] if newcomer else [])]:
            sock.close()
    assert budgeted.metric('tokenline_rejected_requests_total{reason="pending_evicted"}') >= len(strangers) - kept + 1


def test_a_burst_of_connections_from_one_address_is_not_cut(budgeted: Budgeted) -> None:
    """More connections than any pending budget, opened at once before any sends its head (as a
    client pool does): each is within its grace, so all are answered."""
    burst = [budgeted.connect() for _ in range(2 * MAX_PENDING)]
    try:
        time.sleep(0.3)
        for sock in burst:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert [response_of(sock)[0] for sock in burst] == [200] * len(burst)
    finally:
        for sock in burst:
            sock.close()


def test_a_full_pool_makes_way_for_a_tenant_and_refuses_only_when_all_are_at_work(budgeted: Budgeted) -> None:
    base = budgeted.server.base_url
    streams = [event_stream(budgeted) for _ in range(MAX_CONNECTIONS - 1)]
    chat_head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
                 + b"\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{")
    slow_upload = budgeted.connect(chat_head)
    try:
        time.sleep(0.3)
        # The pool is full (three streams at work, one body still arriving): the upload makes way.
        answer = httpx.get(f"{base}/v1/models", headers=AUTH, timeout=10)
        assert answer.status_code == 200, answer.text
        status, headers, body = response_of(slow_upload)
        assert status == 408 and headers["connection"] == "close", (status, headers)
        assert json.loads(body)["error"]["type"] == "timeout_error"
        assert closed_by_server(slow_upload, 2)
        # Every admitted connection at work: a new request is refused, /ready says so, /health not.
        assert wait_until(lambda: budgeted.metric('tokenline_open_connections{pool="admitted"}') == MAX_CONNECTIONS - 1,
                   timeout=5)
        streams.append(event_stream(budgeted))
        refused = httpx.get(f"{base}/v1/models", headers=AUTH, timeout=10)
        assert refused.status_code == 503, refused.text
        error = refused.json()["error"]
        assert error["type"] == "service_unavailable" and "connections" in error["message"]
        assert refused.headers["connection"] == "close" and refused.headers["retry-after"] == "1"
        assert refused.headers.get("x-request-id")
        assert httpx.get(f"{base}/health", timeout=10).status_code == 200  # the engine is fine
        ready = httpx.get(f"{base}/ready", timeout=10)
        assert ready.status_code == 503 and ready.json()["status"] == "saturated", ready.text
        streams.pop().close()
        assert wait_until(lambda: httpx.get(f"{base}/ready", timeout=10).status_code == 200, timeout=10)
        assert httpx.get(f"{base}/v1/models", headers=AUTH, timeout=10).status_code == 200
    finally:
        for sock in [*streams, slow_upload]:
            sock.close()
    assert budgeted.metric('tokenline_rejected_requests_total{reason="admitted_evicted"}') >= 1
    assert budgeted.metric('tokenline_rejected_requests_total{reason="connection_cap"}') >= 1


def test_a_body_sent_a_byte_a_second_gets_a_408(budgeted: Budgeted) -> None:
    """A tenant's body at 1 byte/s (it was never timed out): the default --body-min-rate (500 bytes/s
    after the first 5 s) ends it with a 408 soon after the grace."""
    sock = budgeted.connect(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                            + KEY.encode() + b"\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n")
    started = time.monotonic()
    received = b""
    try:
        sock.settimeout(1.0)
        while time.monotonic() - started < BODY_RATE_GRACE_S + 5 and not received:
            try:
                sock.sendall(b" ")
                received = sock.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                break
        waited = time.monotonic() - started
    finally:
        sock.close()
    assert received.startswith(b"HTTP/1.1 408"), (received[:200], waited)
    assert waited >= BODY_RATE_GRACE_S - 0.5, waited  # not before the grace
    assert b'"timeout_error"' in received
