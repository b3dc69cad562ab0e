"""What the reliability tests share: SSE streams opened concurrently, the usage ledger read
straight from SQLite, a process's resident memory. Servers come from tests/e2e/conftest.py."""

from __future__ import annotations

import asyncio
import re
import sqlite3
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.e2e.conftest import Server
from tests.e2e.test_cancellation import engine_pid as child_engine_pid

MODEL = "SmolLM2-135M-Instruct"


def chat_body(content: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, **extra}


@dataclass
class StreamResult:
    """One streamed request as the client saw it: status, the raw body bytes, or the exception."""

    request_id: str
    status: int | None = None
    body: bytes = b""
    error: BaseException | None = None
    events: list[str] = field(default_factory=list)

    def parse(self) -> None:
        """Split the body into its ``data:`` payloads; raises UnicodeDecodeError on invalid UTF-8."""
        text = self.body.decode("utf-8", errors="strict")
        # SSE lines end at CR, LF or CRLF only: str.splitlines() would also cut at U+2028, U+2029 or
        # U+0085, which JSON carries raw inside a string (a model may well emit them).
        self.events = [line[len("data: "):] for line in re.split(r"\r\n|\r|\n", text) if line.startswith("data: ")]


def async_client(connections: int) -> httpx.AsyncClient:
    # No keep-alive: every stream is its own connection, as many independent clients would be.
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=0)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(300, connect=30))


async def stream_to_end(client: httpx.AsyncClient, url: str, body: dict[str, Any], request_id: str) -> StreamResult:
    """POST a streaming request and read its body to the end (errors are recorded, not raised)."""
    result = StreamResult(request_id)
    try:
        async with client.stream("POST", url, json=body, headers={"X-Request-Id": request_id}) as response:
            result.status = response.status_code
            chunks = [chunk async for chunk in response.aiter_bytes()]
            result.body = b"".join(chunks)
    except Exception as exc:  # noqa: BLE001 - reported by the test with the request id
        result.error = exc
    return result


def run_streams(url: str, bodies: dict[str, dict[str, Any]]) -> list[StreamResult]:
    """Open every stream at once (request id → body) and read each to its end."""

    async def main() -> list[StreamResult]:
        async with async_client(len(bodies)) as client:
            return await asyncio.gather(*(stream_to_end(client, url, b, rid) for rid, b in bodies.items()))

    return asyncio.run(main())


def ledger_rows(db_path: Path, request_id_like: str, in_flight: bool = False) -> list[dict[str, Any]]:
    """Rows of the server's usage ledger whose request id matches a LIKE pattern: the completed ones,
    or with ``in_flight`` the journaled rows of requests still running."""
    if not db_path.exists():
        return []
    with closing(sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, timeout=10)) as db:
        db.row_factory = sqlite3.Row
        # A journaled row still in flight is not a receipt yet: by default only completed rows count.
        status = "status = 'in_flight'" if in_flight else "status != 'in_flight'"
        rows = db.execute(f"SELECT * FROM usage WHERE request_id LIKE ? AND {status} ORDER BY id",
                          (request_id_like,)).fetchall()
    return [dict(r) for r in rows]


def rss_kib(pid: int) -> int:
    """Resident set size of a process (VmRSS in /proc/<pid>/status), KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for pid {pid}")


def engine_pid(server: Server) -> int:
    """The engine process's pid, as /health reports it (the supervisor's field), else found among
    the API process's children."""
    body = httpx.get(f"{server.base_url}/health", timeout=10).json()
    if isinstance(body.get("engine_pid"), int):
        return body["engine_pid"]
    return child_engine_pid(server)


def usage_db(server: Server) -> Path:
    """The --usage-db that start_server gives a server (unless the test passes its own)."""
    port = server.base_url.rsplit(":", 1)[1]
    return server.log_path.parent / f"usage-{port}.sqlite3"
