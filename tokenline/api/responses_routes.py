"""The Responses API's routes: create, retrieve and delete a response (``responses.py`` serves them)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from tokenline.api.openapi_doc import success
from tokenline.api.responses import ResponsesServing
from tokenline.api.responses_protocol import ResponsesRequest
from tokenline.gateway.gateway import Gateway, RequestContext


def responses_router(responses: ResponsesServing, gateway: Gateway) -> APIRouter:
    router = APIRouter()

    def context(request: Request, model: str | None) -> RequestContext:
        return gateway.open(request.scope["state"], model)

    @router.post("/v1/responses", responses=success(stream=True))
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        return await responses.create(body, request, context(request, body.model))

    def tenant_name(request: Request) -> str:
        tenant = request.state.tenant  # stored responses are the tenant's own, as in the ledger
        return tenant.name if tenant is not None else "anonymous"

    @router.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str, request: Request) -> dict[str, Any]:
        return await responses.retrieve(response_id, tenant_name(request))

    @router.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request) -> dict[str, Any]:
        return await responses.delete(response_id, tenant_name(request))

    return router
