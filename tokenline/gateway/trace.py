"""Per-request stage traces: where the time of one request went, stage by stage.

Timestamps are ``time.monotonic()`` seconds (the engine process stamps with the same clock); a
trace reports them relative to arrival, plus the wall-clock arrival time. Recent traces stay in a
bounded store so ``GET /v1/requests/{id}/trace`` can show them after the response is gone.
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
    """The most recent traces, oldest evicted first, keyed by (tenant, request id): ids are the
    caller's, so one tenant reusing another's id must not replace (or reveal) the other's trace."""

    def __init__(self, capacity: int = 10_000) -> None:
        self.capacity = capacity
        self._traces: OrderedDict[tuple[str | None, str], RequestTrace] = OrderedDict()

    def add(self, trace: RequestTrace) -> None:
        key = (trace.tenant, trace.request_id)
        self._traces[key] = trace
        self._traces.move_to_end(key)
        while len(self._traces) > self.capacity:
            self._traces.popitem(last=False)

    def get(self, tenant: str | None, request_id: str) -> RequestTrace | None:
        return self._traces.get((tenant, request_id))

    def newest_with_id(self, request_id: str) -> RequestTrace | None:
        """Any tenant's latest trace with this id (for an admin; a scan, admins are few)."""
        return next((t for t in reversed(self._traces.values()) if t.request_id == request_id), None)
