"""The admin routes: the usage ledger's summary and reloading the keys file (admin keys only)."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from fastapi import APIRouter, Request

from tokenline.gateway.errors import APIError
from tokenline.gateway.keys import KeyStore
from tokenline.gateway.ledger import UsageLedger, parse_time


def admin_router(keys: KeyStore | None, ledger: UsageLedger | None, keys_file: str | None) -> APIRouter:
    router = APIRouter()

    @router.get("/admin/usage")
    async def admin_usage(request: Request, since: str | None = None, until: str | None = None,
                          tenant: str | None = None) -> dict[str, Any]:
        require_admin(request)
        start, end = admin_time(since, "since"), admin_time(until, "until")
        rows = await asyncio.to_thread(ledger.summary, start, end, tenant)
        return {"object": "list", "data": [dataclasses.asdict(r) for r in rows]}

    @router.post("/admin/keys/reload")
    async def admin_reload(request: Request) -> dict[str, Any]:
        require_admin(request)
        if keys is None or not keys_file:
            raise APIError.bad_request("this server has no keys file to reload")
        try:
            tenants = keys.reload()
        except Exception as exc:  # noqa: BLE001
            raise APIError.bad_request(f"the keys file is invalid; the previous tenants stay: {exc}") from exc
        return {"tenants": len(tenants)}

    def admin_time(value: str | None, param: str) -> float | None:
        try:
            return parse_time(value) if value else None
        except ValueError as exc:
            raise APIError.bad_request(str(exc), param=param) from exc

    def require_admin(request: Request) -> None:
        tenant = request.state.tenant
        if keys is None:
            raise APIError.not_found("admin endpoints need --api-key or --keys")
        if tenant is None or not tenant.admin:
            raise APIError.forbidden("this key may not use admin endpoints")

    return router
