"""uvicorn's HTTP protocol with time limits on a request's head and body, and each connection
reported to the server's connection budget (``gateway/connection_budget.py``).

uvicorn bounds idle keep-alive connections (``timeout_keep_alive``) but not a client that sends its
request slowly: a slowloris client dribbling a byte now and then holds its connection (and a file
descriptor) for ever. Here:

- each connection gets ``header_s`` seconds from its first byte (or from opening) to complete a
  request head, for the first request and for each later one on a kept-alive connection; past it
  the connection is closed. A head that completes cancels the timer.
- a request's body must arrive within ``body_s`` seconds of its head and, after the first
  ``BODY_RATE_GRACE_S`` seconds, at ``body_min_rate`` bytes a second on average (Apache's
  mod_reqtimeout rule: each byte buys 1/rate seconds more); past either, the client gets a 408 in
  the OpenAI error shape and the connection is closed.
- the budget hears of each connection opening, changing phase and closing, and the door admits a
  request through the callable the protocol leaves in the scope (``ADMIT_SCOPE_KEY``).

Works on either uvicorn protocol (httptools or h11) by what they share: both start a new
``RequestResponseCycle`` (``self.cycle``, with ``more_body`` and ``response_complete``) when a head
is complete, call ``on_response_complete`` when a response is, and wrap ``self.app``.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from tokenline.gateway.connection_budget import ConnectionBudget, Phase
from tokenline.gateway.door_policy import ADMIT_SCOPE_KEY
from tokenline.gateway.errors import APIError

# A body's first seconds are not held to the minimum rate: a client may open with a pause (TLS,
# Expect: 100-continue, a proxy's buffering) and still send its body at full speed after it.
BODY_RATE_GRACE_S = 5.0
# While uvicorn has stopped reading (the app has not yet taken what came), a body's lateness is the
# server's, not the client's: look again after this long.
_PAUSED_RECHECK_S = 1.0


@functools.lru_cache(maxsize=8)
def _timeout_body(message: str) -> bytes:
    """A 408's body, encoded once per message: a flood of slow bodies gets thousands of them."""
    return json.dumps(APIError(408, message, "timeout_error", code="request_timeout").to_dict()).encode()


class _Sweeper:
    """One timer per server that closes pending connections over budget once they reach their grace,
    when no new connection arrives to do it (``ConnectionBudget.enforce`` says when)."""

    def __init__(self, budget: ConnectionBudget) -> None:
        self.budget = budget
        self.timer: asyncio.TimerHandle | None = None

    def arrange(self, loop: asyncio.AbstractEventLoop, delay: float | None) -> None:
        if delay is not None and self.timer is None:
            self.timer = loop.call_later(delay, self._sweep, loop)

    def _sweep(self, loop: asyncio.AbstractEventLoop) -> None:
        self.timer = None
        self.arrange(loop, self.budget.enforce())


@dataclass(frozen=True)
class ConnectionTimeouts:
    header_s: float | None = 10.0  # --header-timeout
    body_s: float | None = 60.0  # --body-timeout
    body_min_rate: float | None = 500.0  # --body-min-rate, bytes per second


