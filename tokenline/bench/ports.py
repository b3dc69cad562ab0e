"""Free local ports for the servers that tests, benchmarks and calibration start.

``bind(("127.0.0.1", 0))`` hands out a port from the kernel's ephemeral range, the same range every
outgoing connection (httpx, Ray, ZMQ, the engine's own sockets) draws its local port from. Between
the probe and the server's own bind, one of those connections can take the port, and the server
then dies with "address already in use" (CI lost a router fleet that way). So the ports come from
below the ephemeral range, where no outgoing connection lands, and none is handed out twice.
"""

from __future__ import annotations

import os
import random
import socket
from pathlib import Path

_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 10_000
_handed_out: set[int] = set()
# Seeded per process, so two processes (make test beside a benchmark) search in different places.
_rng = random.Random(os.getpid() ^ int.from_bytes(os.urandom(4), "little"))


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = (int(part) for part in _RANGE_FILE.read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32_768, 60_999  # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port on 127.0.0.1 that nothing is bound to now, outside the ephemeral range, and not
    handed out before by this process."""
    low, high = _ephemeral_range()
    candidates = range(_LOWEST, low) if low - _LOWEST >= 1_000 else range(high + 1, 65_536)
    for _ in range(1_000):
        port = _rng.choice(candidates)
        if port not in _handed_out and _bindable(port):
            _handed_out.add(port)
            return port
    raise RuntimeError(f"no free port found in {candidates}")
