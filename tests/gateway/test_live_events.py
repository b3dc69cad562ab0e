"""The live event hub as plain objects: bounded per-subscriber queues that drop and say so, tenant
scoping of request events, and which page paths the door leaves open. A real server's stream and
page are tested in tests/e2e/test_dashboard.py."""

from __future__ import annotations

import asyncio

from tokenline.engine.messages import EngineStats, StepOutputs, StepRecord
from tokenline.gateway.door_policy import Access, DoorPolicy
from tokenline.gateway.live_events import LiveEvents
from tokenline.gateway.trace import RequestTrace


def record(step: int) -> StepRecord:
    return StepRecord(step, start=10.0 + step, duration=0.02, num_prefill_tokens=0, num_decode_tokens=2,
                      num_seqs=2, num_running=2, num_waiting=0, num_kv_blocks_used=4, num_kv_blocks=64)


def test_a_slow_subscriber_keeps_at_most_its_capacity_and_is_told_what_it_lost() -> None:
    async def run() -> None:
        hub = LiveEvents(lambda: EngineStats(num_kv_blocks=64, num_free_kv_blocks=60), capacity=3)
        slow = hub.subscribe(None, see_all=True)
        hub.on_step(StepOutputs([], EngineStats(), step_records=[record(i) for i in range(5)]))
        first = await slow.take(timeout=0.1)
        assert [e.type for e in first] == ["dropped", "step", "step", "step"]
        assert first[0].data["dropped"] == 2 and first[0].data["capacity"] == 3
        assert [e.data["step"] for e in first[1:]] == [0, 1, 2]  # the newest were dropped, in order kept
        hub.on_step(StepOutputs([], EngineStats(), step_records=[record(5)]))
        again = await slow.take(timeout=0.1)
        assert [e.type for e in again] == ["step"]  # caught up: no more dropped events
        assert slow.dropped_total == 2
        assert await slow.take(timeout=0.05) == []  # nothing new: an empty batch after the timeout
        stats = hub.stats_event().data
        assert stats["num_kv_blocks_used"] == 4 and stats["num_kv_blocks"] == 64
        hub.unsubscribe(slow)
        assert not hub.active

    asyncio.run(run())


def test_request_events_reach_their_tenant_and_admins_only() -> None:
    async def run() -> None:
        hub = LiveEvents(lambda: None)
        admin, alice, bob = hub.subscribe("admin", True), hub.subscribe("alice", False), hub.subscribe("bob", False)
        trace = RequestTrace("r-1", tenant="alice")
        trace.mark("arrived", 5.0)
        hub.request(trace, "arrived", 5.0)
        hub.on_step(StepOutputs([], EngineStats(), step_records=[record(0)]))
        assert [e.type for e in await admin.take(0.1)] == ["request", "step"]
        assert [e.type for e in await alice.take(0.1)] == ["request", "step"]
        assert [e.type for e in await bob.take(0.1)] == ["step"]  # load, not alice's request

    asyncio.run(run())


def test_the_page_and_its_files_are_open_and_everything_else_under_it_keyed() -> None:
    policy = DoorPolicy(keys_configured=True, metrics_auth="admin")
    assert policy.access("/dashboard", 8000) is Access.OPEN
    assert policy.access("/dashboard/static/dashboard.js", 8000) is Access.OPEN
    assert policy.access("/v1/events", 8000) is Access.KEY
    assert policy.access("/dashboard/events", 8000) is Access.KEY
