"""The durable usage ledger: one row per request, with its cost, in an embedded SQLite database.

A request served through the gateway is journaled: its row is written at admission with status
``in_flight`` (prompt tokens, tenant, model, response id), updated with the tokens produced so far
while it runs, and completed when it ends. A server that dies leaves such rows behind; the next
server marks them ``interrupted`` at start-up (``recover_interrupted``), keeping the tokens known.
Rows that did not finish name why in ``finish_reason`` (``ABORT_REASONS``).

Writes go through one writer thread fed by a queue, so the event loop never waits on disk;
``await ledger.record(rec)`` returns once the row is committed. The database runs in WAL mode
with ``synchronous=NORMAL``: a committed row survives a crash of the process (not a power cut,
which would need ``FULL`` and an fsync per commit). Readers open their own connections and never
block the writer.
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import json
import logging
import math
import os
import queue
import socket
import sqlite3
import sys
import threading
import time
import tomllib
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TextIO

from tokenline.gateway.errors import shorten
from tokenline.store.model_store import tokenline_home

logger = logging.getLogger("tokenline.gateway.ledger")

STATUSES = ("finished", "stopped", "cancelled", "timed_out", "failed", "in_flight", "interrupted", "refused")
# finish_reason of a row that did not finish by the model's stop or length, by status.
ABORT_REASONS = {
    "cancelled": "abort:client_disconnect",  # the client hung up
    "timed_out": "abort:timeout",  # --request-timeout ran out
    "failed": "abort:engine_dead",  # the engine died under it (other failures: "abort:error")
    "interrupted": "abort:server_crash",  # the server died; marked by the next server at start-up
}
SCHEMA_VERSION = 4  # 2: response_id; 3: owner, the in-flight journal index; 4: content_filter
_MAX_BATCH = 512  # rows committed in one transaction at most; bounds the latency of the first

_SCHEMA = """
CREATE TABLE IF NOT EXISTS usage (
    id                INTEGER PRIMARY KEY,
    request_id        TEXT    NOT NULL,
    response_id       TEXT,
    tenant            TEXT    NOT NULL,
    model             TEXT    NOT NULL,
    status            TEXT    NOT NULL,
    finish_reason     TEXT,
    prompt_tokens     INTEGER NOT NULL,
    cached_tokens     INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    created_at        REAL    NOT NULL,
    queue_s           REAL,
    ttft_s            REAL,
    e2e_s             REAL,
    cost_usd          REAL    NOT NULL
);
CREATE INDEX IF NOT EXISTS usage_created_at ON usage (created_at);
CREATE INDEX IF NOT EXISTS usage_tenant_created_at ON usage (tenant, created_at);
"""


def default_ledger_path() -> Path:
    """``tokenline_home()/usage.sqlite3``."""
    return tokenline_home() / "usage.sqlite3"


@dataclass
class UsageRecord:
    """What one request used. ``completion_tokens`` counts the tokens actually produced, also
    for a request that was cancelled or timed out. ``cost_usd`` is set by the ledger."""

    request_id: str  # the X-Request-Id (the caller's or ours)
    tenant: str
    model: str
    status: str  # one of STATUSES
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    created_at: float = field(default_factory=time.time)  # unix seconds
    queue_s: float | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    cost_usd: float = 0.0
    response_id: str | None = None  # the response body's id (chatcmpl-…); joins the row to the trace
    owner: str | None = None  # "host:pid" of the server that wrote the row (set by the ledger)
    content_filter: str | None = None  # the safety filter that refused the input or cut the output

    def validate(self) -> None:
        """Raise ``ValueError`` for a record that must not reach the ledger."""
        if self.status not in STATUSES:
            raise ValueError(f"status {self.status!r} is not one of {', '.join(STATUSES)}")
        for name in ("prompt_tokens", "cached_tokens", "completion_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        if self.cached_tokens > self.prompt_tokens:
            raise ValueError(f"cached_tokens ({self.cached_tokens}) exceeds prompt_tokens ({self.prompt_tokens})")
        if not math.isfinite(self.created_at):
            raise ValueError(f"created_at must be a finite unix time, got {self.created_at!r}")


_COLUMNS = tuple(f.name for f in fields(UsageRecord))
_INSERT = f"INSERT INTO usage ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' * len(_COLUMNS))})"
# A journaled row is found by its response id among the rows still in flight of this server.
_UPDATE = (f"UPDATE usage SET {', '.join(f'{c} = ?' for c in _COLUMNS)} "
           "WHERE response_id = ? AND owner = ? AND status = 'in_flight'")


@dataclass
class UsageSummaryRow:
    tenant: str
    model: str
    requests: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    cost_usd: float


# ---------------------------------------------------------------------------------------- prices


@dataclass(frozen=True)
class ModelPrice:
    """USD per million tokens. Cached prompt tokens cost ``cached_input_per_mtok`` when set,
    else the full input price."""

    input_per_mtok: float
    output_per_mtok: float
    cached_input_per_mtok: float | None = None

    def __post_init__(self) -> None:
        for name in ("input_per_mtok", "output_per_mtok", "cached_input_per_mtok"):
            value = getattr(self, name)
            if value is None and name == "cached_input_per_mtok":
                continue
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a non-negative number, got {value!r}")

    def cost(self, prompt: int, cached: int, completion: int) -> float:
        cached_price = self.input_per_mtok if self.cached_input_per_mtok is None else self.cached_input_per_mtok
        return (
            (prompt - cached) * self.input_per_mtok + cached * cached_price + completion * self.output_per_mtok
        ) / 1e6


@dataclass
class PriceTable:
    """Prices by model name; ``default`` prices any model not listed (no default: it costs 0)."""

    models: dict[str, ModelPrice] = field(default_factory=dict)
    default: ModelPrice | None = None

    @classmethod
    def from_file(cls, path: str | Path) -> PriceTable:
        """Read a TOML file::

            [default]                       # optional
            input = 0.50
            output = 4.00

            [models."SmolLM2-135M-Instruct"]
            input = 0.45
            output = 3.20
            cached_input = 0.10             # optional
        """
        with open(path, "rb") as f:
            data = tomllib.load(f)
        try:
            return cls.from_dict(data)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PriceTable:
        unknown = set(data) - {"models", "default"}
        if unknown:
            raise ValueError(f"unknown price table section(s): {', '.join(sorted(unknown))}")
        models = data.get("models", {})
        if not isinstance(models, dict):
            raise ValueError("[models] must be a table of tables")
        table = cls({name: _price_from_dict(f'models."{name}"', entry) for name, entry in models.items()})
        if "default" in data:
            table.default = _price_from_dict("default", data["default"])
        return table

    def price(self, model: str) -> ModelPrice | None:
        return self.models.get(model, self.default)

    def cost(self, model: str, prompt: int, cached: int, completion: int) -> float:
        """USD for one request; a model with no price (and no default) costs 0."""
        price = self.price(model)
        return price.cost(prompt, cached, completion) if price else 0.0


def _price_from_dict(section: str, entry: Any) -> ModelPrice:
    if not isinstance(entry, dict):
        raise ValueError(f"[{section}] must be a table")
    unknown = set(entry) - {"input", "output", "cached_input"}
    if unknown:
        raise ValueError(f"[{section}] has unknown key(s): {', '.join(sorted(unknown))}")
    missing = {"input", "output"} - set(entry)
    if missing:
        raise ValueError(f"[{section}] is missing {', '.join(sorted(missing))}")
    try:
        return ModelPrice(entry["input"], entry["output"], entry.get("cached_input"))
    except ValueError as e:
        raise ValueError(f"[{section}] {e}") from None


# ---------------------------------------------------------------------------------------- ledger


# A queued write: what to do with the record and, for ``record()``, how to tell the waiting
# coroutine. Ops: "insert" a finished row; "journal" an in-flight one; "progress" updates an
# in-flight row; "complete" turns it into the finished row (inserting it if the journal was lost).
_Done = Callable[[BaseException | None], None]
_Write = tuple[str, "UsageRecord", "_Done | None"]
_STOP = object()


def server_owner() -> str:
    """How this process signs the rows it writes: ``host:pid``."""
    return f"{socket.gethostname()}:{os.getpid()}"


def _owner_gone(owner: str | None, me: str) -> bool:
    """Whether the server that wrote an in-flight row can no longer complete it. Only a server on
    this host can tell: its process is gone, or it is this very process (a new server that got
    the old pid, as pid 1 in a container does). Rows of other hosts are left alone."""
    if owner is None or owner == me:
        return True
    host, _, pid = owner.rpartition(":")
    if host != me.rpartition(":")[0] or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, someone else's
        return False
    return False


def _connect(path: Path) -> sqlite3.Connection:
    # A generous busy timeout: another process (a second server, the CLI) may hold the write lock.
    conn = sqlite3.connect(path, timeout=30.0, isolation_level=None)  # explicit transactions
    conn.execute("PRAGMA busy_timeout = 30000")
    return conn


def _migrate(conn: sqlite3.Connection) -> None:
    """Bring a ledger written by an older tokenline up to this schema (rows are never rewritten)."""
    columns = {row[1] for row in conn.execute("PRAGMA table_info(usage)")}
    if "response_id" not in columns:  # schema 1
        conn.execute("ALTER TABLE usage ADD COLUMN response_id TEXT")
    if "owner" not in columns:  # schema 2
        conn.execute("ALTER TABLE usage ADD COLUMN owner TEXT")
    if "content_filter" not in columns:  # schema 3
        conn.execute("ALTER TABLE usage ADD COLUMN content_filter TEXT")
    # Small (only rows in flight): finds a journaled row to update, and those to recover.
    conn.execute("CREATE INDEX IF NOT EXISTS usage_in_flight ON usage (response_id) WHERE status = 'in_flight'")
    if conn.execute("PRAGMA user_version").fetchone()[0] < SCHEMA_VERSION:
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")


class UsageLedger:
    """Append-only usage records in SQLite, written by one background thread.

    ``record()`` for coroutines (returns after commit), ``record_nowait()`` for sync code
    (fire-and-forget), ``close()`` drains the queue and stops the writer. Queries run on the
    caller's thread with their own connection.
    """

    def __init__(self, path: str | Path, prices: PriceTable | None = None) -> None:
        self.path = Path(path)
        self.prices = prices or PriceTable()
        self.owner = server_owner()
        self._journaled: set[str] = set()  # response ids with an in-flight row not yet completed
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Schema and WAL mode are set up here, on the caller's thread, so a bad path fails at once.
        conn = _connect(self.path)
        try:
            mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if mode.lower() != "wal":
                raise RuntimeError(f"{self.path}: could not switch SQLite to WAL mode (got {mode!r})")
            conn.executescript(_SCHEMA)
            _migrate(conn)
        finally:
            conn.close()

        self._queue: queue.SimpleQueue[_Write | object] = queue.SimpleQueue()
        self._lock = threading.Lock()  # makes "not closed, then enqueue" atomic against close()
        self._closed = False
        self._writer_error: BaseException | None = None
        self._thread = threading.Thread(target=self._write_loop, name="usage-ledger-writer", daemon=True)
        self._thread.start()
        # The writer is a daemon thread (it must not keep a server from exiting), so drain it at
        # interpreter exit if nobody called close(); the weak reference keeps the ledger collectable.
        ref = weakref.ref(self)

        def close_at_exit() -> None:
            ledger = ref()
            if ledger is not None:
                ledger.close()

        self._atexit = close_at_exit
        atexit.register(close_at_exit)

    # ------------------------------------------------------------------------------ writing

    async def record(self, rec: UsageRecord) -> None:
        """Price ``rec`` (sets ``rec.cost_usd``), write it, and return once it is committed.

        Cancelling the awaiting task does not cancel the write.
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()

        def done(error: BaseException | None) -> None:  # runs on the writer thread
            try:
                loop.call_soon_threadsafe(_settle, future, error)
            except RuntimeError:  # the loop is closed: nobody is waiting any more
                pass

        self._enqueue(self._final_op(rec), rec, done)
        await future

    def record_nowait(self, rec: UsageRecord) -> None:
        """Price ``rec`` and queue it for writing without waiting; a failed write is logged."""
        self._enqueue(self._final_op(rec), rec, None)

    def journal(self, rec: UsageRecord) -> None:
        """Write the in-flight row of a request just admitted (without waiting); ``progress``
        updates it and ``record`` / ``record_nowait`` of the same ``response_id`` completes it."""
        if rec.response_id is None or rec.status != "in_flight":
            raise ValueError("a journaled record needs a response_id and status 'in_flight'")
        self._enqueue("journal", rec, None)
        self._journaled.add(rec.response_id)

    def progress(self, rec: UsageRecord) -> None:
        """Update a journaled row with the tokens known so far (without waiting)."""
        if rec.response_id in self._journaled:
            self._enqueue("progress", rec, None)

    def _final_op(self, rec: UsageRecord) -> str:
        if rec.response_id is not None and rec.response_id in self._journaled:
            self._journaled.discard(rec.response_id)
            return "complete"
        return "insert"

    def _enqueue(self, op: str, rec: UsageRecord, done: _Done | None) -> None:
        rec.validate()
        rec.owner = self.owner
        rec.cost_usd = self.prices.cost(rec.model, rec.prompt_tokens, rec.cached_tokens, rec.completion_tokens)
        with self._lock:
            if self._closed:
                raise RuntimeError("the usage ledger is closed")
            if self._writer_error is not None:
                raise RuntimeError(f"the usage ledger writer failed: {self._writer_error!r}")
            # A copy: the caller may go on changing its record (progress) while this one waits.
            self._queue.put((op, dataclasses.replace(rec), done))

    def recover_interrupted(self) -> int:
        """Mark rows left in flight by a server that died as ``interrupted`` (their tokens as last
        journaled stay); returns how many. A server calls this once at start-up."""
        with self._reader() as conn:
            rows = conn.execute("SELECT id, owner FROM usage WHERE status = 'in_flight'").fetchall()
            stale = [(row_id,) for row_id, owner in rows if _owner_gone(owner, self.owner)]
            if stale:
                with _transaction(conn):
                    conn.executemany(
                        "UPDATE usage SET status = 'interrupted', finish_reason = ? WHERE id = ? "
                        "AND status = 'in_flight'",
                        [(ABORT_REASONS["interrupted"], row_id) for (row_id,) in stale],
                    )
        return len(stale)

    def close(self, timeout: float | None = 30.0) -> None:
        """Write everything queued, then stop the writer. Idempotent."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._queue.put(_STOP)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        atexit.unregister(self._atexit)

    def __enter__(self) -> UsageLedger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _write_loop(self) -> None:
        try:
            conn = _connect(self.path)
            # Per connection: with WAL, NORMAL skips the fsync per commit yet a committed
            # transaction survives a process crash (the WAL is in the OS's page cache).
            conn.execute("PRAGMA synchronous = NORMAL")
        except BaseException as e:  # noqa: BLE001 - every waiter must hear about it
            self._fail_queue(e)
            return
        batch: list[_Write] = []
        try:
            stopping = False
            while not stopping:
                batch = []
                item = self._queue.get()
                # Commit together whatever queued up while the last commit ran.
                while True:
                    if item is _STOP:
                        stopping = True
                        break
                    batch.append(item)  # type: ignore[arg-type]
                    if len(batch) >= _MAX_BATCH:
                        break
                    try:
                        item = self._queue.get_nowait()
                    except queue.Empty:
                        break
                if batch:
                    self._write_batch(conn, batch)
        except BaseException as e:  # noqa: BLE001 - an unexpected failure must not strand waiters
            for _, _, done in batch:
                if done is not None:
                    done(e)
            self._fail_queue(e)
        finally:
            conn.close()

    def _write_batch(self, conn: sqlite3.Connection, batch: list[_Write]) -> None:
        try:
            with _transaction(conn):
                for op, rec, _ in batch:
                    _apply(conn, op, rec)
            results: list[BaseException | None] = [None] * len(batch)
        except sqlite3.Error:
            # One bad row must not lose the others: retry each alone and report each outcome.
            results = []
            for op, rec, _ in batch:
                try:
                    with _transaction(conn):
                        _apply(conn, op, rec)
                    results.append(None)
                except sqlite3.Error as e:
                    results.append(e)
        for (_, rec, done), error in zip(batch, results):
            if error is not None:
                logger.error("usage record for request %s was not written: %s", rec.request_id, error)
            if done is not None:
                done(error)

    def _fail_queue(self, error: BaseException) -> None:
        with self._lock:
            self._writer_error = error
        logger.error("usage ledger writer stopped: %r", error)
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not _STOP and item[2] is not None:  # type: ignore[index]
                item[2](error)  # type: ignore[index]

    # ------------------------------------------------------------------------------ reading

    def summary(self, since: float | None = None, until: float | None = None,
                tenant: str | None = None) -> list[UsageSummaryRow]:
        """Totals per (tenant, model) over ``since <= created_at < until``, sorted by tenant, model."""
        where, params = _where(since, until, tenant)
        sql = (
            "SELECT tenant, model, COUNT(*), SUM(prompt_tokens), SUM(cached_tokens), "
            f"SUM(completion_tokens), SUM(cost_usd) FROM usage {where} "
            "GROUP BY tenant, model ORDER BY tenant, model"
        )
        with self._reader() as conn:
            return [UsageSummaryRow(*row) for row in conn.execute(sql, params)]

    def records(self, since: float | None = None, until: float | None = None, tenant: str | None = None,
                limit: int | None = 100, request_id: str | None = None) -> list[UsageRecord]:
        """Raw records, newest first, at most ``limit`` (``None``: all)."""
        where, params = _where(since, until, tenant, request_id)
        sql = f"SELECT {', '.join(_COLUMNS)} FROM usage {where} ORDER BY created_at DESC, id DESC"
        if limit is not None:
            sql += " LIMIT ?"
            params.append(int(limit))
        with self._reader() as conn:
            return [UsageRecord(*row) for row in conn.execute(sql, params)]

    def _reader(self) -> _ReaderConnection:
        return _ReaderConnection(self.path)


class _ReaderConnection:
    """A short-lived connection for one query (sqlite3's own context manager does not close)."""

    def __init__(self, path: Path) -> None:
        self._conn = _connect(path)

    def __enter__(self) -> sqlite3.Connection:
        return self._conn

    def __exit__(self, *exc: object) -> None:
        self._conn.close()


@contextmanager
def _transaction(conn: sqlite3.Connection) -> Iterator[None]:
    conn.execute("BEGIN IMMEDIATE")  # take the write lock now, not halfway through
    try:
        yield
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:  # also when COMMIT itself failed, so the next BEGIN works
            conn.execute("ROLLBACK")
        raise


def _settle(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():  # the waiter was cancelled; the row is written all the same
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _row(rec: UsageRecord) -> tuple[Any, ...]:
    return tuple(getattr(rec, name) for name in _COLUMNS)


def _apply(conn: sqlite3.Connection, op: str, rec: UsageRecord) -> None:
    if op in ("progress", "complete"):
        updated = conn.execute(_UPDATE, (*_row(rec), rec.response_id, rec.owner)).rowcount
        if updated or op == "progress":
            return  # a progress update of a row no longer in flight has nothing to do
    conn.execute(_INSERT, _row(rec))  # insert, journal, or a completion whose journal was lost


def _where(since: float | None, until: float | None, tenant: str | None,
           request_id: str | None = None) -> tuple[str, list[Any]]:
    clauses, params = [], []
    for clause, value in (("created_at >= ?", since), ("created_at < ?", until),
                          ("tenant = ?", tenant), ("request_id = ?", request_id)):
        if value is not None:
            clauses.append(clause)
            params.append(value)
    return ("WHERE " + " AND ".join(clauses)) if clauses else "", params


# ---------------------------------------------------------------------------------------- CLI


def parse_time(value: str) -> float:
    """Unix seconds, or an ISO 8601 date/time; one without a UTC offset is taken as UTC. A number
    that is no moment of a calendar (nan, inf, 1e30: beyond the years 1-9999) is a ValueError."""
    try:
        seconds = float(value)
    except ValueError:
        pass
    else:
        try:
            datetime.fromtimestamp(seconds, timezone.utc)  # also refuses nan and inf
        except (ValueError, OverflowError, OSError):
            raise ValueError(f"{shorten(value)!r} is not a date: unix seconds must fall within the years "
                             "1-9999") from None
        return seconds
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        raise ValueError(f"{shorten(value)!r} is neither unix seconds nor an ISO 8601 date/time") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return moment.timestamp()


def format_summary(rows: Iterable[UsageSummaryRow]) -> str:
    """A plain-text table with a total line."""
    rows = list(rows)
    header = ("tenant", "model", "requests", "prompt", "cached", "completion", "cost_usd")
    total = UsageSummaryRow("TOTAL", "", sum(r.requests for r in rows), sum(r.prompt_tokens for r in rows),
                            sum(r.cached_tokens for r in rows), sum(r.completion_tokens for r in rows),
                            sum(r.cost_usd for r in rows))

    def cells(r: UsageSummaryRow) -> tuple[str, ...]:
        return (r.tenant, r.model, str(r.requests), str(r.prompt_tokens), str(r.cached_tokens),
                str(r.completion_tokens), f"{r.cost_usd:.6f}")

    body = [cells(r) for r in rows]
    widths = [max(len(line[i]) for line in [header, *body, cells(total)]) for i in range(len(header))]

    def line(values: tuple[str, ...]) -> str:
        # Names left-aligned, numbers right-aligned.
        return "  ".join(v.ljust(w) if i < 2 else v.rjust(w) for i, (v, w) in enumerate(zip(values, widths))).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), rule, *(line(b) for b in body), rule, line(cells(total))])


