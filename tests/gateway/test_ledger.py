"""The usage ledger: prices, durable writes (also across a killed process), queries and the CLI."""

from __future__ import annotations

import asyncio
import json
import os
import queue
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from tokenline.cli import main
from tokenline.gateway.ledger import (
    ModelPrice,
    PriceTable,
    UsageLedger,
    UsageRecord,
    UsageSummaryRow,
    default_ledger_path,
    parse_time,
)

REPO = Path(__file__).resolve().parents[2]
SMOL = "SmolLM2-135M-Instruct"


def rec(request_id: str, tenant: str = "acme", model: str = SMOL, **kw: object) -> UsageRecord:
    base: dict[str, object] = dict(status="finished", finish_reason="stop", prompt_tokens=100,
                                   cached_tokens=0, completion_tokens=10, created_at=1_700_000_000.0)
    base.update(kw)
    return UsageRecord(request_id, tenant, model, **base)  # type: ignore[arg-type]


@pytest.fixture
def prices(tmp_path: Path) -> PriceTable:
    path = tmp_path / "prices.toml"
    path.write_text(textwrap.dedent(f"""
        [models."{SMOL}"]
        input = 0.45
        output = 3.20
        cached_input = 0.10

        [models."no-cache-price"]
        input = 1.0
        output = 2.0
    """))
    return PriceTable.from_file(path)


@pytest.fixture
def ledger(tmp_path: Path, prices: PriceTable):
    with UsageLedger(tmp_path / "usage.sqlite3", prices) as led:
        yield led


# ------------------------------------------------------------------------------------ prices


def test_cost_arithmetic(prices: PriceTable) -> None:
    # 900 uncached input, 100 cached input, 50 output tokens.
    expected = (900 * 0.45 + 100 * 0.10 + 50 * 3.20) / 1e6
    assert prices.cost(SMOL, 1000, 100, 50) == pytest.approx(expected, rel=1e-12)
    # Without a cached price, cached tokens cost the full input price.
    assert prices.cost("no-cache-price", 1000, 400, 10) == pytest.approx((1000 * 1.0 + 10 * 2.0) / 1e6)
    # A model with no price costs nothing.
    assert prices.cost("unpriced", 1000, 0, 1000) == 0.0
    assert prices.cost(SMOL, 0, 0, 0) == 0.0


def test_price_table_default_and_errors(tmp_path: Path) -> None:
    path = tmp_path / "p.toml"
    path.write_text('[default]\ninput = 2.0\noutput = 8.0\n[models.a]\ninput = 1.0\noutput = 1.0\n')
    table = PriceTable.from_file(path)
    assert table.cost("a", 10, 0, 10) == pytest.approx(20 / 1e6)
    assert table.cost("anything-else", 1_000_000, 0, 0) == pytest.approx(2.0)
    assert table.price("anything-else") == ModelPrice(2.0, 8.0, None)

    path.write_text('[models.a]\ninput = 1.0\n')
    with pytest.raises(ValueError, match="missing output"):
        PriceTable.from_file(path)
    path.write_text('[models.a]\ninput = -1.0\noutput = 1.0\n')
    with pytest.raises(ValueError, match="non-negative"):
        PriceTable.from_file(path)
    path.write_text('[models.a]\ninput = 1.0\noutput = 1.0\ncache = 0.1\n')
    with pytest.raises(ValueError, match="unknown key"):
        PriceTable.from_file(path)


# ------------------------------------------------------------------------------------ writing


def test_wal_mode_and_schema(ledger: UsageLedger) -> None:
    conn = sqlite3.connect(ledger.path)
    try:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        indexes = {row[1] for row in conn.execute("PRAGMA index_list(usage)")}
        assert {"usage_created_at", "usage_tenant_created_at"} <= indexes
    finally:
        conn.close()


def test_record_round_trip_and_cost(ledger: UsageLedger) -> None:
    original = rec("r1", status="cancelled", finish_reason=None, prompt_tokens=1000, cached_tokens=100,
                   completion_tokens=50, created_at=1_700_000_123.5, queue_s=0.01, ttft_s=0.2, e2e_s=1.5)
    asyncio.run(ledger.record(original))
    assert original.cost_usd == pytest.approx((900 * 0.45 + 100 * 0.10 + 50 * 3.20) / 1e6)
    [back] = ledger.records()
    assert back == original


