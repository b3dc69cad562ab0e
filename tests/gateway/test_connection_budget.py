"""The connection budgets as plain bookkeeping, on a hand-driven clock (real servers exercise them in
tests/e2e/test_connection_budget.py and tests/reliability/test_connection_flood.py)."""

from __future__ import annotations

import pytest

from tokenline.gateway.connection_budget import Admission, ConnectionBudget, ConnectionLimits, Phase, address_key


class Conn:
    def __init__(self, name: str) -> None:
        self.name = name
        self.evicted = False

    def evict(self) -> None:
        self.evicted = True

    def __repr__(self) -> str:
        return self.name


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def budget(clock: Clock, evictions: list[str] | None = None, **limits: int | None) -> ConnectionBudget:
    sink = evictions if evictions is not None else []
    return ConnectionBudget(ConnectionLimits(**limits), on_evict=sink.append, clock=clock)


def test_pending_connections_do_not_count_toward_the_admitted_pool() -> None:
    clock = Clock()
    connections = budget(clock, max_admitted=2, max_pending=None, max_pending_per_address=None)
    strangers = [Conn(f"s{i}") for i in range(50)]
    for conn in strangers:
        connections.opened(conn, "203.0.113.9")
    tenant = Conn("tenant")
    connections.opened(tenant, "198.51.100.1")
    assert connections.admit(tenant, Phase.WORKING) is Admission.ADMITTED
    assert (connections.pending, connections.admitted) == (50, 1)
    assert connections.has_room() and not any(c.evicted for c in strangers)


def test_over_the_address_budget_its_oldest_connections_past_their_grace_go() -> None:
    clock, evictions = Clock(), []
    connections = budget(clock, evictions, max_pending=None, max_pending_per_address=3)
    old = [Conn(f"old{i}") for i in range(5)]
    for conn in old:
        connections.opened(conn, "203.0.113.9")  # a burst: all within the grace, none closed
    assert not any(c.evicted for c in old) and connections.pending == 5
    clock.now += 1.5
    other = Conn("other-address")
    connections.opened(other, "198.51.100.1")  # any arrival (or the timer) enforces: the 2 oldest go
    assert [c.evicted for c in old] == [True, True, False, False, False] and not other.evicted
    newcomer = Conn("new")
    connections.opened(newcomer, "203.0.113.9")  # 4 from this address: the oldest left goes, not the new
    assert [c.evicted for c in old] == [True, True, True, False, False] and not newcomer.evicted
    assert evictions == ["pending_evicted"] * 3 and connections.pending == 4


def test_over_the_pending_budget_the_oldest_past_their_grace_go_whatever_their_address() -> None:
    clock = Clock()
    connections = budget(clock, max_pending=3, max_pending_per_address=None)
    first, second = Conn("first"), Conn("second")
    connections.opened(first, "203.0.113.9")
    connections.opened(second, "198.51.100.1")
    clock.now += 0.5
    third, fourth = Conn("third"), Conn("fourth")
    connections.opened(third, "192.0.2.1")
    connections.opened(fourth, "192.0.2.2")  # 4 > 3, but the oldest is within its grace
    assert not first.evicted
    clock.now += 0.6
    connections.opened(Conn("fifth"), "192.0.2.3")  # first and second are past it: both go (5 → 3)
    assert first.evicted and second.evicted and not third.evicted and connections.pending == 3


def test_enforce_closes_what_reached_its_grace_and_says_when_to_look_again() -> None:
    clock = Clock()
    connections = budget(clock, max_pending=None, max_pending_per_address=2)
    conns = [Conn(f"c{i}") for i in range(4)]
    assert connections.opened(conns[0], "203.0.113.9") is None  # within budget: no timer needed
    clock.now += 0.1
    assert connections.opened(conns[1], "203.0.113.9") is None
    clock.now += 0.15
    assert connections.opened(conns[2], "203.0.113.9") == pytest.approx(0.75)  # when c0 reaches its grace
    clock.now += 0.5
    assert connections.opened(conns[3], "203.0.113.9") == pytest.approx(0.25)
    clock.now += 0.25
    assert connections.enforce() == pytest.approx(0.1) and conns[0].evicted and not conns[1].evicted
    clock.now += 0.1
    assert connections.enforce() is None and conns[1].evicted  # two left: within budget
    assert not conns[2].evicted and not conns[3].evicted and connections.pending == 2


