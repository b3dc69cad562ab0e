"""A connection flood, run as its own process by tests/reliability/test_connection_flood.py (so that
its work does not share the test's interpreter, whose chats are being timed).

``python -m tests.reliability.flood PORT SOCKETS SECONDS head|body [KEY]``: SOCKETS connections to
127.0.0.1:PORT, each reopened as soon as the server closes it, for SECONDS. ``head``: each sends
part of a request head and never the rest (no key). ``body``: each sends a complete request head
with the key, ``Content-Length: 1000``, then one byte of body a second. Prints ``open`` once every
socket has connected, and one JSON line of counts at the end: connections opened, closed by the
server, and the statuses it answered with.
"""

from __future__ import annotations

import asyncio
import json
import resource
import sys
import time
from collections import Counter

SLOW_HEAD = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n"  # the blank line that ends a head never comes


def body_head(key: str) -> bytes:
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + key.encode()
            + b"\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n")


async def one_socket(port: int, mode: str, key: str, deadline: float, counts: Counter[str], sockets: int) -> None:
    first = SLOW_HEAD if mode == "head" else body_head(key)
    connected = False
    while time.monotonic() < deadline:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            counts["connect_failed"] += 1
            await asyncio.sleep(0.05)
            continue
        counts["opened"] += 1
        if not connected:
            connected = True
            counts["sockets"] += 1
            if counts["sockets"] == sockets:
                print("open", flush=True)
        try:
            writer.write(first)
            answer = b""
            while time.monotonic() < deadline:
                try:
                    # A byte of body a second; a head flood just waits for the server to give up.
                    answer = await asyncio.wait_for(reader.read(4096), timeout=1.0)
                    break
                except TimeoutError:
                    if mode == "body":
                        writer.write(b" ")
            else:
                continue
            counts["closed_by_server"] += 1
            if answer.startswith(b"HTTP/1.1 "):
                counts[f"status_{answer[9:12].decode()}"] += 1
        except OSError:
            counts["closed_by_server"] += 1
        finally:
            writer.close()


async def main(port: int, sockets: int, seconds: float, mode: str, key: str) -> Counter[str]:
    counts: Counter[str] = Counter()
    deadline = time.monotonic() + seconds
    await asyncio.gather(*(one_socket(port, mode, key, deadline, counts, sockets) for _ in range(sockets)))
    return counts


if __name__ == "__main__":
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))
    port_arg, sockets_arg, seconds_arg, mode_arg = sys.argv[1:5]
    key_arg = sys.argv[5] if len(sys.argv) > 5 else ""
    result = asyncio.run(main(int(port_arg), int(sockets_arg), float(seconds_arg), mode_arg, key_arg))
    print(json.dumps(dict(result)), flush=True)