def usage_command(db: str | Path | None, since: str | None = None, until: str | None = None,
                  tenant: str | None = None, as_json: bool = False, out: TextIO | None = None) -> int:
    """``tokenline usage``: print the summary as a table or JSON; returns the exit status."""
    out = out or sys.stdout
    path = Path(db) if db else default_ledger_path()
    if not path.is_file():
        print(f"tokenline usage: no ledger at {path}", file=sys.stderr)
        return 1
    try:
        start = parse_time(since) if since else None
        end = parse_time(until) if until else None
    except ValueError as e:
        print(f"tokenline usage: {e}", file=sys.stderr)
        return 2
    ledger = UsageLedger(path)
    try:
        rows = ledger.summary(start, end, tenant)
    finally:
        ledger.close()
    if as_json:
        json.dump({
            "db": str(path), "since": start, "until": end, "tenant": tenant,
            "rows": [asdict(r) for r in rows],
            "total": {
                "requests": sum(r.requests for r in rows),
                "prompt_tokens": sum(r.prompt_tokens for r in rows),
                "cached_tokens": sum(r.cached_tokens for r in rows),
                "completion_tokens": sum(r.completion_tokens for r in rows),
                "cost_usd": sum(r.cost_usd for r in rows),
            },
        }, out, indent=2)
        out.write("\n")
    else:
        print(format_summary(rows), file=out)
    return 0