def guarded_protocol(
    base: type[asyncio.Protocol],
    timeouts: ConnectionTimeouts,
    budget: ConnectionBudget,
    on_reject: Callable[[str], None] = lambda reason: None,
) -> type[asyncio.Protocol]:
    """A subclass of uvicorn's ``base`` protocol class (pass it as ``uvicorn.Config(http=...)``).
    ``on_reject`` hears "header_timeout" and "body_timeout" (a metrics label)."""
    sweeper = _Sweeper(budget)

    class GuardedHTTPProtocol(base):  # type: ignore[valid-type, misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._head_timer: asyncio.TimerHandle | None = None
            self._body_timer: asyncio.TimerHandle | None = None
            self._phase = Phase.AWAITING_HEAD
            self._body_started = 0.0
            self._body_bytes = 0
            app: ASGIApp = self.app

            async def guarded(scope: Scope, receive: Receive, send: Send) -> None:
                scope[ADMIT_SCOPE_KEY] = self._admit
                await app(scope, receive, send)

            self.app = guarded

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            sweeper.arrange(self.loop, budget.opened(self, self.client[0] if self.client else None))
            self._start_head_timer()

        def data_received(self, data: bytes) -> None:
            cycle = self.cycle
            super().data_received(data)
            if self.cycle is not cycle:
                self._stop_head_timer()  # a head is complete: its request is under way
            elif self._awaiting_head():
                self._start_head_timer()  # the first bytes of the next request on a kept-alive connection
            if self._phase is Phase.UPLOADING:
                self._body_bytes += len(data)
            self._track_phase()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._track_phase()

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_head_timer()
            self._stop_body_timer()
            budget.closed(self)
            super().connection_lost(exc)

        def evict(self) -> None:
            """The budget closes this connection (``Connection.evict``)."""
            if self.transport.is_closing():
                return
            if self._phase is Phase.UPLOADING:
                self._refuse_slow_body("the request body was still arriving when the server needed its "
                                       "connection for another request; send it faster or retry")
            else:
                self.transport.close()

        # --- phases ----------------------------------------------------------------------------

        def _admit(self) -> bool:
            return budget.admit(self, self._current_phase())

        def _current_phase(self) -> Phase:
            cycle = self.cycle
            if cycle is None or cycle.response_complete:
                return Phase.AWAITING_HEAD
            if cycle.more_body and not cycle.response_started:
                return Phase.UPLOADING
            return Phase.WORKING

        def _track_phase(self) -> None:
            phase = self._current_phase()
            if phase is self._phase:
                return
            self._phase = phase
            budget.update(self, phase)
            if phase is Phase.UPLOADING:
                self._start_body_timer()
            else:
                self._stop_body_timer()

        # --- the request head ------------------------------------------------------------------

        def _awaiting_head(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _start_head_timer(self) -> None:
            if timeouts.header_s is not None and self._head_timer is None:
                self._head_timer = self.loop.call_later(timeouts.header_s, self._head_timed_out)

        def _stop_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if self._awaiting_head() and not self.transport.is_closing():
                on_reject("header_timeout")
                self.transport.close()

        # --- the request body ------------------------------------------------------------------

        def _start_body_timer(self) -> None:
            self._stop_body_timer()
            self._body_started, self._body_bytes = self.loop.time(), 0
            if timeouts.body_s is not None or timeouts.body_min_rate is not None:
                self._body_timer = self.loop.call_at(self._body_deadline(), self._check_body)

        def _stop_body_timer(self) -> None:
            if self._body_timer is not None:
                self._body_timer.cancel()
                self._body_timer = None

        def _body_deadline(self) -> float:
            deadline = float("inf")
            if timeouts.body_s is not None:
                deadline = self._body_started + timeouts.body_s
            if timeouts.body_min_rate is not None:
                earned = BODY_RATE_GRACE_S + self._body_bytes / timeouts.body_min_rate
                deadline = min(deadline, self._body_started + earned)
            return deadline

        def _check_body(self) -> None:
            self._body_timer = None
            if self._phase is not Phase.UPLOADING or self.transport.is_closing():
                return
            if self.flow.read_paused:
                self._body_timer = self.loop.call_later(_PAUSED_RECHECK_S, self._check_body)
                return
            deadline = self._body_deadline()
            if self.loop.time() < deadline:  # bytes came since the timer was set: they bought time
                self._body_timer = self.loop.call_at(deadline, self._check_body)
                return
            on_reject("body_timeout")
            self._refuse_slow_body(self._too_slow())

        def _too_slow(self) -> str:
            rate, total = timeouts.body_min_rate, timeouts.body_s
            limits = [f"within {total:g} s" if total is not None else "",
                      f"at {rate:g} bytes/s after its first {BODY_RATE_GRACE_S:g} s" if rate is not None else ""]
            return f"the request body did not arrive {' and '.join(x for x in limits if x)}"

        def _refuse_slow_body(self, message: str) -> None:
            """A 408 in the OpenAI shape, written here (the app is still waiting for the body), then
            the connection closes; the app sees a disconnect."""
            cycle = self.cycle
            if cycle is not None and not cycle.response_started:
                body = _timeout_body(message)
                head = [b"HTTP/1.1 408 Request Timeout", b"content-type: application/json",
                        b"content-length: %d" % len(body), b"connection: close"]
                state = cycle.scope.get("state") or {}
                state["status"] = 408  # for the door's access line: it sees only a disconnect
                request_id = state.get("request_id")
                if request_id:
                    head.append(b"x-request-id: " + request_id.encode())
                self.transport.write(b"\r\n".join(head) + b"\r\n\r\n" + body)
                cycle.disconnected = True  # the app's later writes are dropped, its receive() ends
                cycle.message_event.set()
            self.transport.close()

    GuardedHTTPProtocol.__name__ = f"Guarded{base.__name__}"
    return GuardedHTTPProtocol
