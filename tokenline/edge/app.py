"""The HTTP application: routes, request ids, API-key check, health, and the engine's lifecycle.

The API process does HTTP, chat templates, tokenization and detokenization; the engine (scheduler
+ model) runs in its own process behind ``AsyncEngineClient``. The app answers ``/health`` with 503
while the model loads and after the engine dies, and 200 when it is ready.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import time
import re
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenline import __version__
from tokenline.edge.errors import APIError, install_error_handlers
from tokenline.edge.keys import KeyStore
from tokenline.edge.ledger import PriceTable, UsageLedger, default_ledger_path, parse_time
from tokenline.edge.metrics import ServerMetrics
from tokenline.edge.rate_limit import RateLimiter, make_rate_limiter
from tokenline.edge.trace import RequestTrace, TraceStore
from tokenline.edge.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from tokenline.edge.serving import OpenAIServing, RequestContext
from tokenline.engine.async_client import AsyncEngineClient
from tokenline.engine.config import EngineConfig
from tokenline.frontend.tokenizer import Tokenizer
from tokenline.model.config import ModelConfig
from tokenline.model.model_store import DEFAULT_MODEL_NAME, resolve_model

logger = logging.getLogger("tokenline.edge")
access_logger = logging.getLogger("tokenline.access")

_REQUEST_ID_OK = re.compile(r"[^A-Za-z0-9._:\-]")


@dataclass
class ServerSettings:
    model: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    api_key: str | None = None  # one key, like vLLM's --api-key
    keys_file: str | None = None  # tenants with hashed keys and limits (TOML)
    redis_url: str | None = None  # share rate-limit state between servers
    usage_db: str | None = None  # the usage ledger (SQLite); default under TOKENLINE_HOME
    prices_file: str | None = None  # USD per million input / output tokens, per model (TOML)
    log_prompts: bool = False  # user text is never logged unless asked
    reasoning_parser: str | None = None  # "qwen3": <think>…</think> goes to reasoning_content
    tool_call_parser: str | None = None  # "qwen3" / "hermes": <tool_call>{…}</tool_call> → tool_calls
    request_timeout: float | None = 600.0  # seconds a request may take end to end
    shutdown_timeout: float = 30.0  # seconds in-flight requests get to finish on SIGTERM
    max_request_bytes: int = 4 * 1024 * 1024  # request bodies above this get a 413 unread
    max_messages: int = 1024
    max_tokens_cap: int | None = None  # largest max_tokens a request may ask for
    engine: EngineConfig = field(default_factory=EngineConfig)


def sanitize_request_id(value: str | None) -> str:
    """Keep a caller's X-Request-Id if it is printable and short; otherwise assign one."""
    if value:
        cleaned = _REQUEST_ID_OK.sub("", value)[:128]
        if cleaned:
            return cleaned
    return uuid.uuid4().hex


