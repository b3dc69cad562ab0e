"""The HTTP application: routes, request ids, API-key check, health, and the engine's lifecycle.

The API process does HTTP (here), the gateway's policy (keys, limits, ledger, metrics, traces) and
the request processor's text work (templates, tokens, detokenization); the engine (scheduler +
model) sits behind an ``EngineClient`` — by default its own process (``EngineProcessClient``). The app answers ``/health`` with 503
while the model loads and after the engine dies, and 200 when it is ready; meanwhile every route but
the probes and /metrics answers 503 (``readiness.py``).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI

from tokenline import __version__
from tokenline.api.admin_routes import admin_router
from tokenline.api.body_check import reject_invalid_unicode
from tokenline.api.chat_serving import ChatServing
from tokenline.api.completion_serving import CompletionServing
from tokenline.api.dashboard import install_dashboard
from tokenline.api.head_requests import HeadAsGet
from tokenline.api.http_protocol import ConnectionTimeouts, guarded_protocol
from tokenline.api.observability_routes import observability_router
from tokenline.api.openai_routes import openai_router
from tokenline.api.openapi_doc import ERROR_RESPONSES, install_openapi
from tokenline.api.passthrough import PassthroughServing
from tokenline.api.protocol import ChatCompletionRequest, CompletionRequest
from tokenline.api.readiness import ReadinessGate
from tokenline.api.responses import ResponsesServing
from tokenline.api.responses_routes import responses_router
from tokenline.api.serving import ServingDeps
from tokenline.engine.client import EngineClient
from tokenline.engine.process_client import EngineProcessClient
from tokenline.settings.server import ServerSettings
from tokenline.frontend.processor import InputProcessor, PromptError
from tokenline.frontend.reasoning import REASONING_FORMATS
from tokenline.frontend.text_pool import TextWorkPool
from tokenline.frontend.tokenizer import Tokenizer
from tokenline.gateway.connection_budget import ConnectionBudget, ConnectionLimits
from tokenline.gateway.door import Door
from tokenline.gateway.door_policy import DoorPolicy, resolve_metrics_auth
from tokenline.gateway.errors import install_error_handlers
from tokenline.gateway.filters import load_filter_file
from tokenline.gateway.gateway import Gateway, GatewayLimits
from tokenline.gateway.keys import KeyStore
from tokenline.gateway.ledger import PriceTable, UsageLedger, default_ledger_path
from tokenline.gateway.live_events import LiveEvents
from tokenline.gateway.metrics import ServerMetrics, StatsSource
from tokenline.gateway.rate_limit import make_rate_limiter
from tokenline.gateway.response_store import ResponseStore
from tokenline.gateway.trace import TraceStore
from tokenline.model.config import ModelConfig, load_generation_config
from tokenline.router.data_parallel import DEFAULT_DATA_PARALLEL_POLICY, build_policy, local_fleet
from tokenline.store.model_store import DEFAULT_MODEL_NAME, resolve_model

logger = logging.getLogger("tokenline.api")

ENGINE_CRASH_LOOP_EXIT_CODE = 3  # the server's exit status when the engine keeps dying


def served_model_names(settings: ServerSettings) -> list[str]:
    """The names clients may ask for, the reported one first (default: the model argument)."""
    names = settings.served_model_name
    if isinstance(names, str):
        names = [names]
    return list(dict.fromkeys(names or [settings.model or DEFAULT_MODEL_NAME]))


def build_gateway(settings: ServerSettings, stats: StatsSource, served_model_name: str) -> Gateway:
    """Keys, limits, ledger, metrics and traces from the settings; needs no engine, only its stats."""
    keys: KeyStore | None = None
    if settings.keys_file:
        keys = KeyStore.from_file(settings.keys_file)
    elif settings.api_key:
        keys = KeyStore.single_key(settings.api_key)
    prices = PriceTable.from_file(settings.prices_file) if settings.prices_file else PriceTable.from_dict({})
    return Gateway(
        ServerMetrics(stats, served_model_name, tenant_labels=settings.metrics_tenant_labels),
        keys=keys,
        limiter=make_rate_limiter(settings.redis_url) if keys is not None else None,
        ledger=UsageLedger(Path(settings.usage_db) if settings.usage_db else default_ledger_path(), prices),
        limits=GatewayLimits(settings.max_request_bytes, settings.max_messages, settings.max_tokens_cap),
        log_prompts=settings.log_prompts,
        content_filters=load_filter_file(settings.content_filter) if settings.content_filter else (),
        filter_holdback=settings.filter_holdback,
        traces=TraceStore(settings.traces_per_tenant),
        prefix_cache_scope=settings.prefix_cache_scope,
    )


def door_policy(settings: ServerSettings) -> DoorPolicy:
    """What the door asks of each path; a contradictory setting raises ValueError."""
    keys_configured = bool(settings.keys_file or settings.api_key)
    if settings.metrics_port is not None and settings.metrics_port == settings.port:
        raise ValueError("--metrics-port must differ from --port")
    return DoorPolicy(
        keys_configured=keys_configured,
        metrics_auth=resolve_metrics_auth(settings.metrics_auth, keys_configured, settings.metrics_port),
        metrics_port=settings.metrics_port,
    )


def connection_budget(settings: ServerSettings, metrics: ServerMetrics) -> ConnectionBudget:
    """The budgets over the server's connections, their sizes on /metrics and their evictions
    counted as refusals."""
    budget = ConnectionBudget(
        ConnectionLimits(settings.max_connections, settings.max_pending_connections, settings.max_pending_per_address),
        on_evict=lambda reason: metrics.rejected.labels(reason).inc(),
    )
    metrics.open_connections.labels("pending").set_function(lambda: budget.pending)
    metrics.open_connections.labels("admitted").set_function(lambda: budget.admitted)
    return budget


def build_app(settings: ServerSettings, client: EngineClient | None = None) -> FastAPI:
    """The server's app. ``client``: the engine to serve from (default: a local engine process
    started with the app); any ``EngineClient`` works, the gateway and processor do not care."""
    model_dir = resolve_model(settings.model)
    model_config = ModelConfig.from_dir(model_dir)  # fails fast on an unsupported architecture
    tokenizer = Tokenizer.from_dir(settings.engine.tokenizer or model_dir)
    if settings.chat_template is not None:
        tokenizer.set_chat_template(settings.chat_template)
    model_names = served_model_names(settings)
    served_model_name = model_names[0]
    if client is None and settings.upstreams:
        from tokenline.router.remote_fleet import remote_fleet

        client = remote_fleet(settings.upstreams, settings.routing_policy, settings.session_affinity,
                              api_key=settings.upstream_api_key, health_interval=settings.health_interval,
                              unhealthy_after=settings.unhealthy_after, seed=settings.engine.seed)
    elif client is None and settings.ray is not None:
        from tokenline.router.ray_serve import RayEngineClient  # imports ray: only when asked

        client = RayEngineClient(settings.ray, settings.engine, model_dir, tokenizer.vocab_size)
    elif client is None and settings.data_parallel_size > 1:
        policy_name = settings.routing_policy or DEFAULT_DATA_PARALLEL_POLICY
        client = local_fleet(
            settings.engine, model_dir, tokenizer.vocab_size, settings.data_parallel_size,
            threads_per_engine=settings.threads_per_engine,
            policy=build_policy(policy_name, settings.session_affinity, settings.engine.seed),
            kv_events=policy_name == "kv_events", restart=settings.engine_restart,
        )
    elif client is None:
        client = EngineProcessClient(settings.engine, model_dir, tokenizer.vocab_size, settings.engine_restart)
    gateway = build_gateway(settings, client, served_model_name)
    keys, limiter, ledger, metrics = gateway.keys, gateway.limiter, gateway.ledger, gateway.metrics
    processor = InputProcessor(
        tokenizer,
        load_generation_config(settings.generation_config, model_dir),
        lambda: serving.max_model_len,
        reasoning=REASONING_FORMATS[settings.reasoning_parser] if settings.reasoning_parser else False,
        allow_special_tokens_in_content=settings.allow_special_tokens_in_content,
    )
    # Rendering and tokenizing run off the event loop, bounded, in one pool (frontend/text_pool.py).
    text_pool = TextWorkPool()
    deps = ServingDeps(client, processor, gateway, served_model_name, text_pool, settings.request_timeout,
                       model_names[1:])
    serving = ChatServing(deps, tool_call_parser=settings.tool_call_parser)
    completion_serving = CompletionServing(deps)
    passthrough = _passthrough(settings, client, serving)  # kind=openai upstreams: text forwarded
    # Stored Responses API responses live next to the usage rows, in the ledger's database.
    responses = ResponsesServing(serving, ResponseStore(ledger.path) if ledger is not None else None)

    def give_up(reason: str) -> None:
        # A crash loop: no engine will come back, so the server exits non-zero and whoever runs
        # it (systemd, Kubernetes) restarts it from scratch.
        app.state.exit_code = ENGINE_CRASH_LOOP_EXIT_CODE
        request_exit = getattr(app.state, "request_exit", None)
        if request_exit is not None:
            request_exit()

    client.on_give_up = give_up

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if ledger is not None:
            recovered = await asyncio.to_thread(ledger.recover_interrupted)
            if recovered:
                logger.warning("usage ledger: %d request(s) in flight when a previous server died, "
                               "marked interrupted", recovered)
        client.start()
        logger.info("engine %s loading %s", getattr(client, "pid", None) or type(client).__name__, model_dir)
        # While the engine loads: else the first chat after a start waited ~0.1 s for the tokenizer's
        # user-text copy, long enough for a burst sent with it to catch up and share its first step.
        for name, error in (await asyncio.to_thread(tokenizer.warm_up)).items():
            logger.warning("chat template %r: %s; chats that need it will be refused", name, error)
        if keys is not None and settings.keys_file and threading.current_thread() is threading.main_thread():
            # Signals reach only the main thread (an app embedded in a thread reloads by POST).
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reload_keys)
        yield
        await client.shutdown()
        await serving.drain()
        await completion_serving.drain()
        if passthrough is not None:
            await passthrough.drain()
        text_pool.close()
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

    app = FastAPI(
        title="tokenline", version=__version__, lifespan=lifespan,
        dependencies=[Depends(reject_invalid_unicode)],  # before any route reads a string
        responses=ERROR_RESPONSES,  # every route may answer these, in the OpenAI error shape
        separate_input_output_schemas=False,  # response models serialize as they validate
    )
    install_openapi(app)
    app.state.serving = serving
    app.state.client = client
    app.state.gateway = gateway
    app.state.exit_code = 0
    connections = app.state.connections = connection_budget(settings, metrics)  # filled by serve()'s protocol
    install_error_handlers(app, invalid_request_errors=(PromptError,))
    # The live page's stream: engine step records, load and request lifecycles (api/dashboard.py).
    gateway.events = LiveEvents(lambda: client.stats, lambda: client.info.num_kv_blocks if client.info else 0)
    client.add_step_listener(gateway.events.on_step)
    install_dashboard(app, gateway.events, keys is not None, served_model_name)

    # Inside the door: until the engine can serve, only the probes and /metrics answer (vLLM's readiness).
    app.add_middleware(ReadinessGate, check_ready=serving.ensure_ready)
    # HEAD wherever GET is served (api/head_requests.py), inside the door: it sees the real method.
    app.add_middleware(HeadAsGet)
    # The outer middleware, pure ASGI: every response, a 401 or 413 included, carries the id.
    app.add_middleware(
        Door, max_request_bytes=gateway.limits.max_request_bytes, keys=keys, limiter=limiter, metrics=metrics,
        policy=door_policy(settings),
        path_byte_limits=dict.fromkeys(("/tokenize", "/detokenize"), settings.max_tokenize_bytes),
    )

    app.include_router(observability_router(client, gateway, connections))
    app.include_router(openai_router(client, gateway, serving, completion_serving, passthrough, model_names, model_dir))
    app.include_router(responses_router(responses, gateway))
    app.include_router(admin_router(keys, ledger, settings.keys_file))
    return app


def _passthrough(settings: ServerSettings, client: EngineClient, serving: ChatServing) -> PassthroughServing | None:
    """The text pass-through when the upstreams are ``kind=openai``; the prompt reservation counts
    with the local tokenizer when the router was given ``--model``, else bytes/4."""
    from tokenline.router.fleet import FleetClient
    from tokenline.router.passthrough import HostedUpstream

    if not (isinstance(client, FleetClient) and all(isinstance(m, HostedUpstream) for m in client.members.values())):
        return None

    def count(request: ChatCompletionRequest | CompletionRequest) -> int:
        if isinstance(request, ChatCompletionRequest):
            return len(serving.render_chat(request))
        return sum(len(p) if isinstance(p, list) else len(serving.processor.encode(p)) for p in request.prompts())

    async def count_off_loop(request: ChatCompletionRequest | CompletionRequest) -> int:
        return await serving.text_pool.run(lambda: count(request))  # tokenizing stays off the event loop

    return PassthroughServing(client, serving.gateway, serving.served_model_name, serving.check_model,
                              count_off_loop if settings.model else None, settings.request_timeout)


def raise_open_file_limit(settings: ServerSettings) -> None:
    """Each connection is a file descriptor: lift the soft limit (often 1,024) toward the hard one so
    that the connection budgets fit, with room for the process's own files; warn when they cannot."""
    import resource

    budgets = (settings.max_connections, settings.max_pending_connections)
    needed = None if None in budgets else sum(budgets) + 512  # type: ignore[arg-type]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    ceiling = hard if hard != resource.RLIM_INFINITY else max(soft, needed or 65536)
    target = ceiling if needed is None else min(ceiling, needed)
    if soft != resource.RLIM_INFINITY and target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    if needed is not None and target < needed:
        logger.warning("open files are limited to %d, short of the %d the connection budgets need; lower "
                       "--max-connections or raise the limit (ulimit -n)", target, needed)


