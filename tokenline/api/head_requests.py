"""HEAD wherever GET is served: a HEAD request runs its route's GET handler and gets the same
status and headers, without the body.

FastAPI routes answer only the methods they name (Starlette's own routes add HEAD to GET, FastAPI's
do not), so ``HEAD /metrics`` was a 405 that monitors and link checkers read as "down". Pure ASGI,
like the door: the request goes in as a GET; once its response's head is out, the body is dropped
and the handler stopped, so a stream that never ends (``GET /v1/events``) does not run for nobody.
"""

from __future__ import annotations

import asyncio
import contextlib

from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["HeadAsGet"]


class HeadAsGet:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return
        head_sent = asyncio.Event()

        async def send_head(message: Message) -> None:
            if head_sent.is_set():
                return  # the body of the GET answer: not for a HEAD
            if message["type"] == "http.response.start":
                await send(message)
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                head_sent.set()

        handler = asyncio.ensure_future(self.app({**scope, "method": "GET"}, receive, send_head))
        waiter = asyncio.ensure_future(head_sent.wait())
        try:
            await asyncio.wait({handler, waiter}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
            if not handler.done():
                handler.cancel()  # the head is out: the rest of the answer is not wanted
                with contextlib.suppress(asyncio.CancelledError):
                    await handler
        if not handler.cancelled():
            handler.result()  # the handler's own error, as a GET would raise it
