"""A dead engine comes back, and nothing is unbilled: kill -9 of the engine process under load, an
engine that can never start (a crash loop), and kill -9 of the whole server under load — each
against a real server on the default model, its real engine process and its SQLite ledger."""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import Server, start_server, wait_until

MODEL = "SmolLM2-135M-Instruct"
LONG = 3000  # tokens a long stream asks for: it is still running when the kill comes


def stream_completion(server: Server, request_id: str, max_tokens: int, out: dict[str, list[str]]) -> None:
    """Stream one completion, keeping every SSE data line (in ``out[request_id]``) until it ends."""
    lines: list[str] = out.setdefault(request_id, [])
    body = {"model": MODEL, "prompt": f"Story {request_id}:", "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0.8, "stream": True}
    try:
        with httpx.stream("POST", f"{server.api_url}/completions", json=body, timeout=120,
                          headers={"X-Request-Id": request_id}) as response:
            lines.append(f"status {response.status_code}")
            for line in response.iter_lines():
                if line.startswith("data: "):
                    lines.append(line.removeprefix("data: "))
    except httpx.HTTPError as exc:  # a connection that breaks instead of ending is a failure
        lines.append(f"broken {exc!r}")


def start_streams(server: Server, ids: list[str], max_tokens: int) -> tuple[list[threading.Thread], dict[str, list[str]]]:
    out: dict[str, list[str]] = {}
    threads = [threading.Thread(target=stream_completion, args=(server, i, max_tokens, out), daemon=True) for i in ids]
    for thread in threads:
        thread.start()
    return threads, out


def tokens_seen(lines: list[str]) -> int:
    return sum(1 for line in lines if line.startswith("{") and '"choices":[{' in line)


def health(server: Server) -> httpx.Response:
    return httpx.get(f"{server.base_url}/health", timeout=5)


def ledger_rows(db: Path) -> dict[str, dict[str, object]]:
    conn = sqlite3.connect(db)
    conn.row_factory = sqlite3.Row
    try:
        return {row["request_id"]: dict(row) for row in conn.execute("SELECT * FROM usage")}
    finally:
        conn.close()


def usage_db(server: Server) -> Path:
    port = server.base_url.rsplit(":", 1)[1]
    return server.log_path.parent / f"usage-{port}.sqlite3"


READY_AGAIN_S = 15.0  # a restarted engine serves again within this on an otherwise idle machine
COLD_START_S: list[float] = []  # how long this server took to start cold (the machine's pace now)


@pytest.fixture(scope="module")
def supervised(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("supervised")
    started = time.monotonic()
    with start_server(tmp, "--dtype", "float32", "--engine-restart-backoff", "0.2") as server:
        COLD_START_S.append(time.monotonic() - started)
        yield server


def test_live_is_separate_from_readiness(supervised: Server) -> None:
    ready = health(supervised)
    assert ready.status_code == 200 and ready.json()["status"] == "ok"
    assert isinstance(ready.json()["engine_pid"], int)
    live = httpx.get(f"{supervised.base_url}/live", timeout=5)
    assert live.status_code == 200 and live.json() == {"status": "alive"}


def test_killed_engine_is_reaped_and_restarted(supervised: Server) -> None:
    old_pid = health(supervised).json()["engine_pid"]
    ids = [f"engine-kill-{i}" for i in range(3)]
    threads, out = start_streams(supervised, ids, LONG)
    assert wait_until(lambda: all(tokens_seen(out.get(i, [])) >= 3 for i in ids), timeout=60), out
    os.kill(old_pid, signal.SIGKILL)

    # In-flight streams end cleanly: an error event in the OpenAI shape, then [DONE].
    for thread in threads:
        thread.join(timeout=30)
    for request_id in ids:
        lines = out[request_id]
        assert lines[0] == "status 200" and lines[-1] == "[DONE]", lines[-3:]
        error = json.loads(lines[-2])["error"]
        assert error["type"] == "server_error" and "engine" in error["message"]

    # Not ready (503, saying so, with Retry-After) until the new engine is, while /live stays 200;
    # a request meanwhile gets a clean 503 with Retry-After, never a 500.
    seen_restarting, seen_503_request = False, False
    # 15 s; on a machine so busy that a cold start took longer, no longer than that cold start.
    ready_within = max(READY_AGAIN_S, *COLD_START_S)
    deadline = time.monotonic() + ready_within
    while time.monotonic() < deadline:
        assert httpx.get(f"{supervised.base_url}/live", timeout=5).status_code == 200
        r = health(supervised)
        if r.status_code == 200:
            break
        assert r.status_code == 503 and r.json()["status"] == "restarting", r.text
        assert r.headers["retry-after"]
        seen_restarting = True
        if not seen_503_request:
            refused = httpx.post(f"{supervised.api_url}/completions", timeout=30,
                                 json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
            if refused.status_code == 503:  # (the engine may have come back in between)
                assert refused.json()["error"]["type"] == "service_unavailable"
                assert int(refused.headers["retry-after"]) >= 1
                seen_503_request = True
        time.sleep(0.1)
    ready = health(supervised)
    assert ready.status_code == 200, f"not ready {ready_within:.0f} s after the kill: {ready.text}"
    assert seen_restarting and seen_503_request
    body = ready.json()
    assert body["engine_pid"] != old_pid and body["engine_restarts"] == 1
    assert not Path(f"/proc/{old_pid}").exists(), "the dead engine was not reaped (a zombie)"

    # The next requests succeed.
    for _ in range(2):
        ok = httpx.post(f"{supervised.api_url}/completions", timeout=60,
                        json={"model": MODEL, "prompt": "Hello", "max_tokens": 4})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4, ok.text

    # The ledger has each in-flight request: failed because the engine died, with its tokens.
    rows = ledger_rows(usage_db(supervised))
    for request_id in ids:
        row = rows[request_id]
        assert row["status"] == "failed" and row["finish_reason"] == "abort:engine_dead", row
        assert row["completion_tokens"] >= tokens_seen(out[request_id]) >= 3
    assert "engine process exited unexpectedly" in supervised.log()
    assert "engine restarted" in supervised.log()


def test_crash_loop_exits_the_server_non_zero(tmp_path: Path) -> None:
    # An engine that can never start: its KV-event port is taken, every start fails the same way.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        events = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{port}"})
        with start_server(tmp_path, "--kv-events-config", events, "--engine-restart-max", "1",
                          "--engine-restart-backoff", "0.1", wait_ready=False) as server:
            def live() -> bool:
                try:
                    return httpx.get(f"{server.base_url}/live", timeout=5).status_code == 200
                except httpx.HTTPError:
                    return False

            assert wait_until(live, timeout=60)  # alive while its engine fails to start
            code = server.process.wait(timeout=120)
            log = server.log()
    assert code == 3, log[-3000:]
    assert "engine crash loop: 2 deaths within" in log and "giving up" in log


def test_server_killed_under_load_leaves_interrupted_rows(tmp_path: Path) -> None:
    db = tmp_path / "crash.sqlite3"
    with start_server(tmp_path, "--usage-db", str(db)) as server:
        engine_pid = health(server).json()["engine_pid"]
        short = [f"short-{i}" for i in range(3)]
        threads, out = start_streams(server, short, 8)
        for thread in threads:
            thread.join(timeout=60)
        assert all(out[i][-1] == "[DONE]" for i in short), out
        long = [f"long-{i}" for i in range(3)]
        _, out_long = start_streams(server, long, LONG)
        assert wait_until(lambda: all(tokens_seen(out_long.get(i, [])) >= 3 for i in long), timeout=60)

        # The journal records tokens produced once a second per request: kill once every long row
        # holds some (a fixed sleep raced a loaded CI box and killed before long-0's first update).
        def journaled() -> bool:
            rows = ledger_rows(db)
            return all(i in rows and rows[i]["completion_tokens"] > 0 for i in long)

        assert wait_until(journaled, timeout=30), ledger_rows(db)
        server.process.kill()
        server.process.wait(timeout=10)
        try:
            os.kill(engine_pid, signal.SIGKILL)  # an orphan would exit at its next read; do not wait
        except ProcessLookupError:
            pass

    before = ledger_rows(db)
    assert all(before[i]["status"] == "in_flight" for i in long), before
    with start_server(tmp_path, "--usage-db", str(db)) as server:
        assert "marked interrupted" in server.log()
    rows = ledger_rows(db)
    for request_id in short:
        assert rows[request_id]["status"] == "finished" and rows[request_id]["completion_tokens"] == 8
    for request_id in long:
        row = rows[request_id]
        assert row["status"] == "interrupted" and row["finish_reason"] == "abort:server_crash", row
        assert row["completion_tokens"] > 0 and row["prompt_tokens"] > 0 and row["response_id"], row
    conn = sqlite3.connect(db)
    try:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    finally:
        conn.close()
