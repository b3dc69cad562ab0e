"""A tiny service in OpenAI's /v1/moderations shape, on 127.0.0.1 in a thread, for tests: it flags
every input that contains ``forbidden`` (category ``violence``) and records what it was sent.
Under ``/slow`` it answers after a second, under ``/broken`` with a 500, under ``/garbage`` with a
body of the wrong shape."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

TRIGGER = "forbidden"


@dataclass
class ModerationServer:
    url: str  # the base: POST {url}/v1/moderations
    seen: list[dict[str, Any]] = field(default_factory=list)  # {"path", "auth", "body"} per request


@contextmanager
def moderation_server() -> Iterator[ModerationServer]:
    seen: list[dict[str, Any]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append({"path": self.path, "auth": self.headers.get("Authorization"), "body": body})
            if self.path == "/slow/v1/moderations":
                time.sleep(1.0)
            if self.path == "/broken/v1/moderations":
                return self._send(500, {"error": {"message": "down"}})
            if self.path == "/garbage/v1/moderations":
                return self._send(200, {"results": "nope"})
            inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
            results = []
            for text in inputs:
                hit = TRIGGER in text.lower()
                results.append({"flagged": hit, "categories": {"violence": hit, "hate": False},
                                "category_scores": {"violence": 0.9 if hit else 0.01, "hate": 0.0}})
            self._send(200, {"id": "modr-1", "model": body.get("model", "m"), "results": results})

        def _send(self, status: int, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass  # quiet test output

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield ModerationServer(f"http://127.0.0.1:{server.server_address[1]}", seen)
    finally:
        server.shutdown()
        server.server_close()