class EdgeMiddleware:
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
    ) -> None:
        self.app = app
        self.max_request_bytes = max_request_bytes
        self.keys = keys
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
            # Our access log (uvicorn's is off): every line names the request id.
            access_logger.info(
                "%s %s %s request_id=%s %.1fms", scope.get("method"), path, state.get("status", "-"), request_id,
                (time.monotonic() - state["arrived"]) * 1000,
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
        if declared is not None and declared.isdigit() and int(declared) > self.max_request_bytes:
            await refuse(APIError.payload_too_large(self._too_large()), "body_too_large")
            return
        state["tenant"] = None
        if self.keys is not None and (path.startswith("/v1") or path.startswith("/admin")):
            tenant = self.keys.authenticate(_bearer_token(headers.get(b"authorization")))  # constant time
            if tenant is None:
                await refuse(APIError.unauthorized("Incorrect or missing API key."), "unauthorized")
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
        state["authenticated"] = time.monotonic()
        if declared is None and scope.get("method") in ("POST", "PUT", "PATCH"):
            # A chunked body declares no length: read it here, up to the limit, before any handler.
            body = await self._read_bounded(receive)
            if body is None:
                await refuse(APIError.payload_too_large(self._too_large()), "body_too_large")
                return
            receive = _replay(body, receive)
        try:
            await self.app(scope, receive, send_with_headers)
        finally:
            log_access()

    async def _read_bounded(self, receive: Receive) -> bytes | None:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return b"".join(chunks)  # disconnected: the handler will find out
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_request_bytes:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _too_large(self) -> str:
        return f"the request body exceeds the limit of {self.max_request_bytes} bytes"


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


def build_app(settings: ServerSettings) -> FastAPI:
    model_dir = resolve_model(settings.model)
    model_config = ModelConfig.from_dir(model_dir)  # fails fast on an unsupported architecture
    tokenizer = Tokenizer.from_dir(model_dir)
    served_model_name = settings.served_model_name or (settings.model or DEFAULT_MODEL_NAME)
    client = AsyncEngineClient(settings.engine, model_dir, tokenizer.vocab_size)
    metrics = ServerMetrics(client, served_model_name)
    traces = TraceStore()
    keys: KeyStore | None = None
    if settings.keys_file:
        keys = KeyStore.from_file(settings.keys_file)
    elif settings.api_key:
        keys = KeyStore.single_key(settings.api_key)
    limiter = make_rate_limiter(settings.redis_url) if keys is not None else None
    prices = PriceTable.from_file(settings.prices_file) if settings.prices_file else PriceTable.from_dict({})
    ledger = UsageLedger(Path(settings.usage_db) if settings.usage_db else default_ledger_path(), prices)
    serving = OpenAIServing(
        client,
        tokenizer,
        served_model_name,
        model_config.generation_config,
        metrics,
        request_timeout=settings.request_timeout,
        limiter=limiter,
        ledger=ledger,
        log_prompts=settings.log_prompts,
        reasoning_parser=settings.reasoning_parser,
        tool_call_parser=settings.tool_call_parser,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client.start()
        logger.info("engine process %s loading %s", client.pid, model_dir)
        if keys is not None and settings.keys_file:
            loop = asyncio.get_running_loop()
            loop.add_signal_handler(signal.SIGHUP, reload_keys)
        yield
        await client.shutdown()
        await serving.drain()
        ledger.close()
        if limiter is not None:
            await limiter.close()

    def reload_keys() -> None:
        try:
            tenants = keys.reload()  # type: ignore[union-attr]
            logger.info("keys reloaded: %d tenants", len(tenants))
        except Exception as exc:  # noqa: BLE001 - a bad file keeps the old tenants
            logger.error("keys reload failed, keeping the previous tenants: %s", exc)
            raise

    app = FastAPI(title="tokenline", version=__version__, lifespan=lifespan)
    app.state.serving = serving
    app.state.client = client
    install_error_handlers(app)

    # The only middleware, pure ASGI: every response, a 401 or 413 included, carries the id.
    app.add_middleware(
        EdgeMiddleware, max_request_bytes=settings.max_request_bytes, keys=keys, limiter=limiter, metrics=metrics
    )

    def context(request: Request, model: str | None) -> RequestContext:
        trace = RequestTrace(request.state.request_id, model=model)
        trace.mark("arrived", request.state.arrived)
        trace.mark("authenticated", request.state.authenticated)
        tenant = request.state.tenant
        if tenant is not None:
            trace.tenant = tenant.name
            if model is not None and not keys.allows_model(tenant, model):  # type: ignore[union-attr]
                metrics.rejected.labels("model_not_allowed").inc()
                raise APIError.not_found(
                    f"The model `{model}` does not exist or you do not have access to it.",
                    param="model",
                    code="model_not_found",
                )
        traces.add(trace)
        return RequestContext(request.state.request_id, trace, tenant, request.state.extra_headers)

    def check_limits(messages: int, max_tokens: int | None, param: str) -> None:
        if messages > settings.max_messages:
            metrics.rejected.labels("too_many_messages").inc()
            raise APIError.bad_request(
                f"{messages} messages exceed this server's limit of {settings.max_messages}", param="messages"
            )
        if settings.max_tokens_cap is not None and max_tokens is not None and max_tokens > settings.max_tokens_cap:
            metrics.rejected.labels("max_tokens_cap").inc()
            raise APIError.bad_request(
                f"{param} is {max_tokens}; this server allows at most {settings.max_tokens_cap}", param=param
            )

    @app.get("/health")
    async def health() -> Response:
        if client.error:
            return JSONResponse({"status": "error", "error": client.error}, status_code=503)
        if not client.ready:
            return JSONResponse({"status": "loading"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        info = client.info
        tenant = request.state.tenant
        visible = tenant is None or keys.allows_model(tenant, served_model_name)  # type: ignore[union-attr]
        cards = [
            {
                "id": served_model_name,
                "object": "model",
                "created": 0,
                "owned_by": "tokenline",
                "root": str(model_dir),
                "max_model_len": info.max_model_len if info else None,
            }
        ]
        return {"object": "list", "data": cards if visible else []}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        ctx = context(request, body.model)
        check_limits(len(body.messages), body.max_completion_tokens or body.max_tokens,
                     "max_completion_tokens" if body.max_completion_tokens else "max_tokens")
        return await serving.chat(body, request, ctx)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        ctx = context(request, body.model)
        check_limits(0, body.max_tokens, "max_tokens")
        return await serving.completion(body, request, ctx)

    @app.get("/v1/requests/{request_id}/trace")
    async def request_trace(request_id: str, request: Request) -> dict[str, Any]:
        trace = traces.get(request_id)
        tenant = request.state.tenant
        # Another tenant's request is reported as absent, not as forbidden: ids must not leak.
        if trace is None or (tenant is not None and trace.tenant != tenant.name and not tenant.admin):
            raise APIError.not_found(f"no trace for request {request_id!r}", param="request_id")
        return trace.to_dict()

    @app.get("/admin/usage")
    async def admin_usage(request: Request, since: str | None = None, until: str | None = None,
                          tenant: str | None = None) -> dict[str, Any]:
        require_admin(request)
        try:
            start = parse_time(since) if since else None
            end = parse_time(until) if until else None
        except ValueError as exc:
            raise APIError.bad_request(str(exc), param="since" if since else "until") from exc
        rows = await asyncio.to_thread(ledger.summary, start, end, tenant)
        return {"object": "list", "data": [dataclasses.asdict(r) for r in rows]}

    @app.post("/admin/keys/reload")
    async def admin_reload(request: Request) -> dict[str, Any]:
        require_admin(request)
        if keys is None or not settings.keys_file:
            raise APIError.bad_request("this server has no keys file to reload")
        try:
            tenants = keys.reload()
        except Exception as exc:  # noqa: BLE001
            raise APIError.bad_request(f"the keys file is invalid; the previous tenants stay: {exc}") from exc
        return {"tenants": len(tenants)}

    def require_admin(request: Request) -> None:
        tenant = request.state.tenant
        if keys is None:
            raise APIError.not_found("admin endpoints need --api-key or --keys")
        if tenant is None or not tenant.admin:
            raise APIError.forbidden("this key may not use admin endpoints")

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        body.check()
        serving.check_model(body.model)
        if body.messages is not None:
            tokens = serving.render_chat(body)
        else:
            tokens = tokenizer.encode(body.prompt or "", add_special_tokens=body.use_special_tokens)
        info = client.info
        return {"tokens": tokens, "count": len(tokens), "max_model_len": info.max_model_len if info else None}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        serving.check_model(body.model)
        vocab = tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise APIError.bad_request(f"token ids must be in [0, {vocab})", param="tokens")
        return {"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return metrics.response()

    return app


def serve(settings: ServerSettings) -> None:
    """Run the server until SIGINT/SIGTERM; in-flight requests get ``shutdown_timeout`` to finish."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextmanager
        def capture_signals(self) -> Iterator[None]:
            with super().capture_signals():
                try:
                    yield
                finally:
                    # uvicorn re-raises the caught signal after a graceful shutdown, so the
                    # process would die "by SIGTERM"; a drained shutdown is a clean exit (code 0).
                    self._captured_signals.clear()

    app = build_app(settings)
    logger.info("serving %s on http://%s:%d", settings.model or DEFAULT_MODEL_NAME, settings.host, settings.port)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        timeout_graceful_shutdown=int(settings.shutdown_timeout),
        log_level="info",
        access_log=False,  # EdgeMiddleware logs each request with its id instead
    )
    Server(config).run()