def serve(settings: ServerSettings) -> int:
    """Run the server until SIGINT/SIGTERM (exit status 0; in-flight requests get
    ``shutdown_timeout`` to finish) or an engine crash loop (``ENGINE_CRASH_LOOP_EXIT_CODE``)."""
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

        async def shutdown(self, sockets: list[Any] | None = None) -> None:
            # Live-page streams never end on their own: end them first, or each open page would
            # hold the graceful shutdown for its whole timeout.
            app.state.gateway.events.close()
            await super().shutdown(sockets)

    app = build_app(settings)
    raise_open_file_limit(settings)
    logger.info("serving %s on http://%s:%d", settings.model or DEFAULT_MODEL_NAME, settings.host, settings.port)
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    rejected = app.state.gateway.metrics.rejected
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        timeout_graceful_shutdown=int(settings.shutdown_timeout),
        log_level=settings.uvicorn_log_level,
        access_log=False,  # the gateway's Door logs each request with its id instead
        # Slow request heads and bodies are cut off, connections held to their budgets
        # (api/http_protocol.py); idle keep-alive connections close too.
        http=guarded_protocol(
            AutoHTTPProtocol,
            ConnectionTimeouts(settings.header_timeout, settings.body_timeout, settings.body_min_rate),
            app.state.connections, lambda reason: rejected.labels(reason).inc(),
        ),
        timeout_keep_alive=settings.keep_alive_timeout,  # type: ignore[arg-type]  # a float works
    )
    sockets = None
    if settings.metrics_port is not None:
        # One server, two listeners: the door tells them apart by the local port (door_policy.py).
        metrics_config = uvicorn.Config(app, host=settings.metrics_host or settings.host, port=settings.metrics_port)
        sockets = [config.bind_socket(), metrics_config.bind_socket()]
        logger.info("metrics on http://%s:%d/metrics", metrics_config.host, settings.metrics_port)
    server = Server(config)
    app.state.request_exit = lambda: setattr(server, "should_exit", True)
    server.run(sockets=sockets)
    return int(app.state.exit_code)
