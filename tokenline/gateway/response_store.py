"""Stored Responses API responses (``store: true``), in the usage ledger's SQLite database.

A stored response keeps the response object as returned and the conversation that led to it (its
input items after those of its ``previous_response_id`` chain and their outputs), so a follow-up
continues from one row without walking the chain. Rows belong to a tenant: another tenant's id is
reported as absent. Each call opens its own short connection (the ledger's writer thread keeps
its own); callers run them off the event loop (``asyncio.to_thread``).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenline.gateway.ledger import _ReaderConnection as _Connection

__all__ = ["ResponseStore", "StoredResponse"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id                   TEXT PRIMARY KEY,
    tenant               TEXT NOT NULL,
    created_at           REAL NOT NULL,
    previous_response_id TEXT,
    conversation_json    TEXT NOT NULL,
    response_json        TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_tenant_created_at ON responses (tenant, created_at);
"""


@dataclass
class StoredResponse:
    id: str
    tenant: str
    response: dict[str, Any]  # the response object as the client got it
    conversation: list[dict[str, Any]]  # input items up to and including this response's input
    previous_response_id: str | None = None
    created_at: float = field(default_factory=time.time)

    def continued(self) -> list[dict[str, Any]]:
        """The items a follow-up starts from: the conversation, then this response's output."""
        return [*self.conversation, *self.response.get("output", [])]


class ResponseStore:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with _Connection(self.path) as conn:
            conn.executescript(_SCHEMA)

    def put(self, stored: StoredResponse) -> None:
        row = (
            stored.id, stored.tenant, stored.created_at, stored.previous_response_id,
            json.dumps(stored.conversation, ensure_ascii=False), json.dumps(stored.response, ensure_ascii=False),
        )
        with _Connection(self.path) as conn:
            conn.execute("BEGIN IMMEDIATE")
            try:
                conn.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?, ?)", row)
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise

    def get(self, response_id: str, tenant: str) -> StoredResponse | None:
        """The tenant's stored response, or None (also when it is another tenant's)."""
        with _Connection(self.path) as conn:
            row = conn.execute(
                "SELECT id, tenant, created_at, previous_response_id, conversation_json, response_json "
                "FROM responses WHERE id = ? AND tenant = ?",
                (response_id, tenant),
            ).fetchone()
        if row is None:
            return None
        return StoredResponse(
            id=row[0], tenant=row[1], created_at=row[2], previous_response_id=row[3],
            conversation=json.loads(row[4]), response=json.loads(row[5]),
        )

    def delete(self, response_id: str, tenant: str) -> bool:
        """Remove the tenant's stored response; False when there was none."""
        with _Connection(self.path) as conn:
            cursor = conn.execute("DELETE FROM responses WHERE id = ? AND tenant = ?", (response_id, tenant))
            return cursor.rowcount > 0

