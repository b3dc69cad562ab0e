"""The HTTP application: routes, request ids, API-key check, health, and the engine's lifecycle.

The API process does HTTP, chat templates, tokenization and detokenization; the engine (scheduler
+ model) runs in its own process behind ``AsyncEngineClient``. The app answers ``/health`` with 503
while the model loads and after the engine dies, and 200 when it is ready.
"""

from __future__ import annotations

import hmac
import logging
import re
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenline import __version__
from tokenline.edge.errors import APIError, install_error_handlers
from tokenline.edge.metrics import make_registry, metrics_response
from tokenline.edge.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from tokenline.edge.serving import OpenAIServing
from tokenline.engine.async_client import AsyncEngineClient
from tokenline.engine.config import EngineConfig
from tokenline.frontend.tokenizer import Tokenizer
from tokenline.model.config import ModelConfig
from tokenline.model.model_store import DEFAULT_MODEL_NAME, resolve_model

logger = logging.getLogger("tokenline.edge")

_REQUEST_ID_OK = re.compile(r"[^A-Za-z0-9._:\-]")


@dataclass
class ServerSettings:
    model: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    api_key: str | None = None
    request_timeout: float | None = 600.0  # seconds a request may take end to end
    shutdown_timeout: float = 30.0  # seconds in-flight requests get to finish on SIGTERM
    engine: EngineConfig = field(default_factory=EngineConfig)


def sanitize_request_id(value: str | None) -> str:
    """Keep a caller's X-Request-Id if it is printable and short; otherwise assign one."""
    if value:
        cleaned = _REQUEST_ID_OK.sub("", value)[:128]
        if cleaned:
            return cleaned
    return uuid.uuid4().hex


class RequestIdMiddleware:
    """Pure ASGI (not BaseHTTPMiddleware), so streaming and disconnect detection pass through."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        raw = headers.get(b"x-request-id")
        request_id = sanitize_request_id(raw.decode("latin-1") if raw else None)
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"x-request-id", request_id.encode())]
            await send(message)

        await self.app(scope, receive, send_with_id)


def build_app(settings: ServerSettings) -> FastAPI:
    model_dir = resolve_model(settings.model)
    model_config = ModelConfig.from_dir(model_dir)  # fails fast on an unsupported architecture
    tokenizer = Tokenizer.from_dir(model_dir)
    served_model_name = settings.served_model_name or (settings.model or DEFAULT_MODEL_NAME)
    client = AsyncEngineClient(settings.engine, model_dir, tokenizer.vocab_size)
    serving = OpenAIServing(
        client, tokenizer, served_model_name, model_config.generation_config, settings.request_timeout
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client.start()
        logger.info("engine process %s loading %s", client.pid, model_dir)
        yield
        await client.shutdown()

    app = FastAPI(title="tokenline", version=__version__, lifespan=lifespan)
    app.state.serving = serving
    app.state.client = client
    install_error_handlers(app)

    if settings.api_key:
        expected = settings.api_key.encode()

        @app.middleware("http")
        async def check_api_key(request: Request, call_next: Any) -> Response:
            if request.url.path.startswith("/v1"):
                given = request.headers.get("authorization", "")
                token = given[7:].encode() if given.lower().startswith("bearer ") else b""
                # Constant-time comparison: the time taken must not reveal how much of a key matched.
                if not hmac.compare_digest(token, expected):
                    return APIError.unauthorized("Incorrect or missing API key.").to_response()
            return await call_next(request)

    # Added last so it is the outermost layer: every response, a 401 included, carries the id.
    app.add_middleware(RequestIdMiddleware)

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
    async def models() -> dict[str, Any]:
        info = client.info
        return {
            "object": "list",
            "data": [
                {
                    "id": served_model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "tokenline",
                    "root": str(model_dir),
                    "max_model_len": info.max_model_len if info else None,
                }
            ],
        }

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await serving.chat(body, request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await serving.completion(body, request)

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

    registry = make_registry(client)

    @app.get("/metrics")
    async def metrics() -> Response:
        return metrics_response(registry)

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
    )
    Server(config).run()
