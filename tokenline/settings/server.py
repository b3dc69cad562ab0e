"""The API process's settings (``tokenline serve`` and ``tokenline router``), each field declaring
its flag; the engine's own live on ``EngineConfig`` and ``RestartPolicy``."""

from __future__ import annotations

import os
from dataclasses import MISSING, dataclass, field
from typing import TYPE_CHECKING, Any

from tokenline.engine.client import RestartPolicy
from tokenline.engine.config import EngineConfig
from tokenline.frontend.reasoning import REASONING_FORMATS
from tokenline.frontend.tool_parsers import TOOL_CALL_FORMATS
from tokenline.gateway.cache_scope import PREFIX_CACHE_SCOPES
from tokenline.setting_field import (
    API_COMMANDS, CONNECTIONS, ENGINE, FLEET, MODEL, OBSERVABILITY, ROUTER, SERVE, SERVER, SIMULATE, TENANTS,
    WIRED, setting,
)
from tokenline.settings.arg_types import filter_holdback, positive_int, positive_seconds, zero_is_none

if TYPE_CHECKING:
    from tokenline.router.ray_serve import RayServeSettings

_ROUTER = frozenset({ROUTER})


def _api_key(value: str | None) -> str | None:
    return value or os.environ.get("VLLM_API_KEY") or None  # vLLM's variable, as a fallback


def _chat_template(value: str | None) -> str | None:
    from tokenline.frontend.chat_template import load_chat_template

    return load_chat_template(value) if value else None


def _positive(value: Any) -> str | None:
    return None if value is None or value >= 1 else f"must be at least 1, got {value}"


