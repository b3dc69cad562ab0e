"""The HTTP application: routes, request ids, API-key check, health, and the engine's lifecycle.

The API process does HTTP (here), the gateway's policy (keys, limits, ledger, metrics, traces) and
the request processor's text work (templates, tokens, detokenization); the engine (scheduler +
model) sits behind an ``EngineClient`` — by default its own process (``EngineProcessClient``). The app answers ``/health`` with 503
while the model loads and after the engine dies, and 200 when it is ready.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tokenline import __version__
from tokenline.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from tokenline.api.serving import OpenAIServing
from tokenline.engine.client import EngineClient
from tokenline.engine.config import EngineConfig
from tokenline.engine.process_client import EngineProcessClient
from tokenline.frontend.processor import InputProcessor, PromptError
from tokenline.frontend.tokenizer import Tokenizer
from tokenline.gateway.door import Door
from tokenline.gateway.errors import APIError, install_error_handlers
from tokenline.gateway.gateway import Gateway, GatewayLimits, RequestContext
from tokenline.gateway.keys import KeyStore
from tokenline.gateway.ledger import PriceTable, UsageLedger, default_ledger_path, parse_time
from tokenline.gateway.metrics import ServerMetrics, StatsSource
from tokenline.gateway.rate_limit import make_rate_limiter
from tokenline.model.config import ModelConfig
from tokenline.model.model_store import DEFAULT_MODEL_NAME, resolve_model

logger = logging.getLogger("tokenline.api")


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


def build_gateway(settings: ServerSettings, stats: StatsSource, served_model_name: str) -> Gateway:
    """Keys, limits, ledger, metrics and traces from the settings; needs no engine, only its stats."""
    keys: KeyStore | None = None
    if settings.keys_file:
        keys = KeyStore.from_file(settings.keys_file)
    elif settings.api_key:
        keys = KeyStore.single_key(settings.api_key)
    prices = PriceTable.from_file(settings.prices_file) if settings.prices_file else PriceTable.from_dict({})
    return Gateway(
        ServerMetrics(stats, served_model_name),
        keys=keys,
        limiter=make_rate_limiter(settings.redis_url) if keys is not None else None,
        ledger=UsageLedger(Path(settings.usage_db) if settings.usage_db else default_ledger_path(), prices),
        limits=GatewayLimits(settings.max_request_bytes, settings.max_messages, settings.max_tokens_cap),
        log_prompts=settings.log_prompts,
    )


def build_app(settings: ServerSettings, client: EngineClient | None = None) -> FastAPI:
    """The server's app. ``client``: the engine to serve from (default: a local engine process
    started with the app); any ``EngineClient`` works, the gateway and processor do not care."""
    model_dir = resolve_model(settings.model)
    model_config = ModelConfig.from_dir(model_dir)  # fails fast on an unsupported architecture
    tokenizer = Tokenizer.from_dir(model_dir)
    served_model_name = settings.served_model_name or (settings.model or DEFAULT_MODEL_NAME)
    if client is None:
        client = EngineProcessClient(settings.engine, model_dir, tokenizer.vocab_size)
    gateway = build_gateway(settings, client, served_model_name)
    keys, limiter, ledger, metrics = gateway.keys, gateway.limiter, gateway.ledger, gateway.metrics
    serving = OpenAIServing(
        client,
        InputProcessor(
            tokenizer,
            model_config.generation_config,
            lambda: serving.max_model_len,
            reasoning=settings.reasoning_parser is not None,
        ),
        gateway,
        served_model_name,
        request_timeout=settings.request_timeout,
        tool_call_parser=settings.tool_call_parser,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client.start()
        logger.info("engine %s loading %s", getattr(client, "pid", None) or type(client).__name__, model_dir)
        if keys is not None and settings.keys_file and threading.current_thread() is threading.main_thread():
            # Signals reach only the main thread (an app embedded in a thread reloads by POST).
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reload_keys)
        yield
        await client.shutdown()
        await serving.drain()
        if ledger is not None:
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
    app.state.gateway = gateway
    install_error_handlers(app, invalid_request_errors=(PromptError,))

    # The only middleware, pure ASGI: every response, a 401 or 413 included, carries the id.
    app.add_middleware(
        Door, max_request_bytes=gateway.limits.max_request_bytes, keys=keys, limiter=limiter, metrics=metrics
    )

    def context(request: Request, model: str | None) -> RequestContext:
        return gateway.open(request.scope["state"], model)

    @app.get("/health")
    async def health() -> Response:
        if client.error:
            return JSONResponse({"status": "error", "error": client.error}, status_code=503)
        if not client.ready:
            return JSONResponse({"status": "loading"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        """vLLM's (and SageMaker's) liveness route: the same answer as /health."""
        return await health()

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    created = int(time.time())  # when this server started serving the model

    def model_card() -> dict[str, Any]:
        info = client.info
        return {
            "id": served_model_name,
            "object": "model",
            "created": created,
            "owned_by": "tokenline",
            "root": str(model_dir),
            "max_model_len": info.max_model_len if info else None,
        }

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        visible = gateway.allows_model(request.state.tenant, served_model_name)
        return {"object": "list", "data": [model_card()] if visible else []}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> dict[str, Any]:
        if model_id != served_model_name or not gateway.allows_model(request.state.tenant, model_id):
            raise APIError.not_found(f"The model `{model_id}` does not exist.", param="model", code="model_not_found")
        return model_card()

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        ctx = context(request, body.model)
        gateway.check_limits(len(body.messages), body.requested_max_tokens, body.param_names["max_tokens"])
        return await serving.chat(body, request, ctx)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        ctx = context(request, body.model)
        gateway.check_limits(0, body.requested_max_tokens, "max_tokens")
        return await serving.completion(body, request, ctx)

    @app.get("/v1/requests/{request_id}/trace")
    async def request_trace(request_id: str, request: Request) -> dict[str, Any]:
        trace = gateway.traces.get(request_id)
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
        access_log=False,  # the gateway's Door logs each request with its id instead
    )
    Server(config).run()
