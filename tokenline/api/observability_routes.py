"""The routes that watch the server rather than serve the model: the probes (vLLM's /health, /ping;
/ready, /live), /version, a request's trace and the Prometheus /metrics."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from tokenline import __version__
from tokenline.api.openapi_doc import HealthStatus, success
from tokenline.engine.client import EngineClient
from tokenline.gateway.connection_budget import ConnectionBudget
from tokenline.gateway.errors import APIError, shorten
from tokenline.gateway.gateway import Gateway


def observability_router(client: EngineClient, gateway: Gateway, connections: ConnectionBudget) -> APIRouter:
    router = APIRouter()
    metrics = gateway.metrics

    @router.get("/health", responses={**success(HealthStatus), 503: {"model": HealthStatus, "description": "Not ready"}})
    async def health() -> Response:
        """Readiness (vLLM's meaning): 200 only while an engine is ready to serve."""
        state = client.state
        body: dict[str, Any] = {"status": state, "engine_pid": client.pid, "engine_restarts": client.restarts}
        if client.error:
            body["error"] = client.error
        if state != "ok":
            headers = {"Retry-After": "1"} if state in ("loading", "restarting") else None
            return JSONResponse(body, status_code=503, headers=headers)
        return JSONResponse(body)

    @router.get("/ready", responses={**success(HealthStatus), 503: {"model": HealthStatus, "description": "Not ready"}})
    async def ready() -> Response:
        """Readiness for traffic: /health's answer, and also 503 ``saturated`` while every connection
        the server admits has a request at work (a new request would get a 503 too)."""
        answer = await health()
        if answer.status_code == 200 and not connections.has_room():
            body = {"status": "saturated", "engine_pid": client.pid, "engine_restarts": client.restarts}
            return JSONResponse(body, status_code=503, headers={"Retry-After": "1"})
        return answer

    @router.get("/live")
    async def live() -> dict[str, str]:
        """Liveness: the API process is up and its event loop answers, whatever the engine does."""
        return {"status": "alive"}

    @router.get("/ping", operation_id="ping_get", responses={**success(HealthStatus), 503: {"model": HealthStatus}})
    @router.post("/ping", operation_id="ping_post", responses={**success(HealthStatus), 503: {"model": HealthStatus}})
    async def ping() -> Response:
        """vLLM's (and SageMaker's) liveness route: the same answer as /health."""
        return await health()

    @router.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @router.get("/v1/requests/{request_id}/trace")
    async def request_trace(request_id: str, request: Request, tenant: str | None = None) -> dict[str, Any]:
        caller = request.state.tenant
        # Ids are per tenant: a caller sees only its own requests; another tenant's request with the
        # same id is reported as absent, not as forbidden. An admin may name the tenant (?tenant=),
        # or gets its own request, else any tenant's latest with that id.
        trace = gateway.traces.get(caller.name if caller is not None else None, request_id)
        if caller is not None and caller.admin:
            if tenant is not None:
                trace = gateway.traces.get(tenant, request_id)
            elif trace is None:
                trace = gateway.traces.newest_with_id(request_id)
        if trace is None:
            raise APIError.not_found(f"no trace for request {shorten(request_id)!r}", param="request_id")
        return trace.to_dict()

    @router.get("/metrics", response_class=PlainTextResponse, responses=success(description="Prometheus metrics"))
    async def prometheus_metrics() -> Response:
        return metrics.response()

    return router
