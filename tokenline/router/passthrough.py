"""Upstreams of ``kind=openai``: OpenAI-compatible endpoints that take text only (a hosted API).

A ``HostedUpstream`` is a fleet member for health and routing only: its health check falls back
from ``/health`` (which a hosted API may not have) to ``GET /v1/models``, which also names its
model. Requests do not go through engine requests: ``open_upstream`` routes a caller's request
body with the fleet's policy (``RouteRequest(text=...)``), sends it as text and hands back the
streaming HTTP response; a refused connection or a 5xx before the first byte is retried once on
another upstream, which is ejected for a while. The gateway's side is ``api/passthrough.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx

from tokenline.engine.messages import EngineReady, EngineRequest
from tokenline.router.fleet import FleetClient, NoReplicaError
from tokenline.router.policy import RouteRequest
from tokenline.router.remote_client import RemoteEngineClient
from tokenline.router.upstream_stream import UpstreamError


class HostedUpstream(RemoteEngineClient):
    """One ``kind=openai`` upstream: health and model name; no token-id requests."""

    async def check_once(self) -> None:
        assert self._http is not None
        timeout = max(1.0, self.health_interval)
        try:
            response = await self._http.get("/health", timeout=timeout)
            if response.status_code in (404, 405):  # no /health on a hosted API: its model list answers
                response = await self._http.get("/v1/models", timeout=timeout)
        except httpx.ConnectError as exc:
            self._mark_out(f"connection refused ({exc})", at_once=True)
            return
        except httpx.HTTPError as exc:
            self._mark_out(f"health check failed: {exc!r}")
            return
        if response.status_code != 200:
            self._mark_out(f"{response.request.url.path} answered {response.status_code}")
            return
        info: EngineReady | None = None
        if self.info is None:
            try:
                info = await self._fetch_card()
            except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
                self._mark_out(f"/v1/models unreadable: {exc!r}")
                return
        self._mark_in()
        if info is not None:
            self._set_ready(info)

    async def _fetch_card(self) -> EngineReady:
        assert self._http is not None
        response = await self._http.get("/v1/models")
        response.raise_for_status()
        cards = response.json()["data"]
        card = next((c for c in cards if c.get("id") == self.spec.model), None) or (cards[0] if cards else {})
        self.model = self.spec.model or str(card["id"])
        return EngineReady(max_model_len=int(card.get("max_model_len") or 0), num_kv_blocks=0, block_size=16,
                           dtype="remote")

    def _submit(self, request: EngineRequest) -> None:
        # Only chat and text completions pass through as text; other routes would need token ids.
        self._reject(request.request_id, "model", "this router forwards text to kind=openai upstreams: "
                     "only /v1/chat/completions and /v1/completions are served")


@dataclass
class UpstreamCall:
    """One caller request sent to one upstream: the response is open until ``close_call``."""

    fleet: FleetClient
    upstream: str
    route: RouteRequest
    response: httpx.Response


async def open_upstream(fleet: FleetClient, path: str, body: dict[str, Any], route: RouteRequest) -> UpstreamCall:
    """Send ``body`` to an upstream the policy picks, its ``model`` rewritten to the upstream's.
    A 4xx comes back as it is (the request's own fault); a refused connection or a 5xx is
    retried once elsewhere, then raised as ``UpstreamError`` (502; 503 when none is available)."""
    tried: set[str] = set()
    failure: str | None = None
    for attempt in range(2):
        try:
            name = fleet._route(route, tried, retry=attempt > 0).replica
        except NoReplicaError as exc:
            raise UpstreamError(503 if failure is None else 502, failure or str(exc)) from exc
        tried.add(name)
        member = fleet.members[name]
        assert isinstance(member, HostedUpstream) and member._http is not None
        payload = {**body, "model": member.model or body.get("model")}
        fleet._in_flight[name] += 1
        call = UpstreamCall(fleet, name, route, httpx.Response(599))
        try:
            call.response = await member._http.send(member._http.build_request("POST", path, json=payload),
                                                     stream=True)
        except httpx.ConnectError as exc:
            member._mark_out(f"connection refused ({exc})", at_once=True)
            failure = f"upstream {name} refused the connection"
        except httpx.HTTPError as exc:
            failure = f"upstream {name} failed: {exc!r}"
        else:
            if call.response.status_code < 500:
                return call
            error = UpstreamError.from_body(call.response.status_code, await call.response.aread())
            failure = f"upstream {name} answered {error}"
        await close_call(call)
        fleet.counters[name].errors += 1
        fleet.counters[name].retries += attempt == 0
        fleet.eject(name)
    raise UpstreamError(502, failure or "no upstream answered")


async def close_call(call: UpstreamCall) -> None:
    """Close the upstream response (the upstream sees the disconnect and aborts) and free the slot."""
    try:
        await call.response.aclose()
    finally:
        call.fleet._in_flight[call.upstream] -= 1
        call.fleet.policy.on_finished(call.route.request_id, call.upstream)
