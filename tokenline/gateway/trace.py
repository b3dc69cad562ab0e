"""Per-request stage traces: where the time of one request went, stage by stage.

Timestamps are ``time.monotonic()`` seconds (the engine process stamps with the same clock); a
trace reports them relative to arrival, plus the wall-clock arrival time. Recent traces stay in a
store bounded per tenant so ``GET /v1/requests/{id}/trace`` can show them after the response is gone.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

STAGES = (
    "arrived",
    "authenticated",
    "rendered",
    "tokenized",
    "queued",
    "first_scheduled",
    "first_token",
    "last_token",
    "finished",
)


@dataclass
class RequestTrace:
    request_id: str  # the caller's X-Request-Id, or one assigned at the door
    tenant: str | None = None
    model: str | None = None
    wall_arrival: float = field(default_factory=time.time)
    stamps: dict[str, float] = field(default_factory=dict)
    num_steps: int = 0  # engine steps that computed tokens of this request (max over its sequences)
    num_shared_steps: int = 0  # of those, steps shared with other requests
    status: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    response_id: str | None = None  # the id in the response body (chatcmpl-…, cmpl-…)
    engine_request_ids: list[str] = field(default_factory=list)  # one per choice, as the engine knows them
    # Safety-filter verdicts: {"stage", "filter", "verdict", "reason", "at_s"}, in the order made.
    content_filter: list[dict[str, Any]] = field(default_factory=list)

    def mark(self, stage: str, at: float | None = None) -> None:
        """Record a stage once (the first time it happens)."""
        if stage not in self.stamps:
            self.stamps[stage] = time.monotonic() if at is None else at

    def filter_decision(self, stage: str, filter_name: str, verdict: str, reason: str | None) -> None:
        at = round(time.monotonic() - self.stamps.get("arrived", time.monotonic()), 6)
        self.content_filter.append(
            {"stage": stage, "filter": filter_name, "verdict": verdict, "reason": reason, "at_s": at}
        )

    def since_arrival(self, stage: str) -> float | None:
        at = self.stamps.get(stage)
        return None if at is None else at - self.stamps["arrived"]

    def to_dict(self) -> dict[str, Any]:
        origin = self.stamps.get("arrived", 0.0)
        stages = {s: round(self.stamps[s] - origin, 6) for s in STAGES if s in self.stamps}
        return {
            "request_id": self.request_id,
            "response_id": self.response_id,
            "engine_request_ids": self.engine_request_ids,
            "tenant": self.tenant,
            "model": self.model,
            "arrived_at": self.wall_arrival,
            "stages_s": stages,  # seconds since arrival
            "num_steps": self.num_steps,
            "num_shared_steps": self.num_shared_steps,
            "status": self.status,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "content_filter": self.content_filter,
        }


class TraceStore:
    """Recent traces, kept per tenant and keyed by request id: ids are the caller's, so one tenant
    reusing another's id must not replace (or reveal) the other's trace, and no tenant's traffic
    may push another's traces out.

    Each tenant keeps its ``per_tenant`` most recent admitted requests. A request is held apart
    from ``add`` (it arrived) until ``admit`` (it was admitted: rate limits charged), in a ring a
    tenth that size, so refused requests (a 4xx before admission: an unknown model, a bad body,
    a rate limit) only ever push out the same tenant's older refusals.
    """

    def __init__(self, per_tenant: int = 10_000) -> None:
        if per_tenant < 1:
            raise ValueError(f"traces per tenant must be at least 1, got {per_tenant}")
        self.per_tenant = per_tenant
        self.refused_per_tenant = max(1, per_tenant // 10)
        self._admitted: dict[str | None, OrderedDict[str, tuple[int, RequestTrace]]] = {}
        self._pending: dict[str | None, OrderedDict[str, tuple[int, RequestTrace]]] = {}
        self._added = 0  # order of arrival across rings: the newest of two traces with one id wins

    def add(self, trace: RequestTrace) -> None:
        """A request arrived: shown from now on, held apart until admitted."""
        self._added += 1
        _put(self._pending, trace, self._added, self.refused_per_tenant)

    def admit(self, trace: RequestTrace) -> None:
        """The request was admitted: it joins its tenant's traces (a trace not held apart is left alone)."""
        ring = self._pending.get(trace.tenant)
        entry = ring.get(trace.request_id) if ring is not None else None
        if ring is None or entry is None or entry[1] is not trace:
            return
        del ring[trace.request_id]
        _put(self._admitted, trace, entry[0], self.per_tenant)

    def get(self, tenant: str | None, request_id: str) -> RequestTrace | None:
        found = [ring[request_id] for rings in (self._admitted, self._pending)
                 if (ring := rings.get(tenant)) is not None and request_id in ring]
        return max(found, key=lambda entry: entry[0])[1] if found else None

    def newest_with_id(self, request_id: str) -> RequestTrace | None:
        """Any tenant's latest trace with this id (for an admin)."""
        found = [ring[request_id] for rings in (self._admitted, self._pending) for ring in rings.values()
                 if request_id in ring]
        return max(found, key=lambda entry: entry[0])[1] if found else None


def _put(rings: dict[str | None, OrderedDict[str, tuple[int, RequestTrace]]], trace: RequestTrace, order: int,
         bound: int) -> None:
    ring = rings.setdefault(trace.tenant, OrderedDict())
    ring[trace.request_id] = (order, trace)
    ring.move_to_end(trace.request_id)
    while len(ring) > bound:
        ring.popitem(last=False)