def test_a_pending_connection_with_a_request_under_way_is_not_closed() -> None:
    clock = Clock()
    connections = budget(clock, max_pending=1, max_pending_per_address=None)
    deciding = Conn("deciding")  # its head is complete; the door is checking its key
    connections.opened(deciding, "203.0.113.9")
    connections.update(deciding, Phase.WORKING)
    clock.now += 5
    waiting = Conn("waiting")
    connections.opened(waiting, "203.0.113.9")
    clock.now += 5
    connections.opened(Conn("third"), "203.0.113.9")
    assert not deciding.evicted and waiting.evicted
    connections.update(deciding, Phase.AWAITING_HEAD)  # answered (a 401), kept alive: a candidate again
    clock.now += 5
    connections.opened(Conn("fourth"), "203.0.113.9")
    assert deciding.evicted


def test_a_full_admitted_pool_makes_way_for_the_longest_idle_or_uploading_connection() -> None:
    clock, evictions = Clock(), []
    connections = budget(clock, evictions, max_admitted=3)
    idle, uploading, working = Conn("idle"), Conn("uploading"), Conn("working")
    for conn, phase in ((uploading, Phase.UPLOADING), (idle, Phase.WORKING), (working, Phase.WORKING)):
        connections.opened(conn, "203.0.113.9")
        assert connections.admit(conn, phase) is Admission.ADMITTED
        clock.now += 1
    connections.update(idle, Phase.AWAITING_HEAD)  # its response is complete; kept alive
    newcomer = Conn("new")
    connections.opened(newcomer, "203.0.113.9")
    assert connections.admit(newcomer, Phase.WORKING) is Admission.ADMITTED
    assert uploading.evicted and not idle.evicted and not working.evicted  # the upload began first
    assert connections.admit(newcomer, Phase.WORKING) is Admission.ADMITTED  # already admitted: no change
    another = Conn("another")
    connections.opened(another, "203.0.113.9")
    assert connections.admit(another, Phase.WORKING) is Admission.ADMITTED and idle.evicted
    assert evictions == ["admitted_evicted", "admitted_evicted"]
    # Now every admitted connection has a request at work: the next is refused and stays pending.
    assert not connections.has_room()
    refused = Conn("refused")
    connections.opened(refused, "203.0.113.9")
    assert connections.admit(refused, Phase.WORKING) is Admission.REFUSED
    assert (connections.pending, connections.admitted) == (1, 3) and not working.evicted
    connections.closed(working)
    assert connections.has_room() and connections.admit(refused, Phase.WORKING) is Admission.ADMITTED


def test_with_the_pool_full_a_request_whose_body_is_still_arriving_waits_for_it() -> None:
    """Else one slow body more than the pool would close another upload, whose client reconnects
    and closes the next, as fast as they can go."""
    clock = Clock()
    connections = budget(clock, max_admitted=1)
    uploading, newcomer = Conn("uploading"), Conn("newcomer")
    connections.opened(uploading, "203.0.113.9")
    assert connections.admit(uploading, Phase.UPLOADING) is Admission.ADMITTED
    connections.opened(newcomer, "203.0.113.9")
    assert connections.admit(newcomer, Phase.UPLOADING) is Admission.AFTER_BODY
    assert not uploading.evicted and connections.pending == 1
    connections.update(newcomer, Phase.WORKING)  # its body is in
    assert connections.admit(newcomer, Phase.WORKING) is Admission.ADMITTED and uploading.evicted


def test_closing_forgets_a_connection_in_any_pool() -> None:
    clock = Clock()
    connections = budget(clock, max_admitted=1, max_pending=1, max_pending_per_address=1)
    pending, admitted = Conn("pending"), Conn("admitted")
    connections.opened(pending, "203.0.113.9")
    connections.opened(admitted, "198.51.100.1")
    connections.admit(admitted, Phase.WORKING)
    connections.closed(pending)
    connections.closed(admitted)
    connections.closed(admitted)  # twice (evicted, then its connection_lost): harmless
    assert (connections.pending, connections.admitted) == (0, 0)
    assert connections.admit(Conn("unknown"), Phase.WORKING) is Admission.ADMITTED  # closed meanwhile


def test_ipv6_addresses_share_a_budget_per_64() -> None:
    assert address_key("2001:db8:1:2:aaaa::1") == address_key("2001:db8:1:2:bbbb::9") == "2001:db8:1:2::/64"
    assert address_key("2001:db8:1:3::1") != address_key("2001:db8:1:2::1")
    assert address_key("203.0.113.9") == "203.0.113.9" and address_key(None) is None


def test_limits_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_pending"):
        ConnectionLimits(max_pending=0)