def test_record_resolves_after_commit(ledger: UsageLedger) -> None:
    async def go() -> list[int]:
        seen = []
        other = sqlite3.connect(ledger.path)
        try:
            for i in range(20):
                await ledger.record(rec(f"r{i}"))
                # A separate connection sees the row the moment record() returns.
                seen.append(other.execute("SELECT COUNT(*) FROM usage").fetchone()[0])
        finally:
            other.close()
        return seen

    assert asyncio.run(go()) == list(range(1, 21))


def test_concurrent_records_batch(ledger: UsageLedger) -> None:
    async def go() -> None:
        await asyncio.gather(*(ledger.record(rec(f"c{i}")) for i in range(300)))

    asyncio.run(go())
    assert len(ledger.records(limit=None)) == 300


def test_record_nowait_and_close_drains(tmp_path: Path, prices: PriceTable) -> None:
    led = UsageLedger(tmp_path / "u.sqlite3", prices)
    for i in range(100):
        led.record_nowait(rec(f"n{i}"))
    led.close()
    with pytest.raises(RuntimeError, match="closed"):
        led.record_nowait(rec("late"))
    led.close()  # idempotent
    with UsageLedger(tmp_path / "u.sqlite3", prices) as again:
        assert len(again.records(limit=None)) == 100


def test_invalid_record_is_refused(ledger: UsageLedger) -> None:
    with pytest.raises(ValueError, match="status"):
        ledger.record_nowait(rec("x", status="done"))
    with pytest.raises(ValueError, match="cached_tokens"):
        ledger.record_nowait(rec("x", prompt_tokens=5, cached_tokens=6))
    with pytest.raises(ValueError, match="completion_tokens"):
        ledger.record_nowait(rec("x", completion_tokens=-1))


# ------------------------------------------------------------------------------------ queries


def _fill(ledger: UsageLedger) -> None:
    async def go() -> None:
        for i, (tenant, model, t) in enumerate([
            ("acme", SMOL, 1000.0), ("acme", SMOL, 1500.0), ("acme", "other", 1600.0),
            ("zeta", SMOL, 1700.0), ("acme", SMOL, 2000.0),
        ]):
            await ledger.record(rec(f"q{i}", tenant, model, created_at=t, prompt_tokens=100 * (i + 1),
                                    cached_tokens=10, completion_tokens=i + 1))

    asyncio.run(go())


def test_summary_grouping_and_time_filter(ledger: UsageLedger) -> None:
    _fill(ledger)
    def keys(rows: list[UsageSummaryRow]) -> list[tuple[str, str, int]]:
        return [(r.tenant, r.model, r.requests) for r in rows]

    rows = ledger.summary(None, None)
    # Sorted by tenant, then model (binary order: "SmolLM2..." before "other").
    assert keys(rows) == [("acme", SMOL, 3), ("acme", "other", 1), ("zeta", SMOL, 1)]
    acme_smol = rows[0]
    tokens = (acme_smol.prompt_tokens, acme_smol.cached_tokens, acme_smol.completion_tokens)
    assert tokens == (100 + 200 + 500, 30, 1 + 2 + 5)
    acme_smol_cost = sum(r.cost_usd for r in ledger.records(tenant="acme") if r.model == SMOL)
    assert acme_smol.cost_usd == pytest.approx(acme_smol_cost)
    assert rows[1].cost_usd == 0.0  # "other" has no price

    # since is inclusive, until exclusive.
    assert keys(ledger.summary(1500.0, 2000.0)) == [("acme", SMOL, 1), ("acme", "other", 1), ("zeta", SMOL, 1)]
    assert [(r.tenant, r.requests) for r in ledger.summary(None, None, tenant="zeta")] == [("zeta", 1)]
    assert ledger.summary(5000.0, None) == []

    newest = ledger.records(limit=2)
    assert [r.request_id for r in newest] == ["q4", "q3"]
    assert [r.request_id for r in ledger.records(request_id="q2")] == ["q2"]


