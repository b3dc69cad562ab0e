"""Who may hold a connection: a small budget for connections that have not yet proved anything,
so that they can never take the connections that tenants' requests need.

A connection is *pending* from the moment it is accepted until the door lets one of its requests
in (a valid key; with no keys configured, any request but a probe): then it is *admitted*, for
the rest of its life. Only admitted connections count toward ``max_admitted``
(``--max-connections``), so no number of strangers sending slow request heads can make a tenant's
request meet a 503; pending connections have their own budget, ``max_pending``, and
``max_pending_per_address`` from one source address (an IPv6 /64 counting as one).

Over a pending budget, the pending connections that have waited longest for a complete head are
closed first, but only those that have had ``pending_grace_s`` to send it (a client sends its head
within one round trip of connecting, so a burst of honest connections from one address is never
cut); in effect the head timeout shrinks to the grace for the oldest while the pool is over budget.
A pending connection whose request is under way (the door is deciding, a probe is answered) is not
closed. Budgets are enforced as connections arrive and again when the oldest reach their grace
(``enforce`` says when: the caller sets a timer).

With every admitted connection taken, a request the door lets in still gets one once its body is
in: the admitted connection that has gone longest without a request at work (idle between requests,
or still receiving a request's body) is closed to make way. Only when every admitted connection has
a request at work is the newcomer refused (the door's 503). So a tenant's slow bodies take nothing
from another tenant either: they are the first to go. (A newcomer whose own body is still arriving
waits for it, pending, rather than closing another upload for a place to upload in.)

Plain bookkeeping, no I/O: a connection is anything with ``evict()``; the caller (the HTTP protocol,
``api/http_protocol.py``) reports each connection's phase as it changes.
"""

from __future__ import annotations

import enum
import ipaddress
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

PENDING_GRACE_S = 1.0  # how long a new connection may take to send its head before a budget may close it


class Phase(enum.Enum):
    """Where a connection is in its current request."""

    AWAITING_HEAD = "awaiting_head"  # no request yet, between requests, or a head still arriving
    UPLOADING = "uploading"  # the head is complete, the body is still arriving
    WORKING = "working"  # the request is received and its response not yet complete


class Admission(enum.Enum):
    """The budget's answer to the door for a request it lets in."""

    ADMITTED = "admitted"
    REFUSED = "refused"  # every admitted connection has a request at work: a 503 (it stays pending)
    AFTER_BODY = "after_body"  # the pool is full and the body still arriving: ask again once it is in


class Connection(Protocol):
    def evict(self) -> None:
        """Close the connection (the budget has already let go of it)."""


