"""A reader of a real server's live event stream (GET /v1/events), for the tests that watch it."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class EventReader:
    """Reads /v1/events in a thread until ``stop`` (or its deadline), keeping every event."""

    url: str
    key: str
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    connected: threading.Event = field(default_factory=threading.Event)

    def run(self, deadline_s: float = 90.0) -> None:
        deadline = time.monotonic() + deadline_s
        headers = {"Authorization": f"Bearer {self.key}"}
        with httpx.stream("GET", f"{self.url}/v1/events", headers=headers, timeout=30) as response:
            assert response.status_code == 200, response.read()
            assert response.headers["content-type"].startswith("text/event-stream")
            kind = None
            for line in response.iter_lines():  # a stats event at least every second: never stuck
                if line.startswith("event: "):
                    kind = line[len("event: "):]
                elif line.startswith("data: "):
                    self.events.append((kind, json.loads(line[len("data: "):])))
                    self.connected.set()
                if self.stop.is_set() or time.monotonic() > deadline:
                    return

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [data for k, data in self.events if k == kind]