@dataclass
class ServerSettings:
    model: str | None = setting(None, group=MODEL, commands={SERVE}, nargs="?",
                                help="HF-format directory or .gguf file (default: SmolLM2)")
    host: str = setting("127.0.0.1", "--host", group=SERVER, commands=API_COMMANDS,
                        help="address the API listens on")
    port: int = setting(8000, "--port", group=SERVER, commands=API_COMMANDS, type=int,
                        help="port the API listens on")
    # The name clients use, or several (vLLM's aliases): the first is the one responses report.
    served_model_name: str | list[str] | None = setting(
        None, "--served-model-name", group=MODEL, commands=API_COMMANDS, nargs="+", metavar="NAME",
        help="names clients use, as vLLM's aliases; the first is reported (default: the model argument)")
    api_key: str | None = setting(  # one key, like vLLM's --api-key
        None, "--api-key", group=TENANTS, commands=API_COMMANDS, convert=_api_key, doc_default="$VLLM_API_KEY",
        help="require this key as a Bearer token on every endpoint but /health, /ping and /live "
             "(default: $VLLM_API_KEY, as vLLM)")
    keys_file: str | None = setting(None, "--keys", group=TENANTS, commands=API_COMMANDS,
                                    help="TOML file of tenants (hashed keys, models, limits); see README")
    redis_url: str | None = setting(None, "--redis-url", group=TENANTS, commands=API_COMMANDS,
                                    help="share rate-limit state between servers through Redis")
    usage_db: str | None = setting(None, "--usage-db", group=TENANTS, commands=API_COMMANDS,
                                   help="SQLite usage ledger (default: $TOKENLINE_HOME/usage.sqlite3)")
    prices_file: str | None = setting(None, "--prices", group=TENANTS, commands=API_COMMANDS,
                                      help="TOML price table, USD per million tokens per model")
    log_prompts: bool = setting(False, "--log-prompts", group=OBSERVABILITY, commands=API_COMMANDS,
                                action="store_true", help="include user text in logs (off by default)")
    content_filter: str | None = setting(
        None, "--content-filter", group=TENANTS, commands=API_COMMANDS, metavar="FILE",
        help="safety filters (TOML or JSON [[content_filter]] tables) for tenants without their own")
    filter_holdback: int | None = setting(  # None: auto
        None, "--filter-holdback", group=TENANTS, commands=API_COMMANDS, type=filter_holdback, metavar="auto|N",
        help="characters of output a stream holds back for the output filters (default auto: the longest "
             "blocklist word less one, so a listed word is never streamed in part)")
    reasoning_parser: str | None = setting(
        None, "--reasoning-parser", group=MODEL, commands=API_COMMANDS, choices=list(REASONING_FORMATS),
        help="split <think>...</think> into the message's reasoning_content (deepseek_r1: the answer starts in "
             "the thought, only </think> may appear)")
    tool_call_parser: str | None = setting(
        None, "--tool-call-parser", group=MODEL, commands=API_COMMANDS, choices=list(TOOL_CALL_FORMATS),
        help="turn the model's tool calls into OpenAI tool_calls (enables `tools`): hermes/qwen3 "
             "<tool_call>{...}</tool_call>, llama3_json {\"name\": ..., \"parameters\": ...}, pythonic [f(x=1)]")
    request_timeout: float | None = setting(
        600.0, "--request-timeout", group=CONNECTIONS, commands=API_COMMANDS, type=float, convert=zero_is_none,
        help="seconds a request may take (0 = no limit)")
    shutdown_timeout: float = setting(30.0, "--shutdown-timeout", group=CONNECTIONS, commands=API_COMMANDS,
                                      type=float, help="seconds in-flight requests get to finish on SIGTERM")
    max_request_bytes: int = setting(4 * 1024 * 1024, "--max-request-bytes", group=TENANTS, commands=API_COMMANDS,
                                     type=int, help="larger bodies get a 413")
    # The same for /tokenize and /detokenize (free of tokens).
    max_tokenize_bytes: int = setting(
        1024 * 1024, "--max-tokenize-bytes", group=TENANTS, commands=API_COMMANDS, type=positive_int,
        help="larger /tokenize and /detokenize bodies get a 413 (at most --max-request-bytes)")
    traces_per_tenant: int = setting(
        10_000, "--traces-per-tenant", group=OBSERVABILITY, commands=API_COMMANDS, type=positive_int,
        help="request traces kept per tenant (refused requests: a tenth as many, apart)")
    max_messages: int = setting(1024, "--max-messages", group=TENANTS, commands=API_COMMANDS, type=int,
                                help="most messages in one chat request")
    max_tokens_cap: int | None = setting(
        None, "--max-tokens-cap", group=TENANTS, commands=API_COMMANDS, type=int,
        help="largest max_tokens a request may ask for; also the max_tokens of requests that omit it")
    # Operator opt-in: special-token strings in message content and text prompts become special
    # tokens (by default user text is tokenized as text and cannot open or close a turn).
    allow_special_tokens_in_content: bool = setting(
        False, "--allow-special-tokens-in-content", group=MODEL, commands=API_COMMANDS, action="store_true",
        help="tokenize special-token strings (<|im_end|>, ...) in message content and text prompts as special "
             "tokens; by default user text stays text")
    # Who may read /metrics with keys configured: "admin", "key" or "none"; None = admin on the API
    # listener, none on its own (--metrics-port). See gateway/door_policy.py.
    metrics_auth: str | None = setting(
        None, "--metrics-auth", group=OBSERVABILITY, commands=API_COMMANDS, choices=["admin", "key", "none"],
        help="what /metrics needs when keys are configured (default: admin on the API's address, none on "
             "--metrics-port)")
    metrics_port: int | None = setting(None, "--metrics-port", group=OBSERVABILITY, commands=API_COMMANDS,
                                       type=int, help="serve /metrics on this port only (not on --port)")
    metrics_host: str | None = setting(None, "--metrics-host", group=OBSERVABILITY, commands=API_COMMANDS,
                                       help="address of the --metrics-port listener (default: --host)")
    metrics_tenant_labels: bool = setting(
        False, "--metrics-tenant-labels", group=OBSERVABILITY, commands=API_COMMANDS, action="store_true",
        help="label spend and rate-limit series with tenant names (off: no tenant names on /metrics)")
    header_timeout: float | None = setting(
        10.0, "--header-timeout", group=CONNECTIONS, commands=API_COMMANDS, type=float, convert=zero_is_none,
        help="seconds a connection has to send a complete request head, else it is closed (0 = none)")
    keep_alive_timeout: float = setting(5.0, "--keep-alive-timeout", group=CONNECTIONS, commands=API_COMMANDS,
                                        type=float, help="seconds an idle keep-alive connection stays open")
    # Connection budgets (gateway/connection_budget.py): connections whose request the door let in
    # (beyond them a new one takes an idle or uploading one's place, else gets a 503), connections
    # that have not yet proved anything, and those from one source address.
    max_connections: int | None = setting(
        1024, "--max-connections", group=CONNECTIONS, commands=API_COMMANDS, type=int, convert=zero_is_none,
        help="connections a request was let in on (with keys: a valid key); beyond them a new request closes "
             "the longest idle or uploading one, or gets a 503 if all are at work (0 = no cap)")
    max_pending_connections: int | None = setting(
        256, "--max-pending-connections", group=CONNECTIONS, commands=API_COMMANDS, type=int,
        convert=zero_is_none,
        help="connections that have not yet sent a request let in; beyond them the oldest (older than 1 s) "
             "still awaiting a head are closed (0 = no cap)")
    max_pending_per_address: int | None = setting(
        32, "--max-pending-per-address", group=CONNECTIONS, commands=API_COMMANDS, type=int, convert=zero_is_none,
        help="the same budget per source address (an IPv6 /64 counts as one; 0 = no cap)")
    body_timeout: float | None = setting(
        60.0, "--body-timeout", group=CONNECTIONS, commands=API_COMMANDS, type=float, convert=zero_is_none,
        help="seconds a request body may take to arrive, else 408 and close (0 = none)")
    body_min_rate: float | None = setting(
        500.0, "--body-min-rate", group=CONNECTIONS, commands=API_COMMANDS, type=float, convert=zero_is_none,
        help="bytes/s a request body must average after its first 5 s, else 408 and close (0 = none)")
    # Who may reuse a cached prompt prefix (gateway/cache_scope.py).
    prefix_cache_scope: str = setting(
        "tenant", "--prefix-cache-scope", group=TENANTS, commands=API_COMMANDS, choices=PREFIX_CACHE_SCOPES,
        help="who may reuse a cached prompt prefix: tenant (only the tenant whose request cached it) or global "
             "(every tenant; cached_tokens and the time to the first token then tell one tenant whether another "
             "sent a prompt)")
    # Template source replacing the model's (vLLM's --chat-template).
    chat_template: str | None = setting(
        None, "--chat-template", group=MODEL, commands=API_COMMANDS, vllm=WIRED, convert=_chat_template,
        help="a Jinja file, or an inline template, replacing the model's")
    generation_config: str = setting(
        "auto", "--generation-config", group=MODEL, commands=API_COMMANDS, vllm=WIRED,
        help="sampling defaults: auto = the model's generation_config.json, vllm = none, or a folder with one")
    uvicorn_log_level: str = setting(
        "info", "--uvicorn-log-level", group=OBSERVABILITY, commands=API_COMMANDS, vllm=WIRED,
        choices=["critical", "error", "warning", "info", "debug", "trace"], help="uvicorn's log level")
    engine: EngineConfig = field(default_factory=EngineConfig)
    # --data-parallel-size: N engine processes behind this API process, a routing policy choosing
    # one per request (tokenline/router); threads per engine default to the cores split evenly.
    data_parallel_size: int = setting(
        1, "--data-parallel-size", "-dp", group=FLEET, commands=API_COMMANDS, type=int, vllm=WIRED,
        refuse=_positive, convert=lambda v: v or 1,
        help="N engine processes behind this API process, --routing-policy choosing one per request")
    threads_per_engine: int | None = setting(
        None, "--threads-per-engine", group=ENGINE, commands={SERVE}, type=int,
        help="torch threads of each engine (default: the cores split between --data-parallel-size engines)")
    routing_policy: str | None = setting(  # default: kv_events (tokenline/router/policies.py)
        None, "--routing-policy", group=FLEET, commands=API_COMMANDS | {SIMULATE}, metavar="NAME",
        help="round_robin, least_load, prefix (affinity from the prompts routed) or kv_events (affinity from the "
             "replicas' KV events; the default)")
    session_affinity: bool = setting(
        False, "--session-affinity", group=FLEET, commands=API_COMMANDS | {SIMULATE}, action="store_true",
        help="requests with the same `user` go to the same replica while it is up")
    # `tokenline router`: remote servers (tokenline or vLLM, --upstream values) instead of local
    # engines; this process keeps the gateway and the text work and speaks token ids to them.
    upstreams: list[str] = setting(
        MISSING, "--upstream", default_factory=list, group=FLEET, commands=_ROUTER, action="append",
        metavar="URL[,kv-events=tcp://H:P[,replay=tcp://H:P]]",
        help="an upstream server's base URL serving the same model (repeat for each); with kv-events= the router "
             "reads its KV events (vLLM's ZMQ format) for precise prefix affinity (kv-events-bind=tcp://H:P "
             "instead: the router listens there, for a vLLM whose publisher connects); "
             "URL,kind=openai[,model=NAME]: an OpenAI-compatible endpoint that takes text only (a hosted API), "
             "chat and completions forwarded as text (all upstreams of one router share a kind)")
    upstream_api_key: str | None = setting(None, "--upstream-api-key", group=FLEET, commands=_ROUTER,
                                           help="Bearer key sent to every upstream (requests, /health, /metrics)")
    # Seconds between an upstream's health checks (and /metrics scrapes).
    health_interval: float = setting(2.0, "--health-interval", group=FLEET, commands=_ROUTER,
                                     type=positive_seconds,
                                     help="seconds between health checks (and /metrics scrapes) of each upstream")
    # Failed checks in a row before an upstream is out (a refused connection: 1).
    unhealthy_after: int = setting(
        3, "--unhealthy-after", group=FLEET, commands=_ROUTER, type=int,
        help="failed health checks in a row before an upstream gets no more requests (a refused connection "
             "takes it out at once)")
    # --ray: engine replicas on Ray Serve, routed by the policy in Ray Serve's router (router/ray_serve.py).
    ray: RayServeSettings | None = None
    # A dead engine is restarted with backoff; more deaths than this within the window exit the server.
    engine_restart: RestartPolicy | None = field(default_factory=RestartPolicy)