@dataclass(frozen=True)
class ConnectionLimits:
    max_admitted: int | None = 1024  # --max-connections
    max_pending: int | None = 256  # --max-pending-connections
    max_pending_per_address: int | None = 32  # --max-pending-per-address
    pending_grace_s: float = PENDING_GRACE_S

    def __post_init__(self) -> None:
        for name in ("max_admitted", "max_pending", "max_pending_per_address"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1 (or None for no limit), got {value}")


@dataclass
class _Entry:
    address: str | None
    phase: Phase
    since: float  # when the current phase began
    admitted: bool = False


def address_key(host: str | None) -> str | None:
    """The source a per-address budget counts: the IPv4 address, or the IPv6 /64 (one host's usual
    share: counting single IPv6 addresses would give an attacker billions of budgets)."""
    if not host or ":" not in host:
        return host or None
    try:
        return str(ipaddress.ip_network(f"{host}/64", strict=False))
    except ValueError:
        return host


class ConnectionBudget:
    """The open connections of one server, pending or admitted, and the budgets over them."""

    def __init__(
        self,
        limits: ConnectionLimits = ConnectionLimits(),
        on_evict: Callable[[str], None] = lambda reason: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limits = limits
        self._on_evict = on_evict  # reason: "pending_evicted" or "admitted_evicted" (a metrics label)
        self._clock = clock
        self._entries: dict[Connection, _Entry] = {}
        self._pending = 0
        self._pending_by_address: dict[str | None, int] = {}
        self._crowded: set[str] = set()  # addresses over their pending budget
        self._admitted = 0
        # Eviction candidates, oldest phase first (dicts keep insertion order): pending connections
        # awaiting a head, overall and per address, and admitted connections with no request at work.
        self._waiting: dict[Connection, None] = {}
        self._waiting_by_address: dict[str | None, dict[Connection, None]] = {}
        self._idle: dict[Connection, None] = {}

    @property
    def pending(self) -> int:
        return self._pending

    @property
    def admitted(self) -> int:
        return self._admitted

    def has_room(self) -> bool:
        """Whether a request the door lets in now would get a connection (free, or made free)."""
        cap = self.limits.max_admitted
        return cap is None or self._admitted < cap or bool(self._idle)

    def opened(self, conn: Connection, host: str | None) -> float | None:
        """A new connection: pending, awaiting its first head. Older pending connections may go;
        returns what ``enforce`` returns."""
        address = address_key(host)
        self._entries[conn] = _Entry(address, Phase.AWAITING_HEAD, self._clock())
        self._pending += 1
        count = self._pending_by_address[address] = self._pending_by_address.get(address, 0) + 1
        per_address = self.limits.max_pending_per_address
        if per_address is not None and address is not None and count > per_address:
            self._crowded.add(address)
        self._add_candidate(conn, self._entries[conn])
        return self.enforce()

    def enforce(self) -> float | None:
        """Close the pending connections over a budget that have had their grace, oldest first.
        Returns the seconds until a budget may close more (the oldest left over it reach their
        grace), or None while all are within their budgets."""
        now = self._clock()
        old_enough = now - self.limits.pending_grace_s
        due: list[float] = []
        per_address = self.limits.max_pending_per_address
        for address in list(self._crowded):
            def crowded(address: str | None = address) -> bool:
                return self._pending_by_address.get(address, 0) > per_address  # type: ignore[operator]
            due.append(self._evict_waiting(self._waiting_by_address.get(address, {}), crowded, old_enough))
        max_pending = self.limits.max_pending
        if max_pending is not None:
            due.append(self._evict_waiting(self._waiting, lambda: self._pending > max_pending, old_enough))
        waits = [when + self.limits.pending_grace_s - now for when in due if when is not None]
        return max(0.0, min(waits)) if waits else None

    def admit(self, conn: Connection, phase: Phase) -> Admission:
        """The door lets a request on ``conn`` (in ``phase``) in. An unknown connection (closed
        meanwhile) is let through: there is nothing to count."""
        entry = self._entries.get(conn)
        if entry is None or entry.admitted:
            return Admission.ADMITTED
        cap = self.limits.max_admitted
        if cap is not None and self._admitted >= cap:
            if phase is Phase.UPLOADING:
                # Only a request ready to work makes way: else a flood of slow bodies one larger
                # than the pool would close each other's connections as fast as they can reconnect.
                return Admission.AFTER_BODY
            if not self._idle:
                return Admission.REFUSED
            oldest = next(iter(self._idle))
            self._forget(oldest)
            self._on_evict("admitted_evicted")
            oldest.evict()
        self._remove_candidate(conn, entry)
        self._pending -= 1
        self._drop_address(entry.address)
        entry.admitted = True
        self._admitted += 1
        entry.phase, entry.since = phase, self._clock()
        self._add_candidate(conn, entry)
        return Admission.ADMITTED

    def update(self, conn: Connection, phase: Phase) -> None:
        """``conn`` moved to ``phase`` (a request's head or body completed, or its response did)."""
        entry = self._entries.get(conn)
        if entry is None or entry.phase is phase:
            return
        self._remove_candidate(conn, entry)
        entry.phase, entry.since = phase, self._clock()
        self._add_candidate(conn, entry)

    def closed(self, conn: Connection) -> None:
        if conn in self._entries:
            self._forget(conn)

    # --- bookkeeping ---------------------------------------------------------------------------

    def _evict_waiting(self, candidates: dict[Connection, None], over: Callable[[], bool],
                       old_enough: float) -> float | None:
        """Close the oldest pending connections awaiting a head while the budget is exceeded, as
        long as each has had its grace; the phase start of the oldest left if still over."""
        while over() and candidates:
            oldest = next(iter(candidates))
            since = self._entries[oldest].since
            if since > old_enough:
                return since  # the rest are younger still
            self._forget(oldest)
            self._on_evict("pending_evicted")
            oldest.evict()
        return None

    def _forget(self, conn: Connection) -> None:
        entry = self._entries.pop(conn)
        self._remove_candidate(conn, entry)
        if entry.admitted:
            self._admitted -= 1
        else:
            self._pending -= 1
            self._drop_address(entry.address)

    def _drop_address(self, address: str | None) -> None:
        left = self._pending_by_address[address] - 1
        if left:
            self._pending_by_address[address] = left
        else:
            del self._pending_by_address[address]
        per_address = self.limits.max_pending_per_address
        if address in self._crowded and (per_address is None or left <= per_address):
            self._crowded.discard(address)

    def _add_candidate(self, conn: Connection, entry: _Entry) -> None:
        if entry.admitted:
            if entry.phase is not Phase.WORKING:
                self._idle[conn] = None
        elif entry.phase is Phase.AWAITING_HEAD:
            self._waiting[conn] = None
            self._waiting_by_address.setdefault(entry.address, {})[conn] = None

    def _remove_candidate(self, conn: Connection, entry: _Entry) -> None:
        self._idle.pop(conn, None)
        if self._waiting.pop(conn, 0) is None:
            by_address = self._waiting_by_address[entry.address]
            del by_address[conn]
            if not by_address:
                del self._waiting_by_address[entry.address]
