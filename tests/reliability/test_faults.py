"""Faults under load, against real servers on the default model: kill -9 of the engine process (the
supervisor brings it back) and kill -9 of the whole server (the restarted server finds every
request in its ledger). Load here is a few dozen concurrent streams, enough that the kill lands
mid-step with requests queued.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import Server, start_server, wait_until
from tests.reliability.conftest import chat_body, engine_pid, ledger_rows

pytestmark = pytest.mark.reliability

STREAMS = 24
LONG = 3000  # tokens a long stream asks for: it is still running when the kill comes
READY_AFTER_KILL_S = 15.0  # on an otherwise idle machine (CI runs this suite alone)
COLD_START_S: list[float] = []  # how long the supervised server took to start: the machine's pace now


class Streams:
    """Long streaming chat requests in threads, each keeping its SSE data payloads (and how it ended)."""

    def __init__(self, server: Server, ids: list[str], max_tokens: int) -> None:
        self.out: dict[str, list[str]] = {i: [] for i in ids}
        self.threads = [threading.Thread(target=self._run, args=(server, i, max_tokens), daemon=True) for i in ids]
        for thread in self.threads:
            thread.start()

    def _run(self, server: Server, request_id: str, max_tokens: int) -> None:
        lines = self.out[request_id]
        body = chat_body(f"Tell a long story about {request_id}.", max_tokens, stream=True, ignore_eos=True)
        try:
            with httpx.stream("POST", f"{server.api_url}/chat/completions", json=body, timeout=120,
                              headers={"X-Request-Id": request_id}) as response:
                lines.append(f"status {response.status_code}")
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        lines.append(line.removeprefix("data: "))
        except httpx.HTTPError as exc:
            lines.append(f"broken {exc!r}")

    def tokens(self, request_id: str) -> int:
        return sum(1 for line in self.out[request_id] if line.startswith("{") and '"content":"' in line)

    def all_streaming(self, at_least: int) -> bool:
        return all(self.tokens(i) >= at_least for i in self.out)

    def join(self, timeout: float) -> list[str]:
        """Wait for every stream to end; the ids of those still open."""
        deadline = time.monotonic() + timeout
        for thread in self.threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        return [i for i, t in zip(self.out, self.threads, strict=True) if t.is_alive()]


def complete(server: Server, request_id: str, max_tokens: int = 8) -> httpx.Response:
    return httpx.post(f"{server.api_url}/chat/completions", json=chat_body("Say hello.", max_tokens),
                      headers={"X-Request-Id": request_id}, timeout=120)


def status(server: Server, path: str) -> int | None:
    try:
        return httpx.get(f"{server.base_url}{path}", timeout=5).status_code
    except httpx.HTTPError:
        return None


# --- kill -9 of the engine ------------------------------------------------------------------


@pytest.fixture(scope="module")
def supervised(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[Server]:
    started = time.monotonic()
    with start_server(tmp_path_factory.mktemp("supervised")) as running:
        COLD_START_S.append(time.monotonic() - started)
        yield running


def test_engine_killed_under_load_is_back_within_15_s(supervised: Server) -> None:
    old_pid = engine_pid(supervised)
    streams = Streams(supervised, [f"rel-engine-kill-{i}" for i in range(STREAMS)], LONG)
    assert wait_until(lambda: streams.all_streaming(at_least=2), timeout=120), {
        i: streams.tokens(i) for i in streams.out}

    # 15 s; where other work slows the machine so that a cold start took longer, that cold start
    # (a restart is never slower than one).
    ready_within = max(READY_AFTER_KILL_S, *COLD_START_S)
    os.kill(old_pid, signal.SIGKILL)
    killed_at, killed_wall = time.monotonic(), time.strftime("%H:%M:%S")
    live, ready_at = [], None
    while time.monotonic() - killed_at < ready_within + 5:
        live.append(status(supervised, "/live"))
        # Ready means a new engine: the old one's exit (tearing down GBs of mappings) is not instant,
        # and until the kernel reaps it the old pid may still look alive for a moment.
        if status(supervised, "/health") == 200 and engine_pid(supervised) != old_pid:
            ready_at = time.monotonic()
            break
        time.sleep(0.1)
    assert ready_at is not None and ready_at - killed_at <= ready_within, (
        f"/health not 200 within {ready_within:.0f} s of the kill at {killed_wall}\n{supervised.log()[-3000:]}")
    assert all(code == 200 for code in live), f"/live answered {set(live)} while the engine restarted"
    assert engine_pid(supervised) != old_pid

    # Every in-flight stream ended, cleanly: an error event in the OpenAI shape, then [DONE].
    assert not streams.join(timeout=30)
    for request_id, lines in streams.out.items():
        assert lines[0] == "status 200" and lines[-1] == "[DONE]", (request_id, lines[-3:])
        assert "error" in json.loads(lines[-2]), (request_id, lines[-3:])

    # The next requests succeed, several at once.
    results: dict[str, httpx.Response] = {}
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, complete(supervised, i)))
               for i in (f"rel-after-kill-{n}" for n in range(8))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert len(results) == 8
    for request_id, response in results.items():
        assert response.status_code == 200, (request_id, response.text)
        assert response.json()["usage"]["completion_tokens"] > 0


# --- kill -9 of the whole server ------------------------------------------------------------


def test_server_killed_under_load_leaves_every_request_in_the_ledger(tmp_path: Path, default_model_dir: Path) -> None:
    db = tmp_path / "crash.sqlite3"
    finished: dict[str, int] = {}  # request id → completion tokens the client was told
    with start_server(tmp_path, "--usage-db", str(db)) as server:
        old_engine = engine_pid(server)
        for n in range(4):
            request_id = f"rel-done-before-{n}"
            response = complete(server, request_id)
            assert response.status_code == 200, response.text
            finished[request_id] = response.json()["usage"]["completion_tokens"]

        in_flight = [f"rel-crash-{i}" for i in range(STREAMS)]
        streams = Streams(server, in_flight, LONG)
        # Short requests keep finishing while the long ones stream.
        for n in range(4):
            request_id = f"rel-done-under-load-{n}"
            response = complete(server, request_id)
            assert response.status_code == 200, response.text
            finished[request_id] = response.json()["usage"]["completion_tokens"]
        assert wait_until(lambda: streams.all_streaming(at_least=3), timeout=120)
        # The journal writes tokens produced about once a second: kill once every stream's row
        # holds some (a fixed beat raced a loaded CI box in the test of the same kill in tests/e2e).
        def journaled() -> dict[str, int]:
            return {r["request_id"]: r["completion_tokens"] for r in ledger_rows(db, "rel-crash-%", in_flight=True)}

        assert wait_until(lambda: all(journaled().get(i, 0) > 0 for i in in_flight), timeout=30), journaled()
        server.process.kill()
        server.process.wait(timeout=10)
        try:
            os.kill(old_engine, signal.SIGKILL)  # the whole server: its engine dies with it
        except ProcessLookupError:
            pass
        assert not streams.join(timeout=30), "a client still reads from a dead server"

    with start_server(tmp_path, "--usage-db", str(db)) as restarted:
        assert restarted.process.poll() is None
    rows = {r["request_id"]: r for r in ledger_rows(db, "rel-%")}
    assert sorted(rows) == sorted([*finished, *in_flight]), "one row per request, no more, no less"
    for request_id, tokens in finished.items():
        row = rows[request_id]
        assert row["status"] == "finished" and row["completion_tokens"] == tokens, row
    for request_id in in_flight:
        row = rows[request_id]
        assert row["status"] == "interrupted", row
        assert row["prompt_tokens"] > 0 and row["completion_tokens"] > 0, row
        assert row["completion_tokens"] <= LONG, row
    with closing(sqlite3.connect(db)) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
