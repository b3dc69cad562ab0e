"""The door: the first code every HTTP request meets, before any handler runs.

Pure ASGI (so streaming and disconnect detection pass through untouched): it stamps arrival,
assigns the request id, refuses oversized bodies before reading them, authenticates the API key,
admits the request's connection (gateway/connection_budget.py), reads the body before any handler
runs, and adds the request id (and any rate-limit headers) to every response — a 401 or 413 included.
It knows nothing about models or engines, so a router with no local engine uses it unchanged.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import Mapping

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenline.gateway.connection_budget import Admission
from tokenline.gateway.door_policy import ADMIT_SCOPE_KEY, Access, DoorPolicy
from tokenline.gateway.errors import APIError, shorten
from tokenline.gateway.keys import KeyStore
from tokenline.gateway.metrics import ServerMetrics
from tokenline.gateway.rate_limit import RateLimiter

access_logger = logging.getLogger("tokenline.access")
logger = logging.getLogger(__name__)

_REQUEST_ID_OK = re.compile(r"[^A-Za-z0-9._:\-]")


def sanitize_request_id(value: str | None) -> str:
    """Keep a caller's X-Request-Id if it is printable and short; otherwise assign one."""
    if value:
        cleaned = _REQUEST_ID_OK.sub("", value)[:128]
        if cleaned:
            return cleaned
    return uuid.uuid4().hex


class Door:
    """The door, as pure ASGI (so streaming and disconnect detection pass through untouched):
    stamps arrival, assigns the request id, refuses oversized bodies before reading them, and
    adds the id (and any rate-limit headers the handler left) to every response."""

    def __init__(
        self,
        app: ASGIApp,
        max_request_bytes: int,
        keys: KeyStore | None,
        limiter: RateLimiter | None,
        metrics: ServerMetrics,
        policy: DoorPolicy | None = None,
        path_byte_limits: Mapping[str, int] | None = None,
    ) -> None:
        self.app = app
        self.max_request_bytes = max_request_bytes
        # Smaller limits for some paths: /tokenize costs no tokens, so its size is its only price.
        self.path_byte_limits = {p: min(n, max_request_bytes) for p, n in (path_byte_limits or {}).items()}
        self.keys = keys
        self.policy = policy or DoorPolicy(keys_configured=keys is not None)
        self.limiter = limiter
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        state["arrived"] = time.monotonic()
        headers = dict(scope.get("headers") or [])
        raw = headers.get(b"x-request-id")
        request_id = sanitize_request_id(raw.decode("latin-1") if raw else None)
        state["request_id"] = request_id
        state["extra_headers"] = {}
        path = scope.get("path", "")

        def log_access() -> None:
            # Our access log (uvicorn's is off): every line names the request id and, once a
            # handler made one, the response id (chatcmpl-…) that the ledger and trace also hold.
            access_logger.info(
                "%s %s %s request_id=%s response_id=%s %.1fms", scope.get("method"), path, state.get("status", "-"),
                request_id, state.get("response_id", "-"), (time.monotonic() - state["arrived"]) * 1000,
            )

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                state["status"] = message["status"]
                own = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
                present = {name.lower() for name, _ in own}
                # A handler's own value wins (a 429's x-ratelimit-* are fresher than the door's peek).
                extra = [(k.encode(), v.encode()) for k, v in state["extra_headers"].items() if k.encode() not in present]
                message["headers"] = [*own, *extra]
            await send(message)

        async def refuse(error: APIError, reason: str) -> None:
            self.metrics.rejected.labels(reason).inc()
            await error.to_response()(scope, receive, send_with_headers)
            log_access()

        declared = headers.get(b"content-length")
        byte_limit = self.path_byte_limits.get(path, self.max_request_bytes)
        if declared is not None and declared.isdigit() and int(declared) > byte_limit:
            await refuse(APIError.payload_too_large(self._too_large(byte_limit)), "body_too_large")
            return
        state["tenant"] = None
        server = scope.get("server")
        access = self.policy.access(path, server[1] if server else None)
        if access is Access.ABSENT:
            await refuse(APIError.not_found(f"no route {shorten(path)!r} on this address"), "not_on_this_listener")
            return
        if self.keys is not None and access in (Access.KEY, Access.ADMIN):
            tenant = self.keys.authenticate(_bearer_token(headers.get(b"authorization")))  # constant time
            if tenant is None:
                await refuse(APIError.unauthorized("Incorrect or missing API key."), "unauthorized")
                return
            if access is Access.ADMIN and not tenant.admin:
                await refuse(APIError.forbidden("this endpoint needs an admin key"), "forbidden")
                return
            state["tenant"] = tenant
            if self.limiter is not None:
                try:
                    limits = await self.limiter.headers(tenant)  # as OpenAI: on every response of a limited key
                except APIError as exc:  # the shared limit store is unreachable: refuse, never run unlimited
                    await refuse(exc, "rate_limiter_unavailable")
                    return
                if limits is not None:
                    state["extra_headers"].update(limits.as_dict())
        admit = scope.get(ADMIT_SCOPE_KEY)  # set by the HTTP protocol (api/http_protocol.py)
        if admit is None or not self.policy.admits(path, state["tenant"] is not None):
            admit = lambda: Admission.ADMITTED  # noqa: E731 - probes, open pages, or no protocol of ours
        admission = admit()
        if admission is Admission.REFUSED:
            await refuse(self._all_at_work(), "connection_cap")
            return
        state["authenticated"] = time.monotonic()
        if admission is Admission.AFTER_BODY or scope.get("method") in ("POST", "PUT", "PATCH"):
            # The body is read here, before any handler: a chunked one (it declares no length) up to
            # the limit, and a body that never completes (its client gone, or cut off as too slow by
            # the HTTP protocol) costs no handler work at all.
            try:
                body = await self._read_bounded(receive, byte_limit)
            except _ClientGone:
                log_access()
                return
            if body is None:
                await refuse(APIError.payload_too_large(self._too_large(byte_limit)), "body_too_large")
                return
            receive = _replay(body, receive)
        if admission is Admission.AFTER_BODY and admit() is not Admission.ADMITTED:
            await refuse(self._all_at_work(), "connection_cap")
            return
        try:
            await self.app(scope, receive, send_with_headers)
        except Exception:
            if "status" in state:
                raise  # the response has begun: the server can only close the connection
            # A bug escaped the app. Starlette's last-resort 500 is sent from outside this door
            # and would carry no request id, so the door answers it, in the OpenAI shape.
            logger.exception("unhandled error in %s %s request_id=%s", scope.get("method"), path, request_id)
            await APIError.server_error().to_response()(scope, receive, send_with_headers)
        finally:
            for finish in state.get("on_finish", ()):
                finish()  # e.g. the gateway frees the request id for reuse
            log_access()

    async def _read_bounded(self, receive: Receive, limit: int) -> bytes | None:
        """The whole body, or None past ``limit`` bytes; raises _ClientGone if it never completes."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                raise _ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _all_at_work(self) -> APIError:
        error = APIError.unavailable("all the connections the server allows have a request at work; retry shortly", 1)
        error.headers["Connection"] = "close"  # and free this one
        return error

    def _too_large(self, limit: int) -> str:
        return f"the request body exceeds the limit of {limit} bytes"


class _ClientGone(Exception):
    """The connection closed before the request's body was complete."""


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive channel that hands over an already read body, then the client's own messages."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _bearer_token(header: bytes | None) -> str | None:
    given = header.decode("latin-1") if header else ""
    return given[7:].strip() if given.lower().startswith("bearer ") else None
