"""The guarded HTTP protocol on both of uvicorn's parsers (h11 and httptools), in process: a small
ASGI app that admits its request and echoes the body's length, served on 127.0.0.1 with short
limits, and raw sockets as clients. Real servers exercise it in tests/e2e/test_connection_budget.py."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from tokenline.api import http_protocol
from tokenline.api.http_protocol import ConnectionTimeouts, guarded_protocol
from tokenline.gateway.connection_budget import Admission, ConnectionBudget, ConnectionLimits
from tokenline.gateway.door_policy import ADMIT_SCOPE_KEY

GRACE_S = 0.5  # the body-rate grace, shortened for these tests
MIN_RATE = 1000.0  # bytes/s


async def echo_length(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Reads the body, then admits its connection (as the door does), answering the body's length."""
    if scope["type"] != "http":
        return
    size, more = 0, True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        size += len(message.get("body", b""))
        more = message.get("more_body", False)
    if scope[ADMIT_SCOPE_KEY]() is not Admission.ADMITTED:
        await send({"type": "http.response.start", "status": 503, "headers": [(b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})
        return
    body = str(size).encode()
    headers = [(b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class Running:
    def __init__(self, server: uvicorn.Server, budget: ConnectionBudget, rejected: list[str]) -> None:
        self.server, self.budget, self.rejected = server, budget, rejected

    @property
    def port(self) -> int:
        return self.server.servers[0].sockets[0].getsockname()[1]

    def post(self, length: int) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=10)
        sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % length)
        return sock


@pytest.fixture(params=[H11Protocol, HttpToolsProtocol], ids=["h11", "httptools"])
def running(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Running]:
    monkeypatch.setattr(http_protocol, "BODY_RATE_GRACE_S", GRACE_S)
    rejected: list[str] = []
    budget = ConnectionBudget(ConnectionLimits(max_admitted=2), on_evict=rejected.append)
    protocol = guarded_protocol(request.param, ConnectionTimeouts(header_s=5, body_s=3, body_min_rate=MIN_RATE),
                                budget, rejected.append)
    config = uvicorn.Config(echo_length, host="127.0.0.1", port=0, http=protocol, lifespan="off", log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started
    yield Running(server, budget, rejected)
    server.should_exit = True
    thread.join(10)


def read_all(sock: socket.socket, timeout_s: float = 5) -> bytes:
    sock.settimeout(timeout_s)
    data = b""
    while True:
        try:
            chunk = sock.recv(4096)
        except OSError:
            return data
        if not chunk:
            return data
        data += chunk
        if b"\r\n\r\n" in data and data.split(b"\r\n\r\n", 1)[1]:
            return data


def send_paced(sock: socket.socket, total: int, piece: int, every_s: float) -> None:
    for _ in range(total // piece):
        sock.sendall(b"x" * piece)
        time.sleep(every_s)


def test_a_body_at_a_fair_rate_is_read_past_the_grace(running: Running) -> None:
    sock = running.post(2400)
    send_paced(sock, 2400, 200, 0.1)  # 2,000 bytes/s for 1.2 s: twice the minimum, past the grace
    assert read_all(sock).endswith(b"\r\n\r\n2400")
    assert running.rejected == []


def test_a_body_below_the_minimum_rate_gets_a_408_after_the_grace(running: Running) -> None:
    sock = running.post(1000)
    started = time.monotonic()
    sock.sendall(b"x" * 10)
    answer = read_all(sock)
    waited = time.monotonic() - started
    assert answer.startswith(b"HTTP/1.1 408"), answer
    error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
    assert error["type"] == "timeout_error" and "bytes/s" in error["message"]
    assert GRACE_S <= waited < 3, waited  # the grace (and the 10 bytes' 10 ms), well before body_s
    assert running.rejected == ["body_timeout"]


def test_a_body_that_keeps_the_rate_but_not_the_total_time_gets_a_408(running: Running) -> None:
    sock = running.post(10_000)
    started = time.monotonic()
    answer = b""
    sock.settimeout(0.1)
    while time.monotonic() - started < 6 and not answer:
        try:
            sock.sendall(b"x" * 150)  # 1,500 bytes/s: above the minimum, but 10 kB take 6.7 s > body_s 3
            answer = sock.recv(4096)
        except TimeoutError:
            continue
        except OSError:
            break
    waited = time.monotonic() - started
    assert answer.startswith(b"HTTP/1.1 408") and b"within 3 s" in answer, answer
    assert 2.5 <= waited < 4.5, waited
    assert running.rejected == ["body_timeout"]


def test_the_budget_hears_each_connection_and_frees_it(running: Running) -> None:
    idle = socket.create_connection(("127.0.0.1", running.port), timeout=10)
    try:
        deadline = time.monotonic() + 5
        while running.budget.pending < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert (running.budget.pending, running.budget.admitted) == (1, 0)
        sock = running.post(3)
        sock.sendall(b"abc")
        assert read_all(sock).endswith(b"\r\n\r\n3")
        assert running.budget.admitted == 1  # kept alive: admitted, idle
        sock.close()
    finally:
        idle.close()
    deadline = time.monotonic() + 5
    while (running.budget.pending, running.budget.admitted) != (0, 0) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert (running.budget.pending, running.budget.admitted) == (0, 0)
