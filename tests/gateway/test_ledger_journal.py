"""The ledger's journal on real SQLite: a row at admission, progress while running, completion at
the end; rows left in flight by a dead server recovered as interrupted; an older database
migrated; a process killed mid-journal leaves a database that passes its integrity check."""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tokenline.gateway.ledger import (
    ABORT_REASONS,
    SCHEMA_VERSION,
    PriceTable,
    UsageLedger,
    UsageRecord,
    server_owner,
)

REPO = Path(__file__).resolve().parents[2]
PRICES = PriceTable.from_dict({"default": {"input": 1.0, "output": 10.0}})


def in_flight(response_id: str, prompt: int = 100) -> UsageRecord:
    return UsageRecord(f"req-{response_id}", "acme", "m", "in_flight", prompt_tokens=prompt,
                       created_at=1_700_000_000.0, response_id=response_id)


def rows(path: Path) -> dict[str, tuple]:
    conn = sqlite3.connect(path)
    try:
        return {r[0]: r[1:] for r in conn.execute(
            "SELECT response_id, status, finish_reason, completion_tokens, cost_usd, owner FROM usage")}
    finally:
        conn.close()


def test_journal_progress_complete_is_one_row(tmp_path: Path) -> None:
    db = tmp_path / "u.sqlite3"

    async def go() -> None:
        with UsageLedger(db, PRICES) as ledger:
            rec = in_flight("chatcmpl-1")
            ledger.journal(rec)
            rec.completion_tokens = 7
            ledger.progress(rec)
            final = UsageRecord("req-chatcmpl-1", "acme", "m", "cancelled", ABORT_REASONS["cancelled"], 100, 0, 9,
                                created_at=rec.created_at, response_id="chatcmpl-1")
            await ledger.record(final)
            # A plain record without a journal is its own row, as before.
            await ledger.record(UsageRecord("req-2", "acme", "m", "finished", "stop", 5, 0, 1, response_id="cmpl-2"))

    asyncio.run(go())
    stored = rows(db)
    assert set(stored) == {"chatcmpl-1", "cmpl-2"}
    status, reason, completion, cost, owner = stored["chatcmpl-1"]
    assert (status, reason, completion) == ("cancelled", "abort:client_disconnect", 9)
    assert cost == pytest.approx((100 * 1.0 + 9 * 10.0) / 1e6) and owner == server_owner()


def test_progress_is_visible_while_in_flight(tmp_path: Path) -> None:
    db = tmp_path / "u.sqlite3"
    ledger = UsageLedger(db, PRICES)
    try:
        rec = in_flight("chatcmpl-p")
        ledger.journal(rec)
        rec.completion_tokens = 42
        ledger.progress(rec)
        rec.completion_tokens = 50  # the caller goes on; the queued update keeps its own numbers
        deadline = time.monotonic() + 10
        while rows(db).get("chatcmpl-p", (None,))[0:3:2] != ("in_flight", 42) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert rows(db)["chatcmpl-p"][0:3] == ("in_flight", None, 42)
    finally:
        ledger.close()


def test_recover_marks_only_rows_of_dead_servers(tmp_path: Path) -> None:
    db = tmp_path / "u.sqlite3"
    host = server_owner().rpartition(":")[0]
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    with UsageLedger(db) as ledger:
        ledger.journal(in_flight("mine"))  # this very process: a previous life with the same pid
    conn = sqlite3.connect(db)
    try:
        for response_id, owner in (("dead", f"{host}:{dead.pid}"), ("alive", f"{host}:{os.getppid()}"),
                                   ("elsewhere", "other-host:1")):
            conn.execute("INSERT INTO usage (request_id, response_id, tenant, model, status, prompt_tokens, "
                         "cached_tokens, completion_tokens, created_at, cost_usd, owner) "
                         "VALUES (?, ?, 't', 'm', 'in_flight', 10, 0, 3, 0, 0, ?)", (response_id, response_id, owner))
        conn.commit()
    finally:
        conn.close()
    with UsageLedger(db) as ledger:
        assert ledger.recover_interrupted() == 2
        assert ledger.recover_interrupted() == 0
    stored = rows(db)
    for response_id in ("mine", "dead"):
        assert stored[response_id][:2] == ("interrupted", "abort:server_crash")
    assert stored["dead"][2] == 3  # the tokens last journaled stay
    assert stored["alive"][0] == "in_flight" and stored["elsewhere"][0] == "in_flight"


def test_schema_2_database_is_migrated(tmp_path: Path) -> None:
    db = tmp_path / "old.sqlite3"
    conn = sqlite3.connect(db)
    conn.executescript("""
        CREATE TABLE usage (id INTEGER PRIMARY KEY, request_id TEXT NOT NULL, response_id TEXT,
            tenant TEXT NOT NULL, model TEXT NOT NULL, status TEXT NOT NULL, finish_reason TEXT,
            prompt_tokens INTEGER NOT NULL, cached_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL,
            created_at REAL NOT NULL, queue_s REAL, ttft_s REAL, e2e_s REAL, cost_usd REAL NOT NULL);
        INSERT INTO usage (request_id, response_id, tenant, model, status, finish_reason, prompt_tokens,
            cached_tokens, completion_tokens, created_at, cost_usd)
            VALUES ('old', 'cmpl-old', 't', 'm', 'cancelled', NULL, 5, 0, 2, 1.0, 0.0);
        PRAGMA user_version = 2;
    """)
    conn.close()

    async def go() -> None:
        with UsageLedger(db) as ledger:
            ledger.journal(in_flight("cmpl-new"))
            await ledger.record(UsageRecord("req-cmpl-new", "acme", "m", "finished", "stop", 100, 0, 4,
                                            response_id="cmpl-new"))
            assert [r.request_id for r in ledger.records()] == ["req-cmpl-new", "old"]

    asyncio.run(go())
    conn = sqlite3.connect(db)
    try:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        assert "usage_in_flight" in {r[1] for r in conn.execute("PRAGMA index_list(usage)")}
    finally:
        conn.close()
    assert rows(db)["cmpl-old"][:3] == ("cancelled", None, 2)  # old rows are never rewritten
    assert rows(db)["cmpl-new"][:3] == ("finished", "stop", 4)


_CHILD = """
import sys, time
from tokenline.gateway.ledger import UsageLedger, UsageRecord
ledger = UsageLedger(sys.argv[1])
records = []
for i in range(20):
    rec = UsageRecord(f"req-{i}", "t", "m", "in_flight", prompt_tokens=10, response_id=f"cmpl-{i}")
    ledger.journal(rec)
    records.append(rec)
n = 0
while True:  # progress on every row until killed
    n += 1
    for rec in records:
        rec.completion_tokens = n
        ledger.progress(rec)
    if n == 3:
        print("ready", flush=True)
    time.sleep(0.005)
"""


def test_kill_9_mid_journal_then_recover(tmp_path: Path) -> None:
    db = tmp_path / "crash.sqlite3"
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(db)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        time.sleep(0.3)
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=10)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=10)
    with UsageLedger(db) as ledger:
        assert ledger.recover_interrupted() == 20
        recovered = ledger.records(limit=None)
    assert all(r.status == "interrupted" and r.finish_reason == "abort:server_crash" for r in recovered)
    assert all(r.completion_tokens >= 1 for r in recovered)
    conn = sqlite3.connect(db)
    try:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    finally:
        conn.close()
