"""What the door asks of each path: no key, any tenant's key, an admin key — or "not here".

With keys configured every path needs a key except the probes (``OPEN_PATHS``): a load balancer
or kubelet carries no key, and they reveal only "up or not". ``/version`` needs a key like the rest:
it tells an attacker which release to target and no probe needs it. ``/metrics`` follows
``metrics_auth``; when it has its own listener (``metrics_port``), that listener serves only
``/metrics`` and the API listener no longer serves it at all.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

OPEN_PATHS = frozenset({"/health", "/ready", "/ping", "/live"})
# The live page and its static files hold no data (a browser cannot send a key with a page load);
# the page asks for a key and sends it on its data stream, GET /v1/events, which needs one.
PAGE_PATH = "/dashboard"
PAGE_FILES_PREFIX = "/dashboard/static/"
METRICS_PATH = "/metrics"
METRICS_AUTH_MODES = ("admin", "key", "none")

# Set on the ASGI scope by the HTTP protocol (api/http_protocol.py): a callable the door calls to
# move the request's connection into the admitted pool; it answers a connection_budget.Admission
# (REFUSED: every admitted connection has a request at work, and the door answers a 503).
ADMIT_SCOPE_KEY = "tokenline.admit_connection"


class Access(enum.Enum):
    OPEN = "open"  # no key asked
    KEY = "key"  # any tenant's key
    ADMIN = "admin"  # an admin tenant's key
    ABSENT = "absent"  # not served on this listener: 404


@dataclass(frozen=True)
class DoorPolicy:
    keys_configured: bool = False
    metrics_auth: str = "none"  # one of METRICS_AUTH_MODES; resolved by resolve_metrics_auth
    metrics_port: int | None = None  # /metrics on its own listener (and only there)

    def access(self, path: str, local_port: int | None) -> Access:
        """What a request for ``path`` arriving on the listener at ``local_port`` needs."""
        if self.metrics_port is not None:
            on_metrics_listener = local_port == self.metrics_port
            if on_metrics_listener != (path == METRICS_PATH):
                return Access.ABSENT
        if path == METRICS_PATH:
            return {"none": Access.OPEN, "key": Access.KEY, "admin": Access.ADMIN}[self.metrics_auth]
        if not self.keys_configured or path in OPEN_PATHS or path == PAGE_PATH or path.startswith(PAGE_FILES_PREFIX):
            return Access.OPEN
        return Access.KEY

    def admits(self, path: str, authenticated: bool) -> bool:
        """Whether a request the door lets through moves its connection into the admitted pool: a
        tenant's (its key checked), or with no keys configured anyone's. Probes never take one (they
        are always answered, so an orchestrator does not restart a server that is merely busy), nor
        does a request that proved nothing (the live page's files, an open /metrics)."""
        return authenticated or (not self.keys_configured and path not in OPEN_PATHS)


def resolve_metrics_auth(requested: str | None, keys_configured: bool, metrics_port: int | None) -> str:
    """The ``--metrics-auth`` mode in force. Default: an admin key when keys are configured and
    /metrics shares the API's listener (it shows spend and load); none on its own listener (an
    operator who moves it there restricts that address instead) or without keys."""
    if requested is None:
        return "admin" if keys_configured and metrics_port is None else "none"
    if requested not in METRICS_AUTH_MODES:
        raise ValueError(f"--metrics-auth must be one of {', '.join(METRICS_AUTH_MODES)}, got {requested!r}")
    if requested != "none" and not keys_configured:
        raise ValueError(f"--metrics-auth {requested} needs --api-key or --keys (there are no keys to check)")
    return requested
