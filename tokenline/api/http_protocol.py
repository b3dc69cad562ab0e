"""uvicorn's HTTP protocol with a request-head timeout, and the open-connection count for the door.

uvicorn bounds idle keep-alive connections (``timeout_keep_alive``) but not a client that sends its
request head slowly: a slowloris client dribbling a byte now and then holds its connection (and a
file descriptor) for ever. Here each connection gets ``header_timeout`` seconds from its first
byte (or from opening) to complete a request head, for the first request and for each later one on
a kept-alive connection; past it the connection is closed. A head that completes cancels the timer.

Works on either uvicorn protocol (httptools or h11) by what they share: both start a new
``RequestResponseCycle`` (``self.cycle``) when a head is complete, and both wrap ``self.app``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from tokenline.gateway.door_policy import CONNECTIONS_SCOPE_KEY


def guarded_protocol(
    base: type[asyncio.Protocol], header_timeout: float | None, on_header_timeout: Callable[[], None] = lambda: None
) -> type[asyncio.Protocol]:
    """A subclass of uvicorn's ``base`` protocol class (pass it as ``uvicorn.Config(http=...)``)."""

    class GuardedHTTPProtocol(base):  # type: ignore[valid-type, misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._head_timer: asyncio.TimerHandle | None = None
            app: ASGIApp = self.app
            connections = self.connections  # the server's set of open connections, shared by all

            async def counted(scope: Scope, receive: Receive, send: Send) -> None:
                # The door applies the connection cap (an OpenAI-shaped 503, probes exempt).
                scope[CONNECTIONS_SCOPE_KEY] = len(connections)
                await app(scope, receive, send)

            self.app = counted

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._start_head_timer()

        def data_received(self, data: bytes) -> None:
            cycle = self.cycle
            super().data_received(data)
            if self.cycle is not cycle:
                self._stop_head_timer()  # a head is complete: its request is under way
            elif self._awaiting_head():
                self._start_head_timer()  # the first bytes of the next request on a kept-alive connection

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_head_timer()
            super().connection_lost(exc)

        def _awaiting_head(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _start_head_timer(self) -> None:
            if header_timeout is not None and self._head_timer is None:
                self._head_timer = self.loop.call_later(header_timeout, self._head_timed_out)

        def _stop_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if self._awaiting_head() and not self.transport.is_closing():
                on_header_timeout()
                self.transport.close()

    GuardedHTTPProtocol.__name__ = f"Guarded{base.__name__}"
    return GuardedHTTPProtocol
