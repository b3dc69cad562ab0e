"""The live event stream behind ``GET /v1/events`` and the ``/dashboard`` page.

Three sources feed it: every engine step's ``StepRecord`` (from the engine client's step
listener), a periodic load snapshot (``stats``), and each request's lifecycle as the gateway
records it (arrived → queued → first token → finished). Subscribers each hold a bounded queue: a
reader that falls behind loses the newest events, counted, and is told how many with a
``dropped`` event once it catches up — a stalled page never pins the server's memory.

Times are ``time.monotonic()`` seconds (the engine stamps with the same clock); the ``hello``
event gives the server's monotonic and wall time at connection so a reader can map between them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tokenline.engine.messages import EngineStats, StepOutputs, StepRecord
from tokenline.gateway.trace import RequestTrace

EVENT_TYPES = ("hello", "step", "stats", "request", "dropped")
REQUEST_STAGES = ("arrived", "queued", "first_token", "finished")
DEFAULT_CAPACITY = 2048  # events per subscriber: minutes of steps for a page that reads at all


@dataclass
class LiveEvent:
    """One event; ``tenant`` set for a request's events (only its tenant and admins see them)."""

    type: str
    data: dict[str, Any]
    tenant: str | None = None
    private: bool = False  # a request event: scoped to ``tenant``

    def encode(self) -> bytes:
        """The event as one server-sent-events frame."""
        return f"event: {self.type}\ndata: {json.dumps(self.data, separators=(',', ':'))}\n\n".encode()


class Subscriber:
    """One reader's bounded queue. ``see_all``: an admin (or a server without keys)."""

    def __init__(self, tenant: str | None, see_all: bool, capacity: int) -> None:
        self.tenant = tenant
        self.see_all = see_all
        self.capacity = capacity
        self.dropped = 0  # events lost since the reader last caught up
        self.dropped_total = 0
        self._queue: deque[LiveEvent] = deque()
        self._wake = asyncio.Event()

    def wake(self) -> None:
        self._wake.set()

    def offer(self, event: LiveEvent) -> None:
        if event.private and not self.see_all and event.tenant != self.tenant:
            return
        if len(self._queue) >= self.capacity:
            self.dropped += 1
            self.dropped_total += 1
            return
        self._queue.append(event)
        self._wake.set()

    async def take(self, timeout: float) -> list[LiveEvent]:
        """What is queued (waiting up to ``timeout`` s for something); a ``dropped`` event first
        when events were lost since the last take."""
        if not self._queue:
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except TimeoutError:
                pass
        events = list(self._queue)
        self._queue.clear()
        if self.dropped:
            events.insert(0, LiveEvent("dropped", {
                "t": time.monotonic(), "dropped": self.dropped, "dropped_total": self.dropped_total,
                "capacity": self.capacity,
            }))
            self.dropped = 0
        return events


class LiveEvents:
    """The fan-out hub: publishers call ``publish`` (on the event loop); nothing is built when
    no one is subscribed, so an unwatched server pays one attribute check per step."""

    def __init__(self, stats: Callable[[], EngineStats | None], kv_blocks: Callable[[], int] = lambda: 0,
                 capacity: int = DEFAULT_CAPACITY) -> None:
        self._stats = stats
        self._kv_blocks = kv_blocks  # the pool's size before the first step's stats report it
        self.capacity = capacity
        self._subscribers: set[Subscriber] = set()
        self._last_record: StepRecord | None = None
        self.closed = False  # the server is shutting down: streams end so they do not hold it up

    @property
    def active(self) -> bool:
        return bool(self._subscribers)

    def subscribe(self, tenant: str | None, see_all: bool) -> Subscriber:
        subscriber = Subscriber(tenant, see_all, self.capacity)
        self._subscribers.add(subscriber)
        return subscriber

    def unsubscribe(self, subscriber: Subscriber) -> None:
        self._subscribers.discard(subscriber)

    def close(self) -> None:
        """End every stream (each returns from its wait at once) and accept no more events."""
        self.closed = True
        for subscriber in self._subscribers:
            subscriber.wake()

    def publish(self, event: LiveEvent) -> None:
        for subscriber in self._subscribers:
            subscriber.offer(event)

    # --- sources ---------------------------------------------------------------------------------

    def on_step(self, step: StepOutputs) -> None:
        """The engine client's step listener: one ``step`` event per record."""
        if step.step_records:
            self._last_record = step.step_records[-1]
        if not self._subscribers:
            return
        for record in step.step_records:
            self.publish(LiveEvent("step", step_event(record)))

    def request(self, trace: RequestTrace, stage: str, at: float, **extra: Any) -> None:
        """A request reached ``stage`` (one of ``REQUEST_STAGES``) at monotonic time ``at``."""
        if not self._subscribers:
            return
        data: dict[str, Any] = {
            "t": at, "stage": stage, "request_id": trace.request_id, "tenant": trace.tenant,
            "model": trace.model, "arrived": trace.stamps.get("arrived"),
        }
        data.update(extra)
        if stage == "finished":  # the whole waterfall, as the trace has it (built only when watched)
            data["stages_s"] = trace.to_dict()["stages_s"]
        self.publish(LiveEvent("request", data, tenant=trace.tenant, private=True))

    def stats_event(self) -> LiveEvent:
        """The engine's load now: running and waiting requests, KV blocks, state slots."""
        stats = self._stats() or EngineStats()
        record = self._last_record
        total = stats.num_kv_blocks or self._kv_blocks()
        used = stats.num_kv_blocks - stats.num_free_kv_blocks if stats.num_kv_blocks else 0
        return LiveEvent("stats", {
            "t": time.monotonic(),
            "num_running": stats.num_running,
            "num_waiting": stats.num_waiting,
            "num_kv_blocks_used": used,
            "num_kv_blocks": total,
            "kv_cache_usage": stats.kv_cache_usage,
            "num_state_slots_used": record.num_state_slots_used if record else 0,
            "num_state_slots": record.num_state_slots if record else 0,
            "num_preemptions": stats.num_preemptions,
            "num_steps": stats.num_steps,
            "subscribers": len(self._subscribers),
        })


def step_event(record: StepRecord) -> dict[str, Any]:
    data = dataclasses.asdict(record)
    data["t"] = record.start + record.duration  # when the step ended (its loads are after it)
    return data


def hello_event(tenant: str | None, see_all: bool, capacity: int, model: str) -> LiveEvent:
    return LiveEvent("hello", {
        "now": time.monotonic(), "wall": time.time(), "tenant": tenant,
        "scope": "all" if see_all else "own", "model": model, "capacity": capacity,
        "event_types": list(EVENT_TYPES),
    })