def test_parse_time() -> None:
    assert parse_time("1700000000") == 1_700_000_000.0
    assert parse_time("1970-01-02") == 86400.0  # no offset: UTC
    assert parse_time("1970-01-01T01:00:00+01:00") == 0.0
    with pytest.raises(ValueError):
        parse_time("yesterday")
    for no_date in ("nan", "NaN", "inf", "-inf", "1e30", "-1e30", "253402300800"):  # the last: year 10000
        with pytest.raises(ValueError, match="not a date"):
            parse_time(no_date)
    assert parse_time("253402300799") == 253_402_300_799.0  # 9999-12-31T23:59:59Z


def test_default_ledger_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TOKENLINE_HOME", str(tmp_path))
    assert default_ledger_path() == tmp_path / "usage.sqlite3"


# ------------------------------------------------------------------------------------ CLI


def test_cli_table_and_json(ledger: UsageLedger, capsys: pytest.CaptureFixture[str]) -> None:
    _fill(ledger)
    assert main(["usage", "--db", str(ledger.path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["tenant", "model", "requests", "prompt", "cached", "completion", "cost_usd"]
    total = ledger.summary(None, None)
    total_cost = sum(r.cost_usd for r in total)
    assert lines[-1].split() == ["TOTAL", "5", "1500", "50", "15", f"{total_cost:.6f}"]
    assert any(line.split()[:3] == ["zeta", SMOL, "1"] for line in lines)

    assert main(["usage", "--db", str(ledger.path), "--since", "1500", "--until", "1970-01-01T00:33:20Z",
                 "--tenant", "acme", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["since"] == 1500.0 and data["until"] == 2000.0
    assert [(r["tenant"], r["model"], r["requests"]) for r in data["rows"]] == [("acme", SMOL, 1), ("acme", "other", 1)]
    assert data["total"]["requests"] == 2
    assert data["total"]["prompt_tokens"] == 200 + 300


def test_cli_refuses_dates_that_are_no_dates(ledger: UsageLedger, capsys: pytest.CaptureFixture[str]) -> None:
    _fill(ledger)
    for flag, value in (("--since", "nan"), ("--since", "inf"), ("--until", "1e30")):
        assert main(["usage", "--db", str(ledger.path), flag, value]) == 2, (flag, value)
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.count("\n") == 1 and "not a date" in captured.err


def test_cli_missing_db(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["usage", "--db", str(tmp_path / "nope.sqlite3")]) == 1
    assert "no ledger" in capsys.readouterr().err
    assert not (tmp_path / "nope.sqlite3").exists()


# ------------------------------------------------------------------------------------ crash


_CHILD = textwrap.dedent("""
    import asyncio, sys
    from tokenline.gateway.ledger import PriceTable, UsageLedger, UsageRecord

    async def main() -> None:
        ledger = UsageLedger(sys.argv[1], PriceTable())
        for i in range(200_000):  # bounded; the parent kills us long before
            await ledger.record(UsageRecord(f"req-{i}", "t", "m", "finished", "stop", 10, 0, i))
            print(f"req-{i}", flush=True)  # only after the commit was confirmed

    asyncio.run(main())
""")


def test_records_survive_sigkill(tmp_path: Path) -> None:
    db = tmp_path / "crash.sqlite3"
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(db)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert child.stdout is not None
        for line in child.stdout:
            lines.put(line)
        lines.put(None)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    printed: list[str] = []
    try:
        deadline = time.monotonic() + 10.0
        while len(printed) < 50:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            assert line is not None, f"child exited early: {child.stderr.read() if child.stderr else ''}"
            printed.append(line)
        os.kill(child.pid, signal.SIGKILL)  # mid-stream: it is still writing
        child.wait(timeout=10)
        reader.join(timeout=10)
        # Lines the child printed before it died count too: each was printed after its commit.
        while (line := lines.get_nowait()) is not None:
            printed.append(line)
    finally:
        if child.poll() is None:
            os.kill(child.pid, signal.SIGKILL)
            child.wait(timeout=10)
    assert child.returncode == -signal.SIGKILL

    ids = {line.strip() for line in printed if line.endswith("\n")}
    assert len(ids) >= 50
    conn = sqlite3.connect(db)
    try:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        stored = {row[0] for row in conn.execute("SELECT request_id FROM usage")}
    finally:
        conn.close()
    assert ids <= stored, f"lost {len(ids - stored)} committed rows"
    assert len(stored) - len(ids) <= 5  # at most the few in flight when it died
