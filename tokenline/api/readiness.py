"""Readiness as vLLM has it: until the engine can serve, only the probes and /metrics answer.

vLLM opens its port once the model is loaded, so scripts (and vLLM's own tooling) wait for
``GET /v1/models`` to answer 200 and then send work. tokenline listens while the engine loads, so
that /health can say "loading"; every other route answers 503 (OpenAI's error shape, with
``Retry-After`` while an engine is on its way) until the engine is ready, and again while a dead
one is replaced. A 200 from any route means requests will be served.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from tokenline.gateway.door_policy import METRICS_PATH, OPEN_PATHS
from tokenline.gateway.errors import APIError

# Answered whatever the engine does: the probes say so themselves, /metrics shows it.
SERVED_WHILE_NOT_READY = OPEN_PATHS | {METRICS_PATH}


class ReadinessGate:
    """Pure ASGI, inside the door (so a refusal carries the request id and is logged):
    ``check_ready`` raises the ``APIError`` a request gets while the engine cannot serve."""

    def __init__(self, app: ASGIApp, check_ready: Callable[[], None]) -> None:
        self.app = app
        self.check_ready = check_ready

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("path", "") not in SERVED_WHILE_NOT_READY:
            try:
                self.check_ready()
            except APIError as error:
                await error.to_response()(scope, receive, send)
                return
        await self.app(scope, receive, send)
